"""The ZeroMQ transport's receiver: a part of :class:`~rrfp.transport.zmq.ZmqTransport`.

Arrivals are read from an event-loop reader on the ROUTER's file descriptor, not through
zmq.asyncio's future per receive. Limits come before work: a message is refused by routing id
(unknown, this rank's own, or not the rank that authenticated the connection) and by size
(frames counted as they are read) before anything is decoded; refusals are counted in
``stats``. Control frames (BYE, lost-rank notices) and data are handed to the callbacks the
transport gives it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import zmq

from ..errors import TransportClosed
from .zmq_wire import BYE, LOST_NOTICE, NOBLOCK, raw_recv

log = logging.getLogger("rrfp.transport.zmq")

_DRAIN_BUDGET = 256
"""Most arrivals handled per event-loop callback before other callbacks get a turn."""


class Receiver:
    """Reads one ROUTER socket on the event loop and hands each admitted message on.

    Args:
        router: the bound ROUTER (a plain ``zmq.Socket``).
        rank: this rank.
        rank_of: routing id -> rank, canonical spellings only.
        authenticated: connections carry a ZAP User-Id (CURVE), which must equal the routing id.
        max_frames, max_wire: the most frames (routing id included) and bytes one message may
            have; a bigger one is read off and dropped undecoded.
        stats: the transport's counters (``rejected_oversize``, ``rejected_unknown_peer``,
            ``rejected_identity`` are added to).
        reject: ``reject(src or a description, why)``: log and count a refusal.
        on_bye: ``on_bye(src)``: a peer said goodbye.
        on_lost_notice: ``on_lost_notice(src, body)``: a peer is leaving because it lost the
            rank named in ``body``.
        deliver: ``deliver(src, frames)``: a data message (header and tensor frames).
        fail: ``fail(error)``: the receiver stopped on an error; nothing more arrives.
        closed: ``closed() -> bool``: the transport is closed (its errors are expected).
    """

    def __init__(self, router: zmq.Socket, rank: int, rank_of: dict[bytes, int], authenticated: bool,
                 max_frames: int, max_wire: int, stats: dict[str, int], *,
                 reject: Callable[[Any, str], None], on_bye: Callable[[int], None],
                 on_lost_notice: Callable[[int, bytes], None], deliver: Callable[[int, list], None],
                 fail: Callable[[BaseException], None], closed: Callable[[], bool]) -> None:
        self._router = router
        self.rank = rank
        self._rank_of = rank_of
        self._authenticated = authenticated
        self._max_frames, self._max_wire = max_frames, max_wire
        self._stats = stats
        self._reject, self._on_bye, self._on_lost_notice = reject, on_bye, on_lost_notice
        self._deliver, self._fail, self._closed = deliver, fail, closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    @property
    def fd(self) -> int | None:
        """The ROUTER's descriptor the event loop watches, or None when not reading."""
        return self._fd

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading on ``loop`` (its thread)."""
        self._loop = loop
        self._fd = self._router.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self.drain)
        # ZMQ_FD signals edges: anything that arrived before the reader was added
        # raises none, so look once now.
        loop.call_soon(self.drain)

    def stop(self) -> None:
        """Stop reading (idempotent); call it before the socket closes."""
        # Before the socket closes: the loop must not watch a descriptor ZeroMQ frees.
        fd, self._fd = self._fd, None
        if fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)

    def drain(self) -> None:
        """Reader callback: hand every complete message on the ROUTER to the mailbox.

        Receives until EAGAIN, because ZMQ_FD only signals again once the socket's
        state changes after that; after _DRAIN_BUDGET messages it reschedules itself
        instead, so that a flood cannot starve other callbacks."""
        if self._fd is None:
            return
        sock = self._router
        try:
            for _ in range(_DRAIN_BUDGET):
                try:
                    f = raw_recv(sock, NOBLOCK, False)
                except zmq.Again:
                    return
                parts = [f]
                size, too_big = 0, False
                while f.more:  # the rest of a message is there once its first frame is
                    f = raw_recv(sock, NOBLOCK, False)
                    if too_big:
                        continue  # read off and dropped, never kept
                    size += len(f)
                    parts.append(f)
                    if len(parts) > self._max_frames or size > self._max_wire:
                        too_big = True
                if too_big:
                    self._stats["rejected_oversize"] += 1
                    self._reject(self._rank_of.get(parts[0].bytes, repr(parts[0].bytes[:16])),
                                 f"message over {len(parts) - 1} frames / {size} bytes "
                                 f"(limits {self._max_frames - 1} frames, {self._max_wire} bytes): dropped undecoded")
                    continue
                self._on_router_message(parts)
                if self._fd is None:  # closed by a callback of the delivery
                    return
            asyncio.get_running_loop().call_soon(self.drain)
        except Exception as e:  # never die silently: the runtime would hang
            if not self._closed():
                log.exception("rank %d: receiver failed", self.rank)
                self.stop()
                self._fail(TransportClosed(f"rank {self.rank}: receiver failed: {e!r}"))

    def _on_router_message(self, parts: list) -> None:
        ident = parts[0].bytes
        src = self._rank_of.get(ident)
        if src is None:
            self._stats["rejected_unknown_peer"] += 1
            self._reject(repr(ident[:16]), "unknown routing id")
            return
        if src == self.rank:  # loopback sends never touch the socket: this is an impostor
            self._stats["rejected_identity"] += 1
            self._reject(src, "routing id of this rank itself")
            return
        if self._authenticated and parts[0].get("User-Id") != ident.decode():
            self._stats["rejected_identity"] += 1
            self._reject(src, f"routing id {ident.decode()!r} sent over the connection of rank "
                              f"{parts[0].get('User-Id')!r}")
            return
        payload = parts[1:]
        if len(payload) == 1 and len(payload[0]) == len(BYE) and payload[0].bytes == BYE:
            self._on_bye(src)
            return
        if len(payload) == 2 and len(payload[0]) == len(LOST_NOTICE) and payload[0].bytes == LOST_NOTICE:
            self._on_lost_notice(src, payload[1].bytes)
            return
        self._deliver(src, payload)
