"""Discrete-event simulation of a pipeline driving the real arbiter (no asyncio, no torch).

The simulator and the runtime share :mod:`rrfp.scheduler`: each simulated rank owns one
:class:`~rrfp.scheduler.arbiter.Arbiter` per step and feeds it the same events the runtime
does (inputs arriving, tasks finishing), so a policy is written once and measured both ways.

Times are in seconds (any consistent unit works).
"""

from __future__ import annotations

import gc
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..scheduler.arbiter import Arbiter
from ..scheduler.backfill import Backfill, CostAverages
from ..scheduler.hints import Hint
from ..scheduler.tasks import F, W, PipelineSpec, Task, TaskRecord

DurationFn = Callable[[int, int, Task], float]  # (step, rank, task) -> seconds
DelayFn = Callable[[int, int, int, Task], float]  # (step, src rank, dst rank, producing task) -> seconds
BytesFn = Callable[[int, int, int], int]  # (step, stage, microbatch) -> activation bytes F holds


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes:
        makespan: time from the start until the last rank finished its last step (s).
        records: every executed task, in dispatch order (empty when ``record=False``).
        busy: per rank, total compute time (s).
        peak_inflight: per rank, the largest in-flight count ``D`` seen in any step.
        step_end: per step, the time the last rank finished it (s).
        peak_inflight_stage: per stage, the most microbatches whose forward had finished and
            whose input backward (``B`` or ``I``) had not: the activations that stage held.
        peak_bytes: per rank, the most activation bytes held at once in any step (all zero
            without ``act_bytes``).
    """

    makespan: float
    records: list[TaskRecord]
    busy: list[float]
    peak_inflight: list[int]
    step_end: list[float] = field(default_factory=list)
    peak_inflight_stage: list[int] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)

    def bubble_fraction(self) -> list[float]:
        """Per rank, the idle share of the makespan (0..1)."""
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]


def _zero_delay(step: int, src: int, dst: int, task: Task) -> float:
    return 0.0


class DeadlockError(RuntimeError):
    """No event is pending but some rank has not finished: the schedule cannot complete."""


def simulate(
    spec: PipelineSpec,
    hint: Hint,
    duration: DurationFn,
    *,
    strict: bool = False,
    inflight_limit: int | Sequence[int] = 32,
    delay: DelayFn = _zero_delay,
    steps: int = 1,
    step_overhead: float = 0.0,
    record: bool = True,
    memory_budget: int | Sequence[int | None] | None = None,
    act_bytes: BytesFn | None = None,
    w_bytes: BytesFn | None = None,
    cost_estimate: DurationFn | None = None,
) -> SimResult:
    """Simulate ``steps`` training steps of ``spec`` under ``hint``.

    Each rank runs one task at a time; when it is idle it asks its arbiter for the next task.
    ``duration(step, rank, task)`` is called once per task, when the rank dispatches it, in each
    rank's dispatch order (a stateful duration model may rely on that). A finished task's
    output reaches its consumer after ``delay(step, src, dst, task)`` seconds (not called, and
    0, when the consumer is on the same rank). Events of equal time are all applied before any
    idle rank decides, and idle ranks decide in rank order, so ties resolve the same way on
    every run. A rank starts step ``k+1`` after its own tasks of step ``k`` and
    ``step_overhead`` seconds (the optimizer step).

    Args:
        spec: the pipeline's shape.
        hint: a policy or total order (:func:`~rrfp.scheduler.hints.resolve_hint`).
        duration: seconds per task.
        strict: run the hint's order exactly (the fixed-order baseline).
        inflight_limit: one limit for every rank, or one per rank.
        delay: seconds per cross-rank message.
        steps: training steps to run back to back.
        step_overhead: seconds each rank spends between its steps.
        record: keep a :class:`TaskRecord` per task (memory grows with the task count).
        memory_budget: activation bytes per rank (one for all, or one per rank; None: none);
            needs ``act_bytes`` (:mod:`rrfp.scheduler.memory`).
        act_bytes: ``act_bytes(step, stage, mb)``, the bytes ``F(stage, mb)`` holds; with it
            the result reports :attr:`SimResult.peak_bytes`.
        w_bytes: ``w_bytes(step, stage, mb)``, the bytes a split backward's ``W`` still reads
            after its ``I`` (None: unknown, all of ``act_bytes`` stays held until ``W``).
        cost_estimate: for a backfilling hint (``hint.backfill``), the estimated seconds of a
            task, ``(step, rank, task) -> seconds``, called any number of times in any order
            (stateless); pass the duration itself for exact costs. None: per-(stage, kind)
            running averages of the tasks finished so far. Every started task's "estimated
            end" notice reaches every rank at once.

    Raises:
        ValueError: a limit or budget list of the wrong length (or a bad hint or budget,
            from the arbiter).
        DeadlockError: naming each unfinished rank and what it waits for.
    """
    # A run allocates millions of short-lived tuples and no reference cycles; the cyclic
    # collector's passes over the growing heap (records, arbiters) cost about a fifth of the
    # run, so it is paused for the run and restored after.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(spec, hint, duration, strict, inflight_limit, delay, steps, step_overhead, record,
                         memory_budget, act_bytes, w_bytes, cost_estimate)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(
    spec: PipelineSpec,
    hint: Hint,
    duration: DurationFn,
    strict: bool,
    inflight_limit: int | Sequence[int],
    delay: DelayFn,
    steps: int,
    step_overhead: float,
    record: bool,
    memory_budget: int | Sequence[int | None] | None = None,
    act_bytes: BytesFn | None = None,
    w_bytes: BytesFn | None = None,
    cost_estimate: DurationFn | None = None,
) -> SimResult:
    place = spec.placement
    P = place.n_ranks
    S = spec.n_stages
    limits = [inflight_limit] * P if isinstance(inflight_limit, int) else list(inflight_limit)
    if len(limits) != P:
        raise ValueError(f"{len(limits)} in-flight limits given for {P} ranks")

    budgets = list(memory_budget) if isinstance(memory_budget, (list, tuple)) else [memory_budget] * P
    if len(budgets) != P:
        raise ValueError(f"{len(budgets)} memory budgets given for {P} ranks")

    rank_of = [place.rank_of(s) for s in range(S)]
    backfilling = hint.backfill and strict
    averages = CostAverages() if backfilling and cost_estimate is None else None
    boards: dict[int, dict[Task, float]] = {}  # step -> started task -> estimated end ("started" notices)

    def estimator(step: int):
        if averages is not None:
            return averages
        return lambda t: cost_estimate(step, rank_of[t[0]], t)  # type: ignore[misc]

    def new_arbiter(rank: int, step: int = 0) -> Arbiter:
        size = None if act_bytes is None else (lambda s, m: act_bytes(step, s, m))
        wsize = None if w_bytes is None else (lambda s, m: w_bytes(step, s, m))
        bf = None
        if backfilling:
            bf = Backfill(spec, rank, estimator(step), boards.setdefault(step, {}), complete_notices=True)
        return Arbiter(spec, rank, hint, strict=strict, inflight_limit=limits[rank],
                       memory_budget=budgets[rank], act_bytes=size, w_bytes=wsize, backfill=bf)

    next_rank = [rank_of[s + 1] if s + 1 < S else -1 for s in range(S)]
    prev_rank = [rank_of[s - 1] if s > 0 else -1 for s in range(S)]
    zero_delay = delay is _zero_delay

    # A rank's arbiter for its current step, plus arbiters for later steps whose inputs
    # arrive early (a neighbour may be a step ahead).
    cur: list[Arbiter | None] = [new_arbiter(r) for r in range(P)]
    ahead: list[dict[int, Arbiter]] = [{} for _ in range(P)]
    if steps < 1:
        cur = [None] * P
    cur_step = [0] * P
    running: list[Task | None] = [None] * P
    busy_until = [0.0] * P
    busy = [0.0] * P
    peak = [0] * P
    peak_bytes = [0] * P
    held = [0] * S
    peak_held = [0] * S
    records: list[TaskRecord] = []
    step_end = [0.0] * max(steps, 0)
    run_d = [0.0] * P  # seconds of each rank's running task (backfilling's averages)

    # Heap entries: (time, seq, rank) a task finishes; (time, seq, rank, None) the rank's
    # optimizer step ends; (time, seq, rank, step, stage, mb, grad) an input arrives.
    # seq is unique, so tuples never compare past it.
    events: list[tuple] = []
    push, pop = heapq.heappush, heapq.heappop
    seq = 0

    def arbiter_for(r: int, step: int) -> Arbiter:
        if step == cur_step[r]:
            return cur[r]  # type: ignore[return-value]
        a = ahead[r].get(step)
        if a is None:
            a = ahead[r][step] = new_arbiter(r, step)
        return a

    now = 0.0
    touched: list[int] = list(range(P))
    while True:
        # Decisions: every idle rank touched at this instant, in rank order.
        if len(touched) > 2:
            touched = sorted(set(touched))
        elif len(touched) == 2 and touched[0] >= touched[1]:
            touched = [touched[1]] if touched[0] == touched[1] else [touched[1], touched[0]]
        for r in touched:
            if running[r] is not None:
                continue
            a = cur[r]
            if a is None or now < busy_until[r]:
                continue
            if backfilling:
                a.backfill.now = now  # type: ignore[union-attr]
            t = a.next()
            if t is None:
                continue
            step = cur_step[r]
            d = duration(step, r, t)
            if backfilling:
                e = a.backfill.estimate(t)  # type: ignore[union-attr]
                boards[step][t] = now + (e or 0.0)  # the "started, estimated end" notice
                run_d[r] = d
            running[r] = t
            busy[r] += d
            seq += 1
            push(events, (now + d, seq, r))
            if record:
                records.append(TaskRecord(r, step, t, now, now + d))
        if not events:
            break
        touched = []
        now = events[0][0]
        while events and events[0][0] == now:
            ev = pop(events)
            r = ev[2]
            touched.append(r)
            if len(ev) != 3:
                if len(ev) == 7:
                    _, _, _, step, stage, mb, grad = ev
                    arbiter_for(r, step).mark_input(stage, mb, grad)
                continue
            t = running[r]
            running[r] = None
            a = cur[r]
            a.complete(t)  # type: ignore[union-attr]
            if averages is not None:
                averages.observe(t, run_d[r])  # type: ignore[arg-type]
            step = cur_step[r]
            s, k, m = t  # type: ignore[misc]
            if k == F:
                held[s] += 1
                if held[s] > peak_held[s]:
                    peak_held[s] = held[s]
                dst, cs, grad = next_rank[s], s + 1, False
            elif k == W:
                dst = -1
            else:
                held[s] -= 1
                dst, cs, grad = prev_rank[s], s - 1, True
            if dst == r:
                a.mark_input(cs, m, grad)  # type: ignore[union-attr]
            elif dst >= 0:
                dd = 0.0 if zero_delay else delay(step, r, dst, t)  # type: ignore[arg-type]
                if dd == 0.0:
                    # Same instant: applying it now equals popping it later in this batch.
                    if cur_step[dst] == step:
                        cur[dst].mark_input(cs, m, grad)  # type: ignore[union-attr]
                    else:
                        arbiter_for(dst, step).mark_input(cs, m, grad)
                    touched.append(dst)
                else:
                    seq += 1
                    push(events, (now + dd, seq, dst, step, cs, m, grad))
            if a.n_done == a.n_tasks:  # type: ignore[union-attr]  # a.finished, without the call
                if a.peak_inflight > peak[r]:  # type: ignore[union-attr]
                    peak[r] = a.peak_inflight  # type: ignore[union-attr]
                if a.memory is not None and a.memory.peak_held > peak_bytes[r]:  # type: ignore[union-attr]
                    peak_bytes[r] = a.memory.peak_held  # type: ignore[union-attr]
                if now > step_end[step]:
                    step_end[step] = now
                nxt = step + 1
                cur_step[r] = nxt
                if nxt < steps:
                    cur[r] = ahead[r].pop(nxt, None) or new_arbiter(r, nxt)
                    if step_overhead > 0:
                        busy_until[r] = now + step_overhead
                        seq += 1
                        push(events, (now + step_overhead, seq, r, None))
                else:
                    cur[r] = None
    unfinished = [r for r in range(P) if cur_step[r] < steps]
    if unfinished:
        why = "; ".join(
            f"rank {r} step {cur_step[r]}: waits for {cur[r].waiting_for()}"  # type: ignore[union-attr]
            for r in unfinished[:4]
        )
        raise DeadlockError(f"simulation cannot finish: {why}")
    return SimResult(now, records, busy, peak, step_end, peak_held, peak_bytes)
