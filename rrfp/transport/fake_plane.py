"""In-process data plane for tests: seeded delays, tagged or NCCL-like (order-matched, tagless).

All ranks live on one event loop. A :class:`FakeWire` pairs each posted send with a posted
receive of the same (src, dst, channel):

- ``nccl_like=True``: by order alone, like NCCL: the k-th send meets the k-th receive,
  whatever either holds. A size mismatch fails both operations (NCCL would hang or corrupt);
  a same-size mismatch silently lands bytes in the wrong buffer, exactly the failure the
  announcement protocol must make impossible, and that tests detect by the values.
- ``nccl_like=False``: by tag ``(seq, index)``, so the protocol's order does not matter.

A matched pair completes after a delay drawn from a seeded per-(src, dst) stream, so
transfers on different channels and pairs complete out of order.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from typing import Any

import torch
from torch import Tensor

from .planes import DataPlane, Done

__all__ = ["FakeDataPlane", "FakeWire", "WireError"]


class WireError(RuntimeError):
    """A fake transfer failed: peer gone, or a send and receive that do not fit."""


class FakeWire:
    """The shared medium of ``world_size`` :class:`FakeDataPlane`.

    Args:
        world_size: number of ranks.
        seed: seeds every per-pair delay stream.
        delay: ``(lo, hi)`` seconds, uniform, per matched transfer.
        nccl_like: match by order per (src, dst, channel) instead of by tag.

    Attributes:
        transfers: matched transfers so far.
        mismatches: size mismatches seen (each fails its pair).
    """

    def __init__(
        self, world_size: int, seed: int = 0, delay: tuple[float, float] = (0.0, 0.0), nccl_like: bool = True
    ) -> None:
        lo, hi = delay
        if not 0 <= lo <= hi:
            raise ValueError(f"delay must be 0 <= lo <= hi, got {delay}")
        self.world_size = world_size
        self.seed = seed
        self.delay = (float(lo), float(hi))
        self.nccl_like = nccl_like
        self.transfers = 0
        self.mismatches = 0
        self.dead: set[int] = set()
        self._sends: dict[Any, deque] = {}
        self._recvs: dict[Any, deque] = {}
        self._rngs: dict[tuple[int, int], random.Random] = {}
        self._planes: dict[int, FakeDataPlane] = {}

    def plane(self, rank: int, device: torch.device | str = "cpu") -> FakeDataPlane:
        """The data plane of ``rank`` (created on first call, then the same object)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        p = self._planes.get(rank)
        if p is None:
            p = self._planes[rank] = FakeDataPlane(self, rank, torch.device(device))
        return p

    def kill(self, rank: int) -> None:
        """``rank`` is gone: every pending transfer involving it fails on the other side, and
        so do later ones."""
        if rank in self.dead:
            return
        self.dead.add(rank)
        for table in (self._sends, self._recvs):
            for k, q in table.items():
                src, dst = k[0], k[1]
                if rank in (src, dst):
                    while q:
                        owner, _buf, done = q.popleft()
                        if owner != rank:
                            done(WireError(f"rank {rank} lost"))

    def _key(self, src: int, dst: int, channel: int, tag: tuple[int, int]) -> Any:
        return (src, dst, channel) if self.nccl_like else (src, dst, channel, tag)

    def _post(self, table: dict, other: dict, key: Any, owner: int, peer: int, buf: Tensor, done: Done) -> None:
        if peer in self.dead:
            asyncio.get_running_loop().call_soon(done, WireError(f"rank {peer} lost"))
            return
        q = other.get(key)
        if q:
            o_owner, o_buf, o_done = q.popleft()
            if table is self._sends:
                self._match(key, buf, done, o_buf, o_done)
            else:
                self._match(key, o_buf, o_done, buf, done)
            return
        table.setdefault(key, deque()).append((owner, buf, done))

    def _match(self, key: Any, sbuf: Tensor, sdone: Done, rbuf: Tensor, rdone: Done) -> None:
        loop = asyncio.get_running_loop()
        self.transfers += 1
        src, dst = key[0], key[1]
        lo, hi = self.delay
        d = 0.0
        if hi > 0:
            rng = self._rngs.get((src, dst))
            if rng is None:
                rng = self._rngs[(src, dst)] = random.Random(f"rrfp-wire:{self.seed}:{src}:{dst}")
            d = rng.uniform(lo, hi)
        loop.call_later(d, self._finish, src, dst, sbuf, sdone, rbuf, rdone)

    def _finish(self, src: int, dst: int, sbuf: Tensor, sdone: Done, rbuf: Tensor, rdone: Done) -> None:
        if src in self.dead or dst in self.dead:
            for owner, done in ((src, sdone), (dst, rdone)):
                if owner not in self.dead:
                    done(WireError(f"rank {dst if owner == src else src} lost"))
            return
        if sbuf.numel() != rbuf.numel():
            self.mismatches += 1
            err = WireError(f"order mismatch {src}->{dst}: sent {sbuf.numel()} bytes into a {rbuf.numel()}-byte buffer")
            sdone(err)
            rdone(err)
            return
        rbuf.copy_(sbuf)
        sdone(None)
        rdone(None)


class FakeDataPlane(DataPlane):
    """One rank's end of a :class:`FakeWire`."""

    name = "fake"

    def __init__(self, wire: FakeWire, rank: int, device: torch.device) -> None:
        self.wire = wire
        self.rank = rank
        self.device = device
        self._closed = False

    def isend(self, dst: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        w = self.wire
        w._post(w._sends, w._recvs, w._key(self.rank, dst, channel, tag), self.rank, dst, buf, self._guard(done))

    def irecv(self, src: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        w = self.wire
        w._post(w._recvs, w._sends, w._key(src, self.rank, channel, tag), self.rank, src, buf, self._guard(done))

    def _guard(self, done: Done) -> Done:
        def call(exc: BaseException | None) -> None:
            if not self._closed:
                done(exc)

        return call

    def close(self) -> None:
        self._closed = True

    def abort(self) -> None:
        self._closed = True
        self.wire.kill(self.rank)
