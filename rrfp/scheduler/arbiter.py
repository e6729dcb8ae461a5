"""Ready-set arbitration for one rank (RRFP §4-5, App. A, App. C).

The arbiter is driven by events and never waits: the runtime (or the simulator) tells it
when an input arrives (:meth:`Arbiter.mark_input`) and when a task finishes
(:meth:`Arbiter.complete`), and asks it for the next task whenever compute is free
(:meth:`Arbiter.next`). ``None`` means nothing may run now: wait for the next event.

Backpressure: ``D`` is the number of forwards minus input backwards finished so far this step
on the rank (activations held). In readiness mode, once ``D`` reaches the in-flight limit:

- one stage per rank: forwards are disabled; ready backwards (and ``W`` fillers) still run;
- ``V > 1`` virtual stages: the rank follows the deterministic microbatch-by-microbatch
  completion order (``m = 0..M-1``, each ``F_0..F_{V-1}, B_{V-1}..B_0``), waiting for its next
  task instead of skipping it, until ``D`` drops below the limit (RRFP App. C.2).

Strict mode runs exactly the hint's order (the fixed-order baseline) and ignores the limit.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

import heapq

from .hints import Hint
from .tasks import B, F, I, W, PipelineSpec, Task


class SchedulingError(RuntimeError):
    """An event that cannot happen in a correct pipeline (duplicate input, unknown task)."""


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

    Raises:
        ValueError: bad limit, strict mode without a total order, or an order that is not
            exactly this rank's tasks.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        rank: int,
        hint: Hint,
        *,
        strict: bool = False,
        inflight_limit: int = 32,
    ) -> None:
        if not isinstance(inflight_limit, int) or inflight_limit < 1:
            raise ValueError(f"in-flight limit {inflight_limit!r}: expected an integer >= 1")
        if strict and hint.order is None:
            raise ValueError(f"strict mode needs a total-order hint, got the policy {hint.name!r}")
        self.spec = spec
        self.rank = rank
        self.hint = hint
        self.strict = strict
        self.limit = inflight_limit
        self.stages = spec.placement.stages_of(rank)
        self._vidx = {s: i for i, s in enumerate(self.stages)}
        self._last_stage = spec.n_stages - 1
        self._bk = spec.backward_kind
        self._interleaved = len(self.stages) > 1
        self.n_tasks = len(self.stages) * spec.n_microbatches * (3 if spec.split_backward else 2)
        self.n_done = 0
        self.inflight = 0
        self.peak_inflight = 0
        self.running: Task | None = None
        self._grad: set[tuple[int, int]] = set()
        self._act: set[tuple[int, int]] = set()
        self._fdone: set[tuple[int, int]] = set()
        self._done: set[Task] = set()
        # Policy hints keep one heap per direction, keyed by the hint's within-direction
        # preference; total-order hints keep a plain set and scan their order.
        self._policy = hint.order is None
        self._rf: list[tuple[int, int, int]] = []  # (virtual index, mb, stage): F prefers lower
        self._rb: list[tuple[int, int, int]] = []  # (-virtual index, mb, stage): B prefers higher
        self._rw: list[tuple[int, int, int]] = []  # (mb, -virtual index, stage)
        self._ready: set[Task] = set()
        self._phase = hint.first
        self._alternate = hint.alternate
        if hint.order is not None:
            validate_rank_order(spec, rank, list(hint.order[rank]))
            self._order = list(hint.order[rank])
            self._pos = 0  # first index of self._order not yet dispatched (strict: the next)
        if self._interleaved:
            M = spec.n_microbatches
            self._canon = [
                t
                for m in range(M)
                for t in [Task(s, F, m) for s in self.stages]
                + [Task(s, self._bk, m) for s in reversed(self.stages)]
            ]
            self._canon_pos = 0
        if self.stages[0] == 0:
            for m in range(spec.n_microbatches):
                self._act.add((0, m))
                self._make_ready(Task(0, F, m))

    # ----------------------------------------------------------------- events
    @property
    def finished(self) -> bool:
        """True once every task of this rank's step has completed."""
        return self.n_done == self.n_tasks

    def mark_input(self, stage: int, mb: int, grad: bool) -> None:
        """An input arrived: the activation for ``F(stage, mb)`` (``grad=False``) or the
        gradient for the backward of ``(stage, mb)`` (``grad=True``).

        Raises:
            SchedulingError: for a stage this rank does not hold, or a duplicate input.
        """
        if stage not in self._vidx or not 0 <= mb < self.spec.n_microbatches:
            raise SchedulingError(
                f"rank {self.rank}: input for stage {stage} microbatch {mb}, which this rank does not run"
            )
        key = (stage, mb)
        if grad:
            if key in self._grad or stage == self._last_stage:
                raise SchedulingError(f"rank {self.rank}: duplicate gradient for stage {stage} microbatch {mb}")
            self._grad.add(key)
            if key in self._fdone:
                self._make_ready(Task(stage, self._bk, mb))
        else:
            if key in self._act:
                raise SchedulingError(f"rank {self.rank}: duplicate activation for stage {stage} microbatch {mb}")
            self._act.add(key)
            self._make_ready(Task(stage, F, mb))

    def complete(self, task: Task) -> None:
        """The dispatched ``task`` finished.

        Raises:
            SchedulingError: if ``task`` is not the running task.
        """
        if task != self.running:
            raise SchedulingError(f"rank {self.rank}: completed {task} but {self.running} was running")
        self.running = None
        self.n_done += 1
        self._done.add(task)
        s, k, m = task
        if k == F:
            self.inflight += 1
            if self.inflight > self.peak_inflight:
                self.peak_inflight = self.inflight
            self._fdone.add((s, m))
            if s == self._last_stage or (s, m) in self._grad:
                self._make_ready(Task(s, self._bk, m))
        elif k == I:
            self.inflight -= 1
            self._make_ready(Task(s, W, m))
        elif k == B:
            self.inflight -= 1

    # --------------------------------------------------------------- decisions
    def next(self) -> Task | None:
        """Dispatch the best-ranked ready task (it becomes :attr:`running`), or return None
        when nothing may run until the next event.

        Raises:
            SchedulingError: if a task is already running (one compute task at a time).
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: next() while {self.running} is running")
        if self.strict:
            if self._pos < len(self._order) and self._order[self._pos] in self._ready:
                t = self._order[self._pos]
                self._pos += 1
                return self._dispatch(t)
            return None
        if self._interleaved and self.inflight >= self.limit:
            return self._next_completion_order()
        if self._policy:
            return self._next_policy(self.inflight < self.limit)
        return self._next_in_order(self.inflight < self.limit)

    def _next_policy(self, f_allowed: bool) -> Task | None:
        have_f = f_allowed and bool(self._rf)
        have_b = bool(self._rb)
        if have_f and have_b:
            kind = self._phase
        elif have_b:
            kind = "B"
        elif have_f:
            kind = F
        elif self._rw:
            return self._dispatch(self._pop(self._rw, W))
        else:
            return None
        if self._alternate:
            self._phase = F if kind == "B" else "B"
        if kind == F:
            return self._dispatch(self._pop(self._rf, F))
        return self._dispatch(self._pop(self._rb, self._bk))

    def _next_in_order(self, f_allowed: bool) -> Task | None:
        order, ready = self._order, self._ready
        while self._pos < len(order) and order[self._pos] in self._done:
            self._pos += 1
        for i in range(self._pos, len(order)):
            t = order[i]
            if t in ready and (f_allowed or t.kind != F):
                return self._dispatch(t)
        return None

    def _next_completion_order(self) -> Task | None:
        canon, done = self._canon, self._done
        while self._canon_pos < len(canon) and canon[self._canon_pos] in done:
            self._canon_pos += 1
        if self._canon_pos < len(canon):
            t = canon[self._canon_pos]
            if t in self._ready:
                if self._policy:
                    self._remove_from_heap(t)
                return self._dispatch(t)
        # W never changes D, so it may fill the wait without weakening the bound.
        if self._policy:
            return self._dispatch(self._pop(self._rw, W)) if self._rw else None
        for t in self._order[self._pos:]:
            if t.kind == W and t in self._ready:
                return self._dispatch(t)
        return None

    # ------------------------------------------------------------- internals
    def _make_ready(self, t: Task) -> None:
        if self._policy:
            v = self._vidx[t.stage]
            if t.kind == F:
                heapq.heappush(self._rf, (v, t.mb, t.stage))
            elif t.kind == W:
                heapq.heappush(self._rw, (t.mb, -v, t.stage))
            else:
                heapq.heappush(self._rb, (-v, t.mb, t.stage))
        self._ready.add(t)

    @staticmethod
    def _pop(heap: list[tuple[int, int, int]], kind: str) -> Task:
        a, b, s = heapq.heappop(heap)
        return Task(s, kind, b if kind != W else a)

    def _dispatch(self, t: Task) -> Task:
        self._ready.discard(t)
        self.running = t
        return t

    def _remove_from_heap(self, t: Task) -> None:
        # Only the completion-order path picks a task that may sit anywhere in a heap.
        v = self._vidx[t.stage]
        heap, item = (
            (self._rf, (v, t.mb, t.stage)) if t.kind == F
            else (self._rw, (t.mb, -v, t.stage)) if t.kind == W
            else (self._rb, (-v, t.mb, t.stage))
        )
        heap.remove(item)
        heapq.heapify(heap)

    # ------------------------------------------------------------ diagnostics
    def waiting_for(self, limit: int = 3) -> str:
        """What this rank waits for, in words (for the watchdog's error)."""
        if self.finished:
            return "nothing (step finished)"
        if self.running is not None:
            return f"task {self.running} to finish"
        place = self.spec.placement
        missing = []
        for m in range(self.spec.n_microbatches):
            for s in self.stages:
                if (s, m) not in self._act:
                    missing.append(f"activation for {Task(s, F, m)} from stage {s - 1} (rank {place.rank_of(s - 1)})")
                elif (s, m) in self._fdone and s != self._last_stage and (s, m) not in self._grad:
                    missing.append(
                        f"gradient for {Task(s, self._bk, m)} from stage {s + 1} (rank {place.rank_of(s + 1)})"
                    )
            if len(missing) >= limit:
                break
        if self.strict and self._pos < len(self._order):
            missing.insert(0, f"strict order's next task {self._order[self._pos]}")
        if self.inflight >= self.limit:
            missing.append(f"in-flight limit {self.limit} reached")
        return "; ".join(missing[:limit + 1]) or "no ready task"
