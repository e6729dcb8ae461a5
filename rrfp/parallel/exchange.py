"""The exchange half of TP agreement (RRFP §4.2): all-gather one proposal per TP rank.

Two implementations of one call, ``await exchange(code) -> [code of TP rank 0, 1, ...]``,
``code`` being :func:`~rrfp.scheduler.agreement.encode_task`'s three integers:

- :class:`GlooExchange`: an asynchronous gloo all-gather on a CPU group of the TP ranks (a
  group of its own, so proposals never interleave with the layers' TP collectives). gloo's
  ``Work.is_completed()`` stays False until ``wait()`` (ARCHITECTURE.md "Facts"): ``wait()``
  runs in a helper thread and the loop awaits it, so the rank keeps receiving meanwhile.
- :class:`LocalExchange`: the same exchange between ranks of one process (in-process tests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["GlooExchange", "LocalExchange"]


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
