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
from typing import Callable, NamedTuple, Sequence

from ..scheduler.arbiter import Arbiter
from ..scheduler.backfill import Backfill, CostAverages
from ..scheduler.hints import Hint
from ..scheduler.tasks import BACKWARD_INPUT, F, W, PipelineSpec, Task, TaskRecord

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


INLINE_DECISIONS = True
"""The run loop takes each decision through the rank's policy (``policy.next_taken``) and sets
the arbiter's running task itself, saving :meth:`Arbiter.next`'s call (about a tenth of a run);
False: through ``Arbiter.next`` (``tests/test_sim_engine.py`` checks both give the same run)."""


_OFF = ("off",)
"""A rank's running task while it cannot decide (its steps are done, or its optimizer step runs)."""


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
    rank's dispatch order (a stateful duration model may rely on that), unless it has a
    ``fixed`` table (not None: ``fixed[stage][kind]`` seconds, read instead; :class:`~rrfp.sim.duration.DurationModel`). A finished task's
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
        sim = _Sim(spec, hint, strict, inflight_limit, steps, memory_budget, act_bytes, w_bytes, cost_estimate)
        return sim.run(duration, delay, step_overhead, record)
    finally:
        if gc_was_enabled:
            gc.enable()


class _Resume(NamedTuple):
    """Event: rank ``rank``'s optimizer step ends (it may start its next step). A task's
    finish is the bare rank number (an ``int``): the per-task event builds no object."""

    rank: int


class _Arrival(NamedTuple):
    """Event: an input reaches rank ``rank``: the activation (``grad`` False) or the gradient
    for ``stage``'s microbatch ``mb`` in step ``step``."""

    rank: int
    step: int
    stage: int
    mb: int
    grad: bool


def _per_rank(value, n: int, what: str, one: bool) -> list:
    values = [value] * n if one else list(value)
    if len(values) != n:
        raise ValueError(f"{len(values)} {what} given for {n} ranks")
    return values


def _in_rank_order(touched: list[int]) -> list[int]:
    """The ranks touched at one instant, each once, in rank order (two: no set, no sort)."""
    if len(touched) > 2:
        return sorted(set(touched))
    if touched[0] < touched[1]:
        return touched
    return [touched[1]] if touched[0] == touched[1] else [touched[1], touched[0]]


class _Sim:
    """The state of one :func:`simulate` run: per rank its arbiters, running task and clocks."""

    def __init__(self, spec, hint, strict, inflight_limit, steps, memory_budget, act_bytes, w_bytes,
                 cost_estimate) -> None:
        place = spec.placement
        P = self.P = place.n_ranks
        S = spec.n_stages
        self.spec, self.hint, self.strict, self.steps = spec, hint, strict, steps
        self.limits = _per_rank(inflight_limit, P, "in-flight limits", isinstance(inflight_limit, int))
        self.budgets = _per_rank(memory_budget, P, "memory budgets", not isinstance(memory_budget, (list, tuple)))
        self.act_bytes, self.w_bytes, self.cost_estimate = act_bytes, w_bytes, cost_estimate
        self.rank_of = [place.rank_of(s) for s in range(S)]
        # Per stage and kind, what a finished task does: where its output goes (the placement's
        # chain: rank and stage, or -1, -1), the change in the stage's held activations (F's
        # output held until its input backward) and whether the output is a gradient.
        self.route = [{F: (*self._where(place.next_stage(s)), 1, False), W: (-1, -1, 0, False),
                       **{k: (*self._where(place.prev_stage(s)), -1, True) for k in BACKWARD_INPUT}}
                      for s in range(S)]
        self.backfilling = hint.backfill and strict
        self.averages = CostAverages() if self.backfilling and cost_estimate is None else None
        self.boards: dict[int, dict[Task, float]] = {}  # step -> started task -> estimated end
        # A rank's arbiter for its current step, plus arbiters for later steps whose inputs
        # arrive early (a neighbour may be a step ahead).
        self.cur: list[Arbiter | None] = [self.new_arbiter(r) if steps >= 1 else None for r in range(P)]
        self.ahead: list[dict[int, Arbiter]] = [{} for _ in range(P)]
        self.cur_step = [0] * P
        # Per rank its running task, None when idle, or _OFF: finished, or in its optimizer step.
        self.running: list = [None if steps >= 1 else _OFF] * P
        self.busy = [0.0] * P
        self.peak = [0] * P
        self.peak_bytes = [0] * P
        self.held = [0] * S
        self.peak_held = [0] * S
        self.step_end = [0.0] * max(steps, 0)
        self.run_d = [0.0] * P  # seconds of each rank's running task (backfilling's averages)
        self.records: list[TaskRecord] = []
        # Pending events: a heap of their distinct times, and per time its events in the order
        # posted (a time leaves both once its events are applied). Equal times are common
        # (fixed costs), and a heap of floats compares faster than one of (time, seq, ...)
        # tuples, which it replaces with the same order: by time, then as posted.
        self.times: list[float] = []
        self.at: dict[float, list] = {}

    def _where(self, stage: int | None) -> tuple[int, int]:
        return (-1, -1) if stage is None else (self.rank_of[stage], stage)

    def _estimator(self, step: int):
        if self.averages is not None:
            return self.averages
        cost, rank_of = self.cost_estimate, self.rank_of
        return lambda t: cost(step, rank_of[t[0]], t)  # type: ignore[misc]

    def new_arbiter(self, rank: int, step: int = 0) -> Arbiter:
        act, w = self.act_bytes, self.w_bytes
        size = None if act is None else (lambda s, m: act(step, s, m))
        wsize = None if w is None else (lambda s, m: w(step, s, m))
        bf = None
        if self.backfilling:
            bf = Backfill(self.spec, rank, self._estimator(step), self.boards.setdefault(step, {}),
                          complete_notices=True)
        return Arbiter(self.spec, rank, self.hint, strict=self.strict, inflight_limit=self.limits[rank],
                       memory_budget=self.budgets[rank], act_bytes=size, w_bytes=wsize, backfill=bf)

    def arbiter_for(self, r: int, step: int) -> Arbiter:
        if step == self.cur_step[r]:
            return self.cur[r]  # type: ignore[return-value]
        a = self.ahead[r].get(step)
        if a is None:
            a = self.ahead[r][step] = self.new_arbiter(r, step)
        return a

    # ------------------------------------------------------------ the run
    # The per-task path stays in run, state in locals (bench_sim.py times it). Each pass of its
    # loop is one instant: decisions, then the events of the next time. Decisions: every idle
    # rank touched at the instant, in rank order (running[r] is not None: a task runs, or the
    # rank is off: finished, or in its optimizer step). ``fixed`` (stage -> kind -> seconds):
    # every task takes its stage and kind's time, a lookup. Events: every one posted for the
    # instant's time, as posted, including any posted meanwhile (a delay below the clock's
    # resolution), before any rank decides.
    def run(self, duration: DurationFn, delay: DelayFn, step_overhead: float, record: bool) -> SimResult:
        times, at, pop, push = self.times, self.at, heapq.heappop, heapq.heappush
        running, cur, cur_step, busy, records = self.running, self.cur, self.cur_step, self.busy, self.records
        backfilling, averages, run_d = self.backfilling, self.averages, self.run_d
        held, peak_held, route = self.held, self.peak_held, self.route
        instant = delay is _zero_delay
        one_step = instant and self.steps == 1  # every message then goes to its consumer's current step
        fixed = getattr(duration, "fixed", None)
        fast = INLINE_DECISIONS and not backfilling
        now, touched = 0.0, list(range(self.P))
        while True:
            if len(touched) > 1:
                touched = _in_rank_order(touched)
            for r in touched:
                if running[r] is not None:
                    continue
                a = cur[r]
                # Fast: Arbiter.next without its check that nothing runs (nothing does here).
                t = a.policy.next_taken(a.ready, a.state) if fast else self.decide(a, now)  # type: ignore[union-attr]
                if t is None:
                    continue
                a.running = t  # type: ignore[union-attr]
                d = duration(cur_step[r], r, t) if fixed is None else fixed[t[0]][t[1]]
                if backfilling:
                    self.notice(r, cur_step[r], t, now, d)
                running[r] = t
                busy[r] += d
                e = now + d
                evs = at.get(e)
                if evs is None:
                    at[e] = [r]
                    push(times, e)
                else:
                    evs.append(r)
                if record:
                    records.append(TaskRecord(r, cur_step[r], t, now, e))
            if not times:
                break
            touched = []
            now = pop(times)
            evs = at.pop(now)
            while evs:
                for r in evs:
                    if r.__class__ is not int:  # an arrival or a resume
                        touched.append(self.apply(r))
                        continue
                    touched.append(r)
                    # Rank r's task finished: complete it and send its output on.
                    t = running[r]
                    running[r] = None
                    a = cur[r]
                    a.complete(t)  # type: ignore[union-attr]
                    if averages is not None:
                        averages.observe(t, run_d[r])  # type: ignore[arg-type]
                    s, k, m = t  # type: ignore[misc]
                    dst, cs, dh, grad = route[s][k]
                    held[s] += dh
                    if held[s] > peak_held[s]:
                        peak_held[s] = held[s]
                    if dst == r:
                        a.mark_input(cs, m, grad)  # type: ignore[union-attr]
                    elif dst < 0:
                        pass
                    elif one_step or (instant and cur_step[dst] == cur_step[r]):
                        cur[dst].mark_input(cs, m, grad)  # type: ignore[union-attr]
                        if running[dst] is None:  # a busy or off rank decides when that ends
                            touched.append(dst)
                    else:
                        self.send(r, dst, cs, t, now, delay, touched)
                    if a.n_done == a.n_tasks:  # type: ignore[union-attr]  # a.finished, without the call
                        self.end_step(r, a, now, step_overhead)  # type: ignore[arg-type]
                evs = None
                if times and times[0] == now:  # posted for this instant meanwhile
                    pop(times)
                    evs = at.pop(now)
        self.check_finished()
        return SimResult(now, records, busy, self.peak, self.step_end, peak_held, self.peak_bytes)

    def decide(self, a: Arbiter, now: float) -> Task | None:
        """A decision by ``a`` at ``now``: backfilling's clock set, then inline or through
        :meth:`Arbiter.next` (:data:`INLINE_DECISIONS`)."""
        if self.backfilling:
            a.backfill.now = now  # type: ignore[union-attr]
        return a.policy.next_taken(a.ready, a.state) if INLINE_DECISIONS else a.next()

    def apply(self, ev: tuple) -> int:
        """Apply an arrival or a resume event; return its rank."""
        if ev.__class__ is _Arrival:
            self.arbiter_for(ev.rank, ev.step).mark_input(ev.stage, ev.mb, ev.grad)  # type: ignore[attr-defined]
        else:
            self.running[ev.rank] = None  # its optimizer step is over: it may decide
        return ev.rank  # type: ignore[attr-defined]

    def notice(self, r: int, step: int, t: Task, now: float, d: float) -> None:
        """Backfilling: rank ``r`` started ``t`` at ``now`` for ``d`` seconds; post its
        "started, estimated end" notice."""
        e = self.cur[r].backfill.estimate(t)  # type: ignore[union-attr]
        self.boards[step][t] = now + (e or 0.0)
        self.run_d[r] = d

    def send(self, r: int, dst: int, cs: int, t: Task, now: float, delay: DelayFn, touched: list[int]) -> None:
        """Rank ``r``'s finished task ``t`` feeds stage ``cs`` on rank ``dst``: deliver it now
        (no delay) or at its arrival."""
        step, grad = self.cur_step[r], t[1] != F
        dd = 0.0 if delay is _zero_delay else delay(step, r, dst, t)
        if dd == 0.0:
            # Same instant: applying it now equals popping it later in this batch.
            self.arbiter_for(dst, step).mark_input(cs, t[2], grad)
            touched.append(dst)
        else:
            self.post(now + dd, _Arrival(dst, step, cs, t[2], grad))

    def end_step(self, r: int, a: Arbiter, now: float, step_overhead: float) -> None:
        """Rank ``r`` finished its current step at ``now``: keep its peaks, start the next."""
        if a.peak_inflight > self.peak[r]:
            self.peak[r] = a.peak_inflight
        if a.memory is not None and a.memory.peak_held > self.peak_bytes[r]:
            self.peak_bytes[r] = a.memory.peak_held
        step = self.cur_step[r]
        if now > self.step_end[step]:
            self.step_end[step] = now
        nxt = self.cur_step[r] = step + 1
        if nxt >= self.steps:
            self.cur[r] = None
            self.running[r] = _OFF
            return
        self.cur[r] = self.ahead[r].pop(nxt, None) or self.new_arbiter(r, nxt)
        if step_overhead > 0:
            self.running[r] = _OFF  # until its _Resume
            self.post(now + step_overhead, _Resume(r))

    def post(self, time: float, ev: tuple) -> None:
        """Queue the event ``ev`` at ``time`` (after those already queued at that time)."""
        evs = self.at.get(time)
        if evs is None:
            self.at[time] = [ev]
            heapq.heappush(self.times, time)
        else:
            evs.append(ev)

    def check_finished(self) -> None:
        """Raise :class:`DeadlockError` when a rank has steps left but no event is pending."""
        unfinished = [r for r in range(self.P) if self.cur_step[r] < self.steps]
        if unfinished:
            why = "; ".join(
                f"rank {r} step {self.cur_step[r]}: waits for {self.cur[r].waiting_for()}"  # type: ignore[union-attr]
                for r in unfinished[:4]
            )
            raise DeadlockError(f"simulation cannot finish: {why}")
