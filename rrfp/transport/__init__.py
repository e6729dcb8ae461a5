"""Moving tagged tensor messages between ranks.

- :mod:`.keys`: :class:`MsgKey`, :class:`Direction`.
- :mod:`.codec`: msgpack header + raw tensor frames; bounded decoding.
- :mod:`.base`: the :class:`Transport` interface, :class:`Message`, :class:`PeerLost`.
- :mod:`.fake`: in-process :class:`FakeNetwork` with seeded delays for tests.
- :mod:`.zmq`: :class:`ZmqTransport` (ROUTER/DEALER over TCP, Store rendezvous).
"""

from .base import Message, PeerLost, Transport, TransportClosed
from .codec import CodecError, decode, encode
from .fake import FakeNetwork, FakeTransport
from .keys import Direction, MsgKey
from .zmq import ZmqTransport, default_host

__all__ = [
    "CodecError",
    "Direction",
    "FakeNetwork",
    "FakeTransport",
    "Message",
    "MsgKey",
    "PeerLost",
    "Transport",
    "TransportClosed",
    "ZmqTransport",
    "decode",
    "default_host",
    "encode",
]
