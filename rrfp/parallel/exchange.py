"""The exchange half of TP agreement (RRFP §4.2): all-gather one proposal per TP rank.

Two implementations of one call, ``await exchange(code) -> [code of TP rank 0, 1, ...]``,
``code`` being :func:`~rrfp.scheduler.agreement.encode_task`'s three integers:

- :class:`GlooExchange`: an asynchronous gloo all-gather on a CPU group of the TP ranks (a
  group of its own, so proposals never interleave with the layers' TP collectives). gloo's
  ``Work.is_completed()`` stays False until ``wait()`` (docs/architecture.md, "Facts"): ``wait()``
  runs in a helper thread and the loop awaits it, so the rank keeps receiving meanwhile.
- :class:`ControlExchange`: the same over the control plane, a ZeroMQ transport between the TP
  ranks (small control messages, one per peer per round; no helper thread: arrivals come in
  on the loop).
- :class:`LocalExchange`: the same exchange between ranks of one process (in-process tests).

Measured against each other in ``benchmarks/bench_tp.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["ControlExchange", "GlooExchange", "LocalExchange"]


class GlooExchange:
    """All-gather proposals over ``group`` (gloo, ``size`` ranks).

    Attributes:
        rounds: exchanges made; seconds: wall time spent in them (the agreement's cost).
    """

    def __init__(self, group, size: int) -> None:
        self.group = group
        self.size = size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rrfp-tp-agree")
        self.rounds = 0
        self.seconds = 0.0

    async def __call__(self, code: Sequence[int]) -> list[tuple[int, ...]]:
        t0 = time.perf_counter()
        mine = torch.tensor(list(code), dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        work = dist.all_gather(out, mine, group=self.group, async_op=True)
        await asyncio.get_running_loop().run_in_executor(self._pool, work.wait)
        self.rounds += 1
        self.seconds += time.perf_counter() - t0
        return [tuple(int(x) for x in o) for o in out]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ControlExchange:
    """All-gather proposals as control messages over a transport between the ``size`` TP ranks
    (``transport.rank`` = TP rank; started by :meth:`start`). A proposal is three integers in
    the message's meta; anything else, or a round already complete, is refused and counted."""

    def __init__(self, transport, size: int) -> None:
        self.transport = transport
        self.size = size
        self.rank = transport.rank
        self._codes: dict[int, dict[int, tuple]] = {}
        self._waiting: dict[int, asyncio.Future] = {}
        self._round = 0
        self._error: BaseException | None = None
        self.rejected = 0
        self.rounds = 0
        self.seconds = 0.0

    async def start(self) -> None:
        await self.transport.start()
        self.transport.set_handler(self._on_message, self._on_error)

    def _on_message(self, msg) -> None:
        k, code = msg.meta.get("round"), msg.meta.get("p")
        ok = (isinstance(k, int) and k >= self._round and isinstance(code, (list, tuple)) and len(code) == 3
              and all(isinstance(x, int) for x in code) and msg.src not in self._codes.get(k, {}))
        if not ok:
            self.rejected += 1
            return
        got = self._codes.setdefault(k, {})
        got[msg.src] = tuple(code)
        fut = self._waiting.get(k)
        if fut is not None and len(got) == self.size and not fut.done():
            fut.set_result(None)

    def _on_error(self, e: BaseException) -> None:
        self._error = e
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(e)

    async def __call__(self, code: Sequence[int]) -> list[tuple[int, ...]]:
        from ..transport.keys import Direction, MsgKey

        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        k = self._round
        key = MsgKey(self.transport.job, k, 0, 0, Direction.CTL)
        for dst in range(self.size):
            if dst != self.rank:
                self.transport.send(dst, key, [], {"round": k, "p": [int(x) for x in code]})
        got = self._codes.setdefault(k, {})
        got[self.rank] = tuple(int(x) for x in code)
        if len(got) < self.size:
            fut = self._waiting[k] = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                self._waiting.pop(k, None)
        self._round += 1
        codes = self._codes.pop(k)
        self.rounds += 1
        self.seconds += time.perf_counter() - t0
        return [codes[r] for r in range(self.size)]

    async def aclose(self) -> None:
        await self.transport.close()


class LocalExchange:
    """An all-gather between ``size`` ranks on one event loop: ``LocalExchange(2).member(r)``
    is TP rank ``r``'s exchange. Round ``k`` completes when every member has posted its
    ``k``-th proposal."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rounds: dict[int, tuple[list, asyncio.Future]] = {}
        self._count = [0] * size
        self.rounds = 0
        self.seconds = 0.0

    def member(self, tp_rank: int):
        async def exchange(code: Sequence[int]) -> list[tuple[int, ...]]:
            k = self._count[tp_rank]
            self._count[tp_rank] += 1
            if k not in self._rounds:
                self._rounds[k] = ([None] * self.size, asyncio.get_running_loop().create_future())
            codes, fut = self._rounds[k]
            codes[tp_rank] = tuple(code)
            if all(c is not None for c in codes):
                self._rounds.pop(k)
                self.rounds += 1
                fut.set_result(list(codes))
            return await fut

        return exchange
