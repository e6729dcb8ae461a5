"""Order policies whose ``W`` tasks float (:class:`WFloat`, hint ``wfloat``) and that also run
later tasks ahead (:class:`OrderAhead`, hint ``ahead``): a fixed order kept for forwards and
input backwards, with zero-bubble's freedom for ``W`` (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"). The hint table (:mod:`rrfp.scheduler.registry`) builds them with
:func:`w_float` and :func:`order_ahead`.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import Sequence

from .guards import RankState, admits
from .memory import MemoryLedger, SizeFn, order_bytes
from .policy import InOrder, _OrderPolicy, room_ahead
from .readyset import ReadySet
from .tasks import F, F_CODE, W_CODE, PipelineSpec, Task
from .validate import order_limits


class WFloat(_OrderPolicy):
    """A total order whose ``W`` tasks float later: the order's next task that is not a ``W``
    (the *planned* task) runs once it is ready and may run, even when a ``W`` the order put
    before it is still pending; a pending ``W`` runs while the planned task waits for its
    input or for bytes. A ``W`` never runs earlier than the order puts it (:attr:`late`), so
    the rank only ever trades a ``W`` for a task the strict order would have waited behind it.
    Zero-bubble's observation (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3): ``W``
    has no cross-rank input, so it can fill any wait, and an input backward run before a
    pending ``W`` sends its gradient down the pipeline sooner. Input backwards and forwards
    keep the order; no "started" notices or cost estimates are needed, so the runtime and the
    simulator run it alike.

    Measured on the suite at 1F1B's memory (``docs/suite.md``): never below the strict
    schedule at the sub-suite's 120 variable points (4 and 8 ranks, seeds 0-2), median
    1.049x against strict-split's 1.039x.

    Bytes: a ``W`` run later than in the order holds its microbatch's bytes longer (the
    ledger keeps a split backward's bytes, or what ``W`` reads, until ``W``). With a byte
    budget the planned forward runs when the bytes held plus its own fit the budget (the
    ledger's count, :attr:`MemoryLedger.held`; that rule, not the guard's banker's check,
    decides: the order already fixes when each microbatch is admitted, and the banker's
    admission overcommit refuses admissions that interleaved 1F1B makes within its own
    peak, which would leave the order waiting forever). Otherwise a pending ``W`` runs
    first; with none pending, the bytes held are the order's own at this point (every other
    task ran in the order), so the forward runs. Bound: ``max(budget, the order's own
    peak)`` (:func:`~rrfp.scheduler.memory.order_bytes`, a split backward's bytes held until
    ``W`` unless ``W``'s are known). With an unknown size (the runtime before it measured a
    stage) every pending ``W`` runs first, so the bytes never exceed the order's. Without a
    budget the rank's guard (the in-flight limit) decides, and a refused forward with no
    ``W`` pending falls back to readiness over the order (:class:`InOrder`).

    Deadlock freedom: a ``W`` the order put before the planned task has its ``I`` done (an
    earlier task of the order), so it is ready; the planned task runs whenever it is ready,
    after at most the pending ``W`` tasks, so a rank waits only where its strict order would.
    That needs every rank's in-flight limit to admit the order's own forwards: below the
    order's own count on some rank (:func:`~rrfp.scheduler.validate.order_limits`, 1F1B's
    ``p - r``), that rank must run another task first while the next rank waits for the
    forward its order puts first, and the pipeline can deadlock (simulated, 4 ranks, 4 or 9
    microbatches, limits 1-5 per rank: 325 of the 505 vectors below the order's own); :func:`check_limits` refuses them when
    the hint is resolved. At or above it, no deadlock was found on any limit vector of 2-4
    ranks, one or two virtual stages (``tests/test_scheduler_wfloat.py``).

    Args:
        order: the rank's order (each of its tasks once).
        ready: the rank's ready set.
        memory: the rank's ledger (its budget and sizes), or None.

    Attributes:
        late: a ``W`` runs only once the order has reached it (True); False lets a ready
            ``W`` fill any wait, even ahead of its place (:class:`OrderAhead`).
    """

    name = "wfloat"
    late = True

    def __init__(self, order: Sequence[Task], ready: ReadySet, memory: MemoryLedger | None = None) -> None:
        super().__init__(order, ready)
        self.memory = memory if memory is not None and memory.budget is not None else None
        keys = self.keys
        self._main = [j for j, (c, _) in enumerate(keys) if c != W_CODE]
        self._ws = [j for j, (c, _) in enumerate(keys) if c == W_CODE]
        self._mpos = 0  # cache: index into _main, no earlier non-W task left to run
        self._wpos = 0  # cache: index into _ws, no earlier W left to run

    def _planned(self, ready: ReadySet) -> int:
        # Index into _main of the first non-W task not finished.
        keys, done, main, mp = self.keys, ready.done, self._main, self._mpos
        while mp < len(main) and done[keys[main[mp]][0]][keys[main[mp]][1]]:
            mp += 1
        self._mpos = mp
        return mp

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        mp = self._planned(ready)
        if mp < len(self._main):
            t = self._run_planned(ready, state, self._main[mp])
            if t is not None:
                return t
            return self._first_w(ready, self._main[mp])
        return self._first_w(ready)

    def _run_planned(self, ready: ReadySet, state: RankState, j: int) -> Task | None:
        """The planned task (order index ``j``) if it may run now; a ``W`` or a readiness
        pick when the budget or the guard refuses it; None when it waits for its input."""
        c, i = self.keys[j]
        if not ready.ready[c][i]:
            return None
        t = self.order[j]
        if c != F_CODE:
            return t
        fits = self._fits(t)
        if fits or (fits is None and not self._guard_refuses(ready, state, i)):
            return t
        w = self._first_w(ready, j)
        if w is not None:
            return w
        if fits is None:  # the guard refused and nothing frees: readiness over the order
            return InOrder.choose(self, ready, state)
        return t  # the bytes held are the order's own: the order ran this forward here

    def _fits(self, t: Task) -> bool | None:
        """Byte budget: whether ``t`` fits beside the bytes held (False for an unknown size,
        so pending ``W`` run first); None without a budget."""
        mem = self.memory
        if mem is None:
            return None
        x = mem.size(t[0], t[2])
        return x is not None and (mem.held + x <= mem.budget or not mem.held)

    def _guard_refuses(self, ready: ReadySet, state: RankState, i: int) -> bool:
        g = state.guard
        return not admits(g.forward(ready, state), g, ready, state, i)

    def _first_w(self, ready: ReadySet, before: int | None = None) -> Task | None:
        """The order's first ready ``W``; with ``before`` (an order index) and :attr:`late`,
        only one the order placed before it."""
        keys, ws, wp = self.keys, self._ws, self._wpos
        d2, r2 = ready.done[W_CODE], ready.ready[W_CODE]
        while wp < len(ws) and d2[keys[ws[wp]][1]]:
            wp += 1
        self._wpos = wp
        lim = before if self.late and before is not None else len(keys)
        for j in ws[wp:]:
            if j >= lim:
                break
            if r2[keys[j][1]]:
                return self.order[j]
        return None


class OrderAhead(WFloat):
    """:class:`WFloat` that also runs ahead: while the planned task waits for its input or
    its bytes, the order's first later ready task other than ``W``; a forward only if the
    order's own byte profile leaves room for it until the order reaches it (the rule of
    :class:`BackfillOrder`: the order's bytes over that stretch plus every forward run ahead
    stay within the order's peak) and, with a budget, it fits beside the bytes held (else the
    guard allows it); a ready ``W`` (even one ahead of its place) when nothing else may run.
    Aggressive: a task run ahead may delay the planned one when its input arrives meanwhile,
    so it can be slower than its strict order (measured: 0.953x-0.971x at some ``v``
    points); ``auto`` keeps it only when its trial beats the strict schedule.

    Bound and deadlock freedom as :class:`WFloat`, with the forwards run ahead counted as the
    order's own: the rule keeps the order's bytes plus theirs within the order's peak, and
    each frees at its input backward, which the order reaches.

    Args:
        order: the rank's order; ready: its ready set; memory: its ledger, or None;
        w_bytes: bytes a split backward's ``W`` reads (the ledger's rule), or None.
    """

    name = "ahead"
    late = False

    def __init__(self, order: Sequence[Task], ready: ReadySet, memory: MemoryLedger | None = None,
                 w_bytes: SizeFn | None = None) -> None:
        super().__init__(order, ready, memory)
        self._sizes = memory
        self._wsize = w_bytes
        self._prefix: list[int] | None = None
        self._index = {x: k for k, x in enumerate(self.order)}
        self._ahead: list[tuple[int, int]] = []  # (order index, bytes) of forwards run ahead

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        mp = self._planned(ready)
        main = self._main
        if mp >= len(main):
            return self._first_w(ready)
        pos = main[mp]
        order, keys, rdy = self.order, self.keys, ready.ready
        c, i = keys[pos]
        waits = not rdy[c][i]
        if not waits and (c != F_CODE or self._ahead_ok(ready, state, order[pos], i)):
            return order[pos]
        # The planned task waits for its input or for bytes: a later task, else a W.
        for j in main[mp + 1:]:
            c, i = keys[j]
            if rdy[c][i] and (c != F_CODE or (self._room(pos, j, order[j]) and self._ahead_ok(ready, state, order[j], i))):
                return order[j]
        w = self._first_w(ready, pos)
        if w is not None or waits:
            return w
        return self._run_planned(ready, state, pos)

    def _ahead_ok(self, ready: ReadySet, state: RankState, t: Task, i: int) -> bool:
        fits = self._fits(t)
        return (not self._guard_refuses(ready, state, i)) if fits is None else fits

    def taken(self, task: Task, state: RankState) -> None:
        """The arbiter took ``task``: remember a forward that ran ahead of the order."""
        if task[1] != F:
            return
        k = self._index[task]
        mp = self._mpos
        if mp < len(self._main) and self._main[mp] != k:
            self._ahead.append((k, self._size(task)))

    def _size(self, t: Task) -> int:
        return (self._sizes.size(t[0], t[2]) or 0) if self._sizes is not None else 1

    def _room(self, pos: int, j: int, t: Task) -> bool:
        if self._prefix is None:
            # The ledger's rule: a split backward's bytes stay until W unless W's are known.
            size = self._sizes.size if self._sizes is not None else (lambda s, m: 1)
            self._prefix = order_bytes(self.order, size, self._wsize or (lambda s, m: None))
        return room_ahead(self._prefix, self._ahead, pos, j, self._size(t))


def check_limits(name: str, spec: PipelineSpec, orders: Sequence[Sequence[Task]], inflight_limit: int | Sequence[int],
                 backpressure: str = "admission") -> None:
    """Refuse in-flight limits under which :class:`WFloat` over ``orders`` can deadlock: any
    rank's limit below the order's own count there (:func:`~rrfp.scheduler.validate.order_limits`;
    the class docstring says why). ``name``: the hint's name, for the message. A list of the
    wrong length passes (the arbiter names it).

    Raises:
        ValueError: one line naming the first such rank, its limit and what its order needs.
    """
    P = spec.placement.n_ranks
    limits = [inflight_limit] * P if isinstance(inflight_limit, int) else list(inflight_limit)
    if len(limits) != P:
        return
    need = order_limits(spec, orders, backpressure)
    bad = next(((r, lim, n) for r, (lim, n) in enumerate(zip(limits, need)) if lim < n), None)
    if bad is not None:
        r, lim, n = bad
        raise ValueError(f"hint {name!r}: in-flight limit {lim} on rank {r} is below its order's own {n} "
                         f"(per rank {need}): {name} keeps the order's forwards and input backwards and could "
                         f"deadlock there; give at least those limits, or use strict-split or bf")


def w_float(*, order, ready, memory=None, **_) -> WFloat:
    """Factory of :class:`WFloat` (hint ``wfloat``)."""
    return WFloat(order, ready, memory)


def order_ahead(*, order, ready, memory=None, w_bytes=None, **_) -> OrderAhead:
    """Factory of :class:`OrderAhead` (hint ``ahead``)."""
    return OrderAhead(order, ready, memory, w_bytes)
