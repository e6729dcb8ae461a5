"""Discrete-event simulation of a pipeline driving the real arbiter (no asyncio, no torch).

The simulator and the runtime share :mod:`rrfp.scheduler`: each simulated rank owns one
:class:`~rrfp.scheduler.arbiter.Arbiter` per step and feeds it the same events the runtime
does (inputs arriving, tasks finishing), so a policy is written once and measured both ways.

Times are in seconds (any consistent unit works).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..scheduler.arbiter import Arbiter
from ..scheduler.hints import Hint
from ..scheduler.tasks import F, PipelineSpec, Task

DurationFn = Callable[[int, int, Task], float]  # (step, rank, task) -> seconds
DelayFn = Callable[[int, int, int, Task], float]  # (step, src rank, dst rank, producing task) -> seconds


@dataclass
class TaskRecord:
    """One executed task: where, when (seconds from the start) and in which step."""

    rank: int
    step: int
    task: Task
    start: float
    end: float


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes:
        makespan: time from the start until the last rank finished its last step (s).
        records: every executed task, in completion order.
        busy: per rank, total compute time (s).
        peak_inflight: per rank, the largest in-flight count ``D`` seen in any step.
        step_end: per step, the time the last rank finished it (s).
    """

    makespan: float
    records: list[TaskRecord]
    busy: list[float]
    peak_inflight: list[int]
    step_end: list[float] = field(default_factory=list)

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
) -> SimResult:
    """Simulate ``steps`` training steps of ``spec`` under ``hint``.

    Each rank runs one task at a time; when it is idle it asks its arbiter for the next task.
    A finished task's output reaches its consumer after ``delay(...)`` seconds (0 when the
    consumer is on the same rank). Events of equal time are all applied before any idle rank
    decides, so ties resolve the same way on every run. A rank starts step ``k+1`` after its own
    tasks of step ``k`` and ``step_overhead`` seconds (the optimizer step).

    Args:
        inflight_limit: one limit for every rank, or one per rank.

    Raises:
        DeadlockError: naming each unfinished rank and what it waits for.
    """
    place = spec.placement
    P = place.n_ranks
    limits = [inflight_limit] * P if isinstance(inflight_limit, int) else list(inflight_limit)
    if len(limits) != P:
        raise ValueError(f"{len(limits)} in-flight limits given for {P} ranks")

    arbiters: list[dict[int, Arbiter]] = [{} for _ in range(P)]

    def arb(rank: int, step: int) -> Arbiter:
        a = arbiters[rank].get(step)
        if a is None:
            a = arbiters[rank][step] = Arbiter(spec, rank, hint, strict=strict, inflight_limit=limits[rank])
        return a

    cur_step = [0] * P
    busy_until = [0.0] * P
    running = [False] * P
    busy = [0.0] * P
    peak = [0] * P
    records: list[TaskRecord] = []
    step_end = [0.0] * steps
    events: list[tuple[float, int, int, int, int, Task | None, bool]] = []
    seq = 0
    # event: (time, seq, kind, rank, step, task, grad); kind 0 = task done, 1 = input arrives, 2 = step start
    for r in range(P):
        arb(r, 0)

    def try_dispatch(r: int, now: float) -> None:
        nonlocal seq
        if running[r] or cur_step[r] >= steps or now < busy_until[r]:
            return
        a = arb(r, cur_step[r])
        t = a.next()
        if t is None:
            return
        d = duration(cur_step[r], r, t)
        running[r] = True
        busy[r] += d
        seq += 1
        heapq.heappush(events, (now + d, seq, 0, r, cur_step[r], t, False))
        if record:
            records.append(TaskRecord(r, cur_step[r], t, now, now + d))

    now = 0.0
    for r in range(P):
        try_dispatch(r, now)
    touched: set[int] = set()
    while events:
        now = events[0][0]
        touched.clear()
        while events and events[0][0] == now:
            _, _, kind, r, step, t, grad = heapq.heappop(events)
            touched.add(r)
            if kind == 2:
                continue
            if kind == 1:
                arb(r, step).mark_input(t.stage, t.mb, grad)
                continue
            a = arb(r, step)
            a.complete(t)
            running[r] = False
            consumer = spec.consumer(t)
            if consumer is not None:
                dst = place.rank_of(consumer.stage)
                is_grad = consumer.kind != F
                if dst == r:
                    arb(r, step).mark_input(consumer.stage, consumer.mb, is_grad)
                else:
                    seq += 1
                    heapq.heappush(
                        events, (now + delay(step, r, dst, t), seq, 1, dst, step, consumer, is_grad)
                    )
            if a.finished:
                peak[r] = max(peak[r], a.peak_inflight)
                step_end[step] = max(step_end[step], now)
                del arbiters[r][step]
                cur_step[r] += 1
                if step_overhead > 0 and cur_step[r] < steps:
                    busy_until[r] = now + step_overhead
                    seq += 1
                    heapq.heappush(events, (now + step_overhead, seq, 2, r, step, None, False))
        for r in sorted(touched):
            try_dispatch(r, now)
    unfinished = [r for r in range(P) if cur_step[r] < steps]
    if unfinished:
        why = "; ".join(
            f"rank {r} step {cur_step[r]}: waits for {arb(r, cur_step[r]).waiting_for()}" for r in unfinished[:4]
        )
        raise DeadlockError(f"simulation cannot finish: {why}")
    return SimResult(now, records, busy, peak, step_end)
