"""A stranger's transport: every rank in this process, messages handed over on the event loop.

Written against the public members of :class:`rrfp.transport.base.Transport` only (its
docstring's "implements" and "may call" lists) and registered from outside the package through
:mod:`rrfp.transport.registry`; ``tests/test_transport_conformance.py`` runs its whole suite
on it and a :class:`~rrfp.LocalPipeline` step over it. Every message goes through the codec
(``encode`` here, ``deliver_frames`` on arrival) one loop iteration after it was sent, so a
receiver never sees the sender's tensors, and the loop's FIFO keeps each pair's order (a BYE
never overtakes the data before it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rrfp.errors import TransportClosed
from rrfp.transport.base import Transport
from rrfp.transport.codec import encode, frames_nbytes
from rrfp.transport.registry import LocalContext, LocalGroup, TransportEntry

NAME = "memory"


class MemoryHub:
    """The ranks' meeting point: rank -> its transport."""

    def __init__(self, world_size: int, job: str | None) -> None:
        self.world_size, self.job = world_size, job
        self.ends: dict[int, MemoryTransport] = {}

    def carry(self, src: int, dst: int, frames: list) -> None:
        end = self.ends.get(dst)
        if end is not None:
            end.deliver_frames(src, frames)  # dropped there once closed

    def goodbye(self, src: int, dst: int) -> None:
        end = self.ends.get(dst)
        if end is not None and not end.closed:
            end.on_bye(src)


class MemoryTransport(Transport):
    def __init__(self, hub: MemoryHub, rank: int) -> None:
        super().__init__(rank, hub.world_size, job=hub.job)
        self.hub = hub
        hub.ends[rank] = self

    async def start(self) -> None:
        if self.closed:
            raise TransportClosed(f"rank {self.rank}: start after close")
        self.started = True

    def send(self, dst: int, key: Any, tensors: Any, meta: dict | None = None) -> None:
        self.check_send(dst)
        frames = encode(key, tensors, meta)
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += frames_nbytes(frames)
        asyncio.get_running_loop().call_soon(self.hub.carry, self.rank, dst, frames)

    async def flush(self) -> None:
        # A message is on the "wire" (the loop's queue) as soon as send returns.
        if self.lost_peers:
            raise self.lost_peers[min(self.lost_peers)]

    async def close(self, timeout: float = 30.0) -> None:
        if self.closed or self.closing:
            return
        if not self.started:
            self._release("closed")
            return
        self.closing = True
        loop = asyncio.get_running_loop()
        for p in self.peers():
            loop.call_soon(self.hub.goodbye, self.rank, p)  # after this rank's earlier sends
        missing = await self.await_byes(timeout)
        self._release("closed")
        self.close_outcome(missing, timeout)

    def abort(self) -> None:
        if self.closed:
            return
        self._release("aborted")
        for p, end in self.hub.ends.items():
            if p != self.rank:
                end.on_peer_lost(self.rank, "aborted")  # no loss for a peer it said goodbye to

    def _release(self, how: str) -> None:
        self.closed = True
        self.fail(TransportClosed(f"rank {self.rank}: {how}"))
        self.peer_event.set()


def build(ctx: LocalContext) -> LocalGroup:
    """Every rank's :class:`MemoryTransport` (``ctx``'s delays and seed do not apply: arrival
    order is send order)."""
    hub = MemoryHub(ctx.world_size, ctx.job)
    return LocalGroup([MemoryTransport(hub, r) for r in range(ctx.world_size)])


ENTRY = TransportEntry("a stranger's in-memory transport (tests/memory_transport.py)", local=build)
