"""Moving tagged tensor messages between ranks.

- :mod:`.keys`: :class:`MsgKey`, :class:`Direction`.
- :mod:`.header`: the limits and checks of a message's header; :mod:`.codec`: msgpack header +
  raw tensor frames, bounded decoding.
- :mod:`.base`: the :class:`Transport` interface (what a transport implements and may call),
  :class:`Message`.
- :mod:`.registry`: transports by name (``zmq``, ``torch``, ``fake``, ``fake-plane``,
  ``fake-nccl``, and any registered from outside).
- :mod:`.fake`: in-process :class:`FakeNetwork` with seeded delays for tests.
- :mod:`.zmq`: :class:`ZmqTransport` (ROUTER/DEALER over TCP, Store rendezvous).
- :mod:`.planes`: :class:`PlaneTransport`, a control plane (announcements) plus a
  :class:`DataPlane` (tensor bytes): :mod:`.torch_plane` (NCCL/gloo), :mod:`.fake_plane`.

The names below are imported lazily, so that reading the registry (``rrfp train``'s flags)
loads neither torch nor ZeroMQ.
"""

_LAZY = {
    "CodecError": "rrfp.transport.header",
    "DataPlane": "rrfp.transport.planes",
    "Direction": "rrfp.transport.keys",
    "FakeNetwork": "rrfp.transport.fake",
    "FakeTransport": "rrfp.transport.fake",
    "LocalContext": "rrfp.transport.registry",
    "LocalGroup": "rrfp.transport.registry",
    "Message": "rrfp.transport.base",
    "MsgKey": "rrfp.transport.keys",
    "PeerLost": "rrfp.errors",
    "PlaneTransport": "rrfp.transport.planes",
    "ProcessContext": "rrfp.transport.registry",
    "SendHandle": "rrfp.transport.planes",
    "Transport": "rrfp.transport.base",
    "TransportClosed": "rrfp.errors",
    "TransportEntry": "rrfp.transport.registry",
    "ZmqTransport": "rrfp.transport.zmq",
    "decode": "rrfp.transport.codec",
    "default_host": "rrfp.transport.zmq_rendezvous",
    "encode": "rrfp.transport.codec",
    "register": "rrfp.transport.registry",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'rrfp.transport' has no attribute {name!r}")
