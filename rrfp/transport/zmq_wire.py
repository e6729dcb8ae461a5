"""What both halves of the ZeroMQ transport put on or take off the wire, below the codec.

The control frames (:data:`BYE`, :data:`LOST_NOTICE`) and the raw socket calls of the hot paths. Those call the Cython socket methods with plain int
flags: pyzmq's Python layer (send_multipart, recv_multipart) adds argument checks, a RCVMORE
getsockopt per frame and enum flag arithmetic, which together cost more than ZeroMQ itself for
a small message.
"""

from __future__ import annotations

import zmq

from .codec import Frame

BYE = b"\x00rrfp-bye"
"""The one frame of a goodbye. A msgpack header always starts with a map marker, so this
never parses as data."""
LOST_NOTICE = b"\x00rrfp-lost"
"""First frame of a lost-rank notice; the second is the lost rank in ASCII. A msgpack
header starts with a map marker, so this never parses as data."""
ZERO_COPY_MIN = 64 * 1024
"""Frames at least this big are sent without copying (smaller ones copy faster)."""
raw_send = zmq.backend.Socket.send
raw_recv = zmq.backend.Socket.recv
NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


def send_now(sock: zmq.Socket, frames: list[Frame]) -> None:
    """Hand one message to ZeroMQ without blocking; raises zmq.Again if it cannot take
    it now, in which case nothing was sent.

    Only the first frame can meet a full pipe: ZeroMQ counts the high-water mark in
    whole messages, so the later frames of an accepted first one go through. Frames
    under ZERO_COPY_MIN are copied, which for them is cheaper than pinning the buffer.
    """
    last = len(frames) - 1
    for i, f in enumerate(frames):
        raw_send(sock, f, NOBLOCK if i == last else _MORE_NOBLOCK, len(f) < ZERO_COPY_MIN)
