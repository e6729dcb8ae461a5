"""The ZeroMQ transport's receive half (a mixin of :class:`~rrfp.transport.zmq.ZmqTransport`).

Arrivals are read from an event-loop reader on the ROUTER's file descriptor, not through
zmq.asyncio's future per receive. Limits come before work: a message is refused by routing id
(unknown, this rank's own, or not the rank that authenticated the connection) and by size
(frames counted as they are read) before anything is decoded; refusals are counted in
``stats``. Control frames (BYE, lost-rank notices) are answered here; data goes to the
transport's mailbox through ``_deliver_frames``.
"""

from __future__ import annotations

import asyncio
import logging

import zmq

from ..errors import TransportClosed
from .zmq_rendezvous import LOST_NOTICE
from .zmq_wire import BYE, NOBLOCK, raw_recv

log = logging.getLogger("rrfp.transport.zmq")

_DRAIN_BUDGET = 256
"""Most arrivals handled per event-loop callback before other callbacks get a turn."""


class RouterReceiver:
    """Methods of :class:`~rrfp.transport.zmq.ZmqTransport` that read its ROUTER; they use its
    ``_router``, ``_router_fd``, ``_loop``, ``_rank_of``, ``_auth``, ``_max_frames``,
    ``_max_wire``, ``stats`` and the base transport's ``_reject``, ``_on_bye``,
    ``_deliver_frames`` and ``_mailbox``."""

    def _start_receiving(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._router is not None
        self._loop = loop
        self._router_fd = self._router.getsockopt(zmq.FD)
        loop.add_reader(self._router_fd, self._drain_router)
        # ZMQ_FD signals edges: anything that arrived before the reader was added
        # raises none, so look once now.
        loop.call_soon(self._drain_router)

    def _stop_receiving(self) -> None:
        # Before the socket closes: the loop must not watch a descriptor ZeroMQ frees.
        fd, self._router_fd = self._router_fd, None
        if fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)

    def _drain_router(self) -> None:
        """Reader callback: hand every complete message on the ROUTER to the mailbox.

        Receives until EAGAIN, because ZMQ_FD only signals again once the socket's
        state changes after that; after _DRAIN_BUDGET messages it reschedules itself
        instead, so that a flood cannot starve other callbacks."""
        if self._router_fd is None:
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
                    self.stats["rejected_oversize"] += 1
                    self._reject(self._rank_of.get(parts[0].bytes, repr(parts[0].bytes[:16])),
                                 f"message over {len(parts) - 1} frames / {size} bytes "
                                 f"(limits {self._max_frames - 1} frames, {self._max_wire} bytes): dropped undecoded")
                    continue
                self._on_router_message(parts)
                if self._router_fd is None:  # closed by a callback of the delivery
                    return
            asyncio.get_running_loop().call_soon(self._drain_router)
        except Exception as e:  # never die silently: the runtime would hang
            if not self._closed:
                log.exception("rank %d: receiver failed", self.rank)
                self._stop_receiving()
                self._mailbox.fail(TransportClosed(f"rank {self.rank}: receiver failed: {e!r}"))

    def _on_router_message(self, parts: list) -> None:
        ident = parts[0].bytes
        src = self._rank_of.get(ident)
        if src is None:
            self.stats["rejected_unknown_peer"] += 1
            self._reject(repr(ident[:16]), "unknown routing id")
            return
        if src == self.rank:  # loopback sends never touch the socket: this is an impostor
            self.stats["rejected_identity"] += 1
            self._reject(src, "routing id of this rank itself")
            return
        if self._auth is not None and parts[0].get("User-Id") != ident.decode():
            self.stats["rejected_identity"] += 1
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
        self._deliver_frames(src, payload)
