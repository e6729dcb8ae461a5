"""Ready-set arbitration for one rank (RRFP §4-5, App. A, App. C).

The arbiter is driven by events and never waits: the runtime (or the simulator) tells it
when an input arrives (:meth:`Arbiter.mark_input`) and when a task finishes
(:meth:`Arbiter.complete`), and asks it for the next task whenever compute is free
(:meth:`Arbiter.next`). ``None`` means nothing may run now: wait for the next event.

It keeps the rank's :class:`~rrfp.scheduler.readyset.ReadySet` and counters
(:class:`~rrfp.scheduler.guards.RankState`); the hint's policy
(:mod:`rrfp.scheduler.policy`) chooses, filtered by the rank's guard
(:mod:`rrfp.scheduler.guards`: what runs when the in-flight limit or the memory budget binds,
the bounds and why they cannot deadlock). :meth:`Arbiter.propose` is that choice, pure;
:meth:`Arbiter.commit` takes it.

Strict mode runs exactly the hint's order (the fixed-order baseline) and ignores the limit
and the memory budget: it cannot wait for bytes (a rank holding a forward back would stall a
neighbour that waits for it in its own order), so it holds what its order holds, and the front
doors say a step that broke the budget (:func:`~rrfp.scheduler.memory.over_budget`).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from heapq import heappush

from .backfill import Backfill
from .errors import SchedulingError
from .guards import NO_GUARD, Admission, ByteBudget, CompletionOrder, CountLimit, OrderPeak, RankState
from .memory import MemoryLedger, SizeFn
from .policy import Hint, Policy, in_order
from .readyset import ReadySet
from .registry import policy_factory
from .tasks import B_CODE, F, F_CODE, I, KIND_CODE as _CODE, W, W_CODE, PipelineSpec, Task, kinds_of


def validate_rank_order(spec: PipelineSpec, rank: int, order: list[Task]) -> None:
    """Check that ``order`` holds each of rank ``rank``'s tasks exactly once.

    Raises:
        ValueError: naming the first offending action (foreign, repeated or missing).
    """
    expected = set(spec.tasks_of(rank))
    seen: set[Task] = set()
    for t in order:
        if t not in expected:
            raise ValueError(
                f"rank {rank}: action {t} is not a task of this rank "
                f"(stages {spec.placement.stages_of(rank)}, {spec.n_microbatches} microbatches, "
                f"backward kind {spec.backward_kind})"
            )
        if t in seen:
            raise ValueError(f"rank {rank}: action {t} appears twice")
        seen.add(t)
    missing = sorted(expected - seen, key=lambda t: (t.mb, t.stage, t.kind))
    if missing:
        raise ValueError(f"rank {rank}: action {missing[0]} is missing from the order")


class Arbiter:
    """Chooses what one rank runs next.

    Args:
        spec: the pipeline's shape (placement, microbatches, split backward).
        rank: this rank's index in the pipeline, ``0 <= rank < spec.placement.n_ranks``.
        hint: a policy or a total order (:func:`~rrfp.scheduler.hints.resolve_hint`).
        strict: run the hint's order exactly (fixed-order baseline); needs a total order.
        inflight_limit: the in-flight limit ``>= 1`` (RRFP default 32).
        memory_budget: bytes of activations the rank may hold (None: no budget).
        act_bytes: ``act_bytes(stage, mb)``, bytes ``F(stage, mb)`` holds until its input
            backward (an estimate; :meth:`complete` takes the measured size). Needed by
            ``memory_budget``; alone, it only counts :attr:`peak_bytes`.
        w_bytes: ``w_bytes(stage, mb)``, bytes a split backward's ``W`` still reads once its
            ``I`` finished (None from it, or no function: unknown, everything stays held
            until ``W``; :meth:`MemoryLedger.input_backward_done`).
        backfill: strict mode only: run a later ready task of the order while the planned one
            waits, when it ends before the planned task's input can arrive
            (:mod:`rrfp.scheduler.backfill`), keeping the order's own peak bytes.

    Attributes:
        ready: the rank's ready set; state: its counters and guard; policy: the hint's policy.

    Raises:
        ValueError: bad limit or budget, a budget without ``act_bytes`` or with
            ``completion-order`` backpressure, strict mode without a total order, or an
            order that is not exactly this rank's tasks.
        TypeError: the hint's factory built something that is not a
            :class:`~rrfp.scheduler.policy.Policy`.
    """

    # Slots: the simulator reads these once per event; an instance dict of more than 30 keys
    # loses CPython's fast attribute path (measured: +10% per decision at 31 attributes).
    __slots__ = ("backfill", "_wsize", "spec", "rank", "hint", "strict", "limit", "stages", "_vidx", "_last_stage",
                 "_n_mb", "n_tasks", "n_done", "running", "memory", "ready", "policy", "_taken", "_next_taken", "state", "_act",
                 "_grad", "_done_f", "_done_b", "_done_w", "_rdy_f", "_rdy_b", "_rdy_w", "_rf", "_rb", "_rw",
                 "_queues", "_rfl", "_fsign")

    def __init__(
        self,
        spec: PipelineSpec,
        rank: int,
        hint: Hint,
        *,
        strict: bool = False,
        inflight_limit: int = 32,
        memory_budget: int | None = None,
        act_bytes: SizeFn | None = None,
        w_bytes: SizeFn | None = None,
        backfill: Backfill | None = None,
    ) -> None:
        if not isinstance(inflight_limit, int) or inflight_limit < 1:
            raise ValueError(f"in-flight limit {inflight_limit!r}: expected an integer >= 1")
        if memory_budget is not None and act_bytes is None:
            raise ValueError("a memory budget needs act_bytes(stage, mb), the bytes each forward holds")
        stages = spec.placement.stages_of(rank)
        if memory_budget is not None and len(stages) > 1 and hint.backpressure != "admission":
            raise ValueError(f"a memory budget needs admission backpressure, got {hint.backpressure!r}")
        factory = policy_factory(hint, strict, backfill is not None)
        self.backfill = backfill
        self._wsize = w_bytes
        self.spec = spec
        self.rank = rank
        self.hint = hint
        self.strict = strict
        self.limit = inflight_limit
        self.stages = stages
        self._vidx = {s: i for i, s in enumerate(stages)}
        self._last_stage = spec.n_stages - 1
        self._n_mb = spec.n_microbatches
        self.n_tasks = len(stages) * spec.n_microbatches * len(kinds_of(spec.split_backward))
        self.n_done = 0
        self.running: Task | None = None
        self.memory = None if act_bytes is None else MemoryLedger(stages, act_bytes, None if strict else memory_budget)
        order = None
        if hint.order is not None:
            validate_rank_order(spec, rank, list(hint.order[rank]))
            order = hint.order[rank]
        self.ready = r = ReadySet(stages, spec.n_microbatches)
        self.state = st = RankState(stages, spec.n_microbatches, inflight_limit, spec.backward_kind)
        if strict:
            st.guard = NO_GUARD
        elif memory_budget is not None:
            st.guard = ByteBudget(self.memory)
        elif hint.held_to_order and factory is in_order:  # readiness over a schedule used as a hint
            st.guard = OrderPeak(order, self.ready)
        elif len(stages) == 1:
            st.guard = CountLimit()
        elif hint.backpressure == "admission":
            st.guard = Admission()
        else:
            st.guard = CompletionOrder(st)
        self.policy = p = factory(order=order, ready=r, state=st, backfill=backfill, memory=self.memory,
                                  w_bytes=w_bytes if self.memory is not None else None)
        if not isinstance(p, Policy):
            raise TypeError(f"hint {hint.name!r}: its factory built {type(p).__name__}, expected a "
                            "rrfp.scheduler.policy.Policy (subclass it)")
        r.configure(queues=p.queues, depth_first=p.depth_first)
        self._taken = p.taken
        self._next_taken = p.next_taken
        # The ready set's arrays and heaps by kind code, aliased: the event paths below run
        # once per message and task in the simulator.
        self._act, self._grad = r.act, r.grad
        self._done_f, self._done_b, self._done_w = r.done[F_CODE], r.done[B_CODE], r.done[W_CODE]
        self._rdy_f, self._rdy_b, self._rdy_w = r.ready[F_CODE], r.ready[B_CODE], r.ready[W_CODE]
        self._rf, self._rb, self._rw, self._rfl = r.f, r.b, r.w, r.fl
        self._queues, self._fsign = r.queues, r.fsign
        if stages[0] == 0:
            for m in range(spec.n_microbatches):
                self._act[m] = 1
                r.add(Task(0, F, m))

    # ----------------------------------------------------------------- events
    @property
    def finished(self) -> bool:
        """True once every task of this rank's step has completed."""
        return self.n_done == self.n_tasks

    @property
    def inflight(self) -> int:
        """Activations held now (``D``: forwards minus ``B``, or ``W`` with the split backward,
        finished: :data:`~rrfp.scheduler.tasks.IN_FLIGHT_END`)."""
        return self.state.inflight

    @property
    def peak_inflight(self) -> int:
        return self.state.peak_inflight

    @property
    def mb_inflight(self) -> int:
        """Microbatches in flight now (first virtual stage's F done, its B or W not)."""
        return self.state.mb_inflight

    @property
    def peak_mb_inflight(self) -> int:
        return self.state.peak_mb_inflight

    def mark_input(self, stage: int, mb: int, grad: bool) -> None:
        """An input arrived: the activation for ``F(stage, mb)`` (``grad=False``) or the
        gradient for the backward of ``(stage, mb)`` (``grad=True``).

        Raises:
            SchedulingError: for a stage this rank does not hold, or a duplicate input.
        """
        v = self._vidx.get(stage)
        if v is None or not 0 <= mb < self._n_mb:
            raise SchedulingError(
                f"rank {self.rank}: input for stage {stage} microbatch {mb}, which this rank does not run"
            )
        i = v * self._n_mb + mb
        # ReadySet.add inlined: the simulator calls this once per message.
        if grad:
            if self._grad[i] or stage == self._last_stage:
                raise SchedulingError(f"rank {self.rank}: duplicate gradient for stage {stage} microbatch {mb}")
            self._grad[i] = 1
            if self._done_f[i]:
                self._rdy_b[i] = 1
                if self._queues:
                    heappush(self._rb, (-v, mb, stage))
        else:
            if self._act[i]:
                raise SchedulingError(f"rank {self.rank}: duplicate activation for stage {stage} microbatch {mb}")
            self._act[i] = 1
            self._rdy_f[i] = 1
            if self._queues:
                e = (v * self._fsign, mb, stage)
                heappush(self._rf, e)
                if e[0] > 0:  # breadth-first, past the first virtual stage (ReadySet.fl)
                    heappush(self._rfl, e)

    @property
    def peak_bytes(self) -> int:
        """Most activation bytes held at once this step (0 without ``act_bytes``)."""
        return 0 if self.memory is None else self.memory.peak_held

    @property
    def peak_one(self) -> int:
        """Most activation bytes one microbatch held at once this step (0 without ``act_bytes``;
        :func:`~rrfp.scheduler.memory.over_budget`)."""
        return 0 if self.memory is None else self.memory.peak_one

    def complete(self, task: Task, nbytes: int | None = None) -> None:
        """The dispatched ``task`` finished; for a forward, ``nbytes`` is the measured size of
        what it holds (None: ``act_bytes``'s estimate).

        Raises:
            SchedulingError: if ``task`` is not the running task.
        """
        if task is not self.running and task != self.running:
            raise SchedulingError(f"rank {self.rank}: completed {task} but {self.running} was running")
        self.running = None
        self.n_done += 1
        s, k, m = task
        v = self._vidx[s]
        i = v * self._n_mb + m
        if self.memory is not None:
            if k == F:
                self.memory.forward_done(s, m, nbytes)
            elif k != I:
                self.memory.backward_done(s, m)
            elif self._wsize is not None:
                # W still reads each split layer's input and output gradient: only the rest
                # of what F saved is free at I (unknown: all of it stays until W).
                self.memory.input_backward_done(s, m, self._wsize(s, m))
        st = self.state
        # ReadySet.add inlined: the simulator calls this once per task.
        if k == F:
            self._done_f[i] = 1
            st.inflight += 1
            if st.inflight > st.peak_inflight:
                st.peak_inflight = st.inflight
            if v == 0:
                st.mb_inflight += 1
                if st.mb_inflight > st.peak_mb_inflight:
                    st.peak_mb_inflight = st.mb_inflight
            if s == self._last_stage or self._grad[i]:
                self._rdy_b[i] = 1
                if self._queues:
                    heappush(self._rb, (-v, m, s))
        else:
            if k == W:
                self._done_w[i] = 1
            else:
                self._done_b[i] = 1
            # In flight until B, or W with the split backward (tasks.IN_FLIGHT_END: W reads
            # what F saved, so an I frees only part of it).
            if k != I:
                st.inflight -= 1
                if v == 0:
                    st.mb_inflight -= 1
            else:
                self._rdy_w[i] = 1
                if self._queues:
                    heappush(self._rw, (m, -v, s))

    # --------------------------------------------------------------- decisions
    def next(self) -> Task | None:
        """Take the best-ranked ready task (it becomes :attr:`running`), or return None when
        nothing may run until the next event: :meth:`propose` then :meth:`commit`.

        Raises:
            SchedulingError: if a task is already running (one compute task at a time).
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: next() while {self.running} is running")
        t = self._next_taken(self.ready, self.state)  # choose, then _take's two calls
        if t is not None:
            self.running = t
        return t

    def propose(self) -> Task | None:
        """The task :meth:`next` would take now, without taking it: no decision state changes
        (RRFP §4.2: a TP group agrees on a collective-bearing task before anyone runs it;
        :meth:`commit` takes it, and after a disagreement nothing needs undoing).

        Raises:
            SchedulingError: if a task is already running.
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: propose() while {self.running} is running")
        return self.policy.choose(self.ready, self.state)

    def commit(self, task: Task) -> None:
        """Take ``task`` (it runs; :meth:`complete` follows). Inputs that arrived since
        :meth:`propose` may have made another task preferable; the agreed one still runs.

        Raises:
            SchedulingError: a task is running, or ``task`` is not in the ready set.
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: commit of {task} while {self.running} is running")
        v = self._vidx.get(task[0])
        c = _CODE.get(task[1])
        if v is None or c is None or not 0 <= task[2] < self._n_mb or not self.ready.ready[c][v * self._n_mb + task[2]]:
            raise SchedulingError(f"rank {self.rank}: commit of {task}, which is not ready")
        self._take(task)

    def _take(self, t: Task) -> None:
        # A chosen task leaves the ready set and the policy is told, always (next() inlines
        # these three lines).
        self.running = t
        self.ready.take(t)
        self._taken(t, self.state)

    def planned(self) -> Task | None:
        """In strict mode, the order's first task not finished as of the last decision (the
        task the rank runs next, or waits for); None in readiness mode or once the order is
        done. Backfilling's notices ask it (:mod:`rrfp.runtime.features.notices`)."""
        return self.policy.planned() if self.strict else None

    # ------------------------------------------------------------ diagnostics
    def waiting_for(self, limit: int = 3) -> str:
        """What this rank waits for, in words (for the watchdog's error)."""
        if self.finished:
            return "nothing (step finished)"
        if self.running is not None:
            return f"task {self.running} to finish"
        place = self.spec.placement
        missing = []
        bk = self.spec.backward_kind
        for m in range(self.spec.n_microbatches):
            for v, s in enumerate(self.stages):
                i = v * self._n_mb + m
                if not self._act[i]:
                    missing.append(f"activation for {Task(s, F, m)} {place.source(place.prev_stage(s))}")
                elif self._done_f[i] and s != self._last_stage and not self._grad[i]:
                    missing.append(f"gradient for {Task(s, bk, m)} {place.source(place.next_stage(s))}")
            if len(missing) >= limit:
                break
        planned = self.planned()
        if planned is not None:
            missing.insert(0, f"strict order's next task {planned}")
        if self.state.inflight >= self.limit:
            missing.append(f"in-flight limit {self.limit} reached")
        return "; ".join(missing[:limit + 1]) or "no ready task"
