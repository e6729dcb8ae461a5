"""In-process fake network for asyncio tests: seeded delays, reordering, kills.

All ranks live on one event loop. Each message gets a delay drawn from a seeded
per-(src, dst) random stream, so messages overtake each other (also between the
same pair, which ZeroMQ never does: code that passes here does not depend on any
ordering). Delivery is deterministic for a given seed and the same sends: delays
depend only on the seed, the pair and the message's position in that pair's
stream; sends issued in the same loop iteration share one base time; ties
deliver in send order.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from ..errors import TransportClosed
from .base import Message, Transport
from .codec import DEFAULT_MAX_BYTES, encode_sized
from .header import check_meta
from .keys import MsgKey

__all__ = ["DelayFn", "FakeNetwork", "FakeTransport"]

DelayFn = Callable[[int, int, MsgKey | None, random.Random], float]
"""``(src, dst, key, rng) -> seconds``; ``key`` is None for the internal BYE."""

_BYE = object()
_CLOCK_SLACK = 0.001


class FakeNetwork:
    """A network of ``world_size`` :class:`FakeTransport` on the running loop.

    Args:
        world_size: number of ranks.
        seed: seeds every per-pair delay stream.
        delay: ``(lo, hi)`` seconds, uniform; or a :data:`DelayFn`.
        encode: pass payloads through the codec (catches aliasing and codec bugs);
            if False the receiver gets the sender's tensor objects.
        max_bytes: decode limit per message when ``encode``.
        job: job id every transport checks arrivals against (None: not checked).
    """

    def __init__(
        self,
        world_size: int,
        seed: int = 0,
        delay: tuple[float, float] | DelayFn = (0.0, 0.0),
        encode: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
        job: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not callable(delay):
            lo, hi = delay
            if not 0 <= lo <= hi:
                raise ValueError(f"delay must be 0 <= lo <= hi, got {delay}")
        self.world_size = world_size
        self.seed = seed
        self.encode = encode
        self.max_bytes = max_bytes
        self.job = job
        self._delay = delay
        self._transports: dict[int, FakeTransport] = {}
        self._rngs: dict[tuple[int, int], random.Random] = {}
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = itertools.count()
        self._last_when: dict[tuple[int, int], float] = {}
        self._base: float | None = None
        self._const_delay = None if callable(delay) or delay[1] > delay[0] else float(delay[0])
        # One armed timer for the heap's head, not one per message: a timer costs more than
        # the rest of a small message's trip (benchmarks/micro.py).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        # With no delay at all, arrival order is send order: a FIFO drained once per loop
        # iteration replaces the heap and the timer.
        self._fifo: collections.deque = collections.deque()
        self._fifo_armed = False
        self.dead: set[int] = set()

    def transport(self, rank: int) -> FakeTransport:
        """The transport of ``rank`` (created on first call, then the same object)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        t = self._transports.get(rank)
        if t is None:
            t = self._transports[rank] = FakeTransport(self, rank)
            for r in self.dead:
                t.on_peer_lost(r, "killed")
        return t

    def kill(self, rank: int) -> None:
        """Simulate the death of ``rank``: every other rank's pending and next
        ``recv`` raises ``PeerLost(rank)`` (unless ``rank`` already said BYE to it);
        messages in flight to ``rank`` are dropped; the killed transport's own
        ``recv``/``send`` raise TransportClosed."""
        self._gone(rank, "killed", TransportClosed(f"rank {rank} was killed"))

    def abort_all(self) -> None:
        """Every rank aborts at once (the ranks of one process ending after an error): each
        transport closes, and none reports the others lost, since they went together."""
        for rank, t in self._transports.items():
            if rank not in self.dead:
                self.dead.add(rank)
                t._die(TransportClosed(f"rank {rank}: aborted"))

    # -- internals -------------------------------------------------------------

    def _gone(self, rank: int, reason: str, own_error: BaseException) -> None:
        if rank in self.dead:
            return
        self.dead.add(rank)
        own = self._transports.get(rank)
        if own is not None:
            own._die(own_error)
        for r, t in self._transports.items():
            if r != rank:
                t.on_peer_lost(rank, reason)

    def _draw(self, src: int, dst: int, key: MsgKey | None) -> float:
        if self._const_delay is not None:
            return self._const_delay
        rng = self._rngs.get((src, dst))
        if rng is None:
            # str seeds hash with sha512: stable across runs and PYTHONHASHSEED.
            rng = self._rngs[(src, dst)] = random.Random(f"rrfp-fake:{self.seed}:{src}:{dst}")
        if callable(self._delay):
            d = float(self._delay(src, dst, key, rng))
        else:
            lo, hi = self._delay
            d = rng.uniform(lo, hi) if hi > lo else lo
        if d < 0:
            raise ValueError(f"delay function returned a negative delay {d}")
        return d

    def _now(self, loop: asyncio.AbstractEventLoop) -> float:
        # One base time per loop iteration, so that a burst of sends is ordered by
        # its drawn delays alone, not by the wall-clock time encoding took.
        if self._base is None:
            self._base = loop.time()
            loop.call_soon(self._reset_base)
        return self._base

    def _reset_base(self) -> None:
        self._base = None

    def _post(self, src: int, dst: int, key: MsgKey | None, item: Any) -> None:
        if self._const_delay == 0.0:
            if not self._fifo_armed:  # no loop running: raises before anything is queued
                asyncio.get_running_loop().call_soon(self._drain_fifo)
                self._fifo_armed = True
            self._fifo.append((src, dst, item))
            return
        loop = asyncio.get_running_loop()
        when = self._now(loop) + self._draw(src, dst, key)
        pair = (src, dst)
        last = self._last_when.get(pair)
        if item is _BYE:
            # BYE must not overtake the sender's data, as on a real FIFO link.
            if last is not None and last > when:
                when = last
        elif last is None or when > last:
            self._last_when[pair] = when
        heapq.heappush(self._heap, (when, next(self._seq), src, dst, item))
        if self._timer is None or when < self._timer_when or self._timer_loop is not loop:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._pump)
        self._timer_when, self._timer_loop = when, loop

    def _drain_fifo(self) -> None:
        self._fifo_armed = False
        fifo = self._fifo
        deliver = self._deliver
        while fifo:
            deliver(*fifo.popleft())

    def _deliver(self, src: int, dst: int, item: Any) -> None:
        t = self._transports.get(dst)
        if t is None or dst in self.dead:
            return
        if item is _BYE:
            t.on_bye(src)
        elif self.encode:
            t.deliver_frames(src, *item)
        else:
            msg, nbytes = item
            t.deliver_message(msg, nbytes)

    def _pump(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        # uvloop's timers and clock have millisecond resolution and may fire a
        # little early: accept that slack, and re-arm if the head is still not due.
        now = loop.time() + _CLOCK_SLACK
        while self._heap and self._heap[0][0] <= now:
            _, _, src, dst, item = heapq.heappop(self._heap)
            self._deliver(src, dst, item)
        if self._heap and (self._timer is None or self._heap[0][0] < self._timer_when):
            self._arm(loop, self._heap[0][0])


class FakeTransport(Transport):
    """One rank's end of a :class:`FakeNetwork`; same contract as any Transport."""

    def __init__(self, net: FakeNetwork, rank: int) -> None:
        super().__init__(rank, net.world_size, job=net.job, max_bytes=net.max_bytes)
        self._net = net

    async def start(self) -> None:
        if self.closed:
            raise TransportClosed(f"rank {self.rank}: start after close")
        self.started = True

    def send(
        self,
        dst: int,
        key: MsgKey,
        tensors: Sequence[Tensor | None],
        meta: dict[str, Any] | None = None,
    ) -> None:
        if self.closed or self.closing or not self.started or dst.__class__ is not int or not 0 <= dst < self.world_size:
            self.check_send(dst)  # raises for all but a bool or an int subclass in range
        net = self._net
        if net.encode:
            item: Any = encode_sized(key, tensors, meta)  # (frames, nbytes): the receiver counts the same bytes
            nbytes = item[1]
        else:
            if meta is None:
                meta = {}
            else:
                check_meta(meta, "meta")
                meta = dict(meta)
            nbytes = sum(t.nbytes for t in tensors if t is not None)
            item = (Message(self.rank, key, list(tensors), meta), nbytes)
        stats = self.stats
        stats["messages_sent"] += 1
        stats["bytes_sent"] += nbytes
        net._post(self.rank, dst, key, item)

    async def flush(self) -> None:
        # Sends are on the (fake) wire as soon as send() returns.
        if self.lost_peers:
            raise self.lost_peers[min(self.lost_peers)]

    async def close(self, timeout: float = 30.0) -> None:
        if self.closed or self.closing:
            return
        if not self.started:
            self._finish(TransportClosed(f"rank {self.rank}: closed"))
            return
        self.closing = True
        for p in self.peers():
            if p not in self._net.dead:
                self._net._post(self.rank, p, None, _BYE)
        missing = await self.await_byes(timeout)
        self._finish(TransportClosed(f"rank {self.rank}: closed"))
        self.close_outcome(missing, timeout)

    def abort(self) -> None:
        if self.closed:
            return
        self._net._gone(self.rank, "aborted", TransportClosed(f"rank {self.rank}: aborted"))

    def _die(self, err: BaseException) -> None:
        self._finish(err)

    def _finish(self, err: BaseException) -> None:
        self.closed = True
        self.fail(err)
        self.peer_event.set()
