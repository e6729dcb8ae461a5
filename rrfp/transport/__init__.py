"""Moving tagged tensor messages between ranks.

- :mod:`.keys`: :class:`MsgKey`, :class:`Direction`.
- :mod:`.codec`: msgpack header + raw tensor frames; bounded decoding.
- :mod:`.base`: the :class:`Transport` interface, :class:`Message`, :class:`PeerLost`.
- :mod:`.fake`: in-process :class:`FakeNetwork` with seeded delays for tests.
- :mod:`.zmq`: :class:`ZmqTransport` (ROUTER/DEALER over TCP, Store rendezvous).
- :mod:`.planes`: :class:`PlaneTransport`, a control plane (announcements) plus a
  :class:`DataPlane` (tensor bytes): :mod:`.torch_plane` (NCCL/gloo), :mod:`.fake_plane`.
- :mod:`.factory`: transports by data-plane name for in-process use.
"""

from ..errors import PeerLost, TransportClosed
from .base import Message, Transport
from .codec import CodecError, decode, encode
from .fake import FakeNetwork, FakeTransport
from .keys import Direction, MsgKey
from .zmq import ZmqTransport, default_host
from .planes import DataPlane, PlaneTransport, SendHandle
from .factory import DATA_PLANES, wrap_fake

__all__ = [
    "CodecError",
    "DATA_PLANES",
    "DataPlane",
    "PlaneTransport",
    "SendHandle",
    "wrap_fake",
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
