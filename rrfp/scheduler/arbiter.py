"""Ready-set arbitration for one rank (RRFP §4-5, App. A, App. C).

The arbiter is driven by events and never waits: the runtime (or the simulator) tells it
when an input arrives (:meth:`Arbiter.mark_input`) and when a task finishes
(:meth:`Arbiter.complete`), and asks it for the next task whenever compute is free
(:meth:`Arbiter.next`). ``None`` means nothing may run now: wait for the next event.

What runs when the in-flight limit or the memory budget binds (the backpressure rules, their
bounds and why they cannot deadlock) is in :mod:`rrfp.scheduler.backpressure`; the arbiter
inherits those decisions from its :class:`~rrfp.scheduler.backpressure.Backpressure` base.

Strict mode runs exactly the hint's order (the fixed-order baseline) and ignores the limit
and the memory budget.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

import heapq

from .backpressure import Backpressure, _new
from .backfill import Backfill
from .errors import SchedulingError
from .readyset import KIND_CODE as _CODE
from .memory import MemoryLedger, SizeFn, order_bytes
from .policy import Hint
from .tasks import F, I, W, PipelineSpec, Task





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


class Arbiter(Backpressure):
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

    Raises:
        ValueError: bad limit or budget, a budget without ``act_bytes`` or with
            ``completion-order`` backpressure, strict mode without a total order, or an
            order that is not exactly this rank's tasks.
    """

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
        if memory_budget is not None and len(spec.placement.stages_of(rank)) > 1 and hint.backpressure != "admission":
            raise ValueError(f"a memory budget needs admission backpressure, got {hint.backpressure!r}")
        if strict and hint.order is None:
            raise ValueError(f"strict mode needs a total-order hint, got the policy {hint.name!r}")
        if backfill is not None and not strict:
            raise ValueError("backfilling runs over a strict order: pass strict=True")
        self.backfill = backfill
        self._wsize = w_bytes
        self._bf_prefix: list[int] | None = None  # bytes after each task of the order (backfill)
        self._bf_ahead: list[tuple[int, int]] = []  # (order index, bytes) of forwards run ahead
        self.spec = spec
        self.rank = rank
        self.hint = hint
        self.strict = strict
        self.limit = inflight_limit
        self.stages = spec.placement.stages_of(rank)
        self._vidx = {s: i for i, s in enumerate(self.stages)}
        self._last_stage = spec.n_stages - 1
        self._bk = spec.backward_kind
        self._n_mb = spec.n_microbatches
        self._interleaved = len(self.stages) > 1
        self.n_tasks = len(self.stages) * spec.n_microbatches * (3 if spec.split_backward else 2)
        self.n_done = 0
        self.inflight = 0
        self.peak_inflight = 0
        # Microbatches in flight on this rank (first virtual stage's F done, its backward not):
        # what the admission backpressure counts. Equal to ``inflight`` with one stage per rank.
        self.mb_inflight = 0
        self.peak_mb_inflight = 0
        self._admission = self._interleaved_flag(spec, rank) and hint.backpressure == "admission"
        self.running: Task | None = None
        self.memory = None if act_bytes is None else MemoryLedger(
            self.stages, act_bytes, None if strict else memory_budget
        )
        self._mem = self.memory if memory_budget is not None and not strict else None
        # Per-(stage, microbatch) state as flags indexed by virtual index * M + microbatch:
        # bytearrays keep a 128-rank, 1024-microbatch simulation in cache, where sets of
        # tuples (millions of objects) made every event a cache miss and fed the GC.
        n = len(self.stages) * spec.n_microbatches
        self._act = bytearray(n)  # activation arrived (stage 0: the data)
        self._grad = bytearray(n)  # gradient arrived
        # Kind codes index the next two: 0 = F, 1 = B or I (one spec has one of them), 2 = W.
        self._done = (bytearray(n), bytearray(n), bytearray(n))  # finished
        self._rdy = (bytearray(n), bytearray(n), bytearray(n))  # in the ready set
        # Policy hints keep one heap per direction, keyed by the hint's within-direction
        # preference; total-order hints scan their order.
        self._policy = hint.order is None
        # F prefers the lower virtual index, or the higher one for a depth-first hint: entries
        # hold virtual index * _fsign, so a first-virtual-stage F has key 0 either way.
        self._fsign = -1 if hint.depth_first else 1
        self._free_first = hint.free_first  # W first when the budget refuses an F (backpressure.py)
        self._rf: list[tuple[int, int, int]] = []  # (virtual index * _fsign, mb, stage)
        self._rb: list[tuple[int, int, int]] = []  # (-virtual index, mb, stage): B prefers higher
        self._rw: list[tuple[int, int, int]] = []  # (mb, -virtual index, stage)
        # Entries taken out of a heap's middle by the completion order, one set per heap (the
        # heaps' entries can be equal tuples); dropped lazily when they reach the top, so
        # that a heap is empty exactly when it holds no live entry.
        self._stale: dict[int, set[tuple[int, int, int]]] = {id(self._rf): set(), id(self._rb): set(), id(self._rw): set()}
        self._n_stale = 0
        self._phase = hint.first
        self._alternate = hint.alternate
        # Whether the completion order may override the hint (it does while inflight >= limit).
        self._canon = self._interleaved and self._mem is None and not self._admission and not strict
        if hint.order is not None:
            validate_rank_order(spec, rank, list(hint.order[rank]))
            self._order = list(hint.order[rank])
            self._keys = [self._key(t) for t in self._order]
            self._pos = 0  # first index of self._order not yet dispatched (strict: the next)
        if self._interleaved:
            # The completion order (m = 0..M-1, each F_0..F_{V-1}, B_{V-1}..B_0) is computed
            # position by position (_choose_completion_order) rather than stored: M * 2V tasks per rank.
            self._canon_len = spec.n_microbatches * 2 * len(self.stages)
            self._canon_pos = 0
            self._canon_flag = (0, 0)  # (kind code, flag index) of position _canon_pos: F_0 of mb 0
        if self.stages[0] == 0:
            for m in range(spec.n_microbatches):
                self._act[m] = 1
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
        v = self._vidx.get(stage)
        if v is None or not 0 <= mb < self._n_mb:
            raise SchedulingError(
                f"rank {self.rank}: input for stage {stage} microbatch {mb}, which this rank does not run"
            )
        i = v * self._n_mb + mb
        # _make_ready inlined: the simulator calls this once per message.
        if grad:
            if self._grad[i] or stage == self._last_stage:
                raise SchedulingError(f"rank {self.rank}: duplicate gradient for stage {stage} microbatch {mb}")
            self._grad[i] = 1
            if self._done[0][i]:
                self._rdy[1][i] = 1
                if self._policy:
                    heapq.heappush(self._rb, (-v, mb, stage))
        else:
            if self._act[i]:
                raise SchedulingError(f"rank {self.rank}: duplicate activation for stage {stage} microbatch {mb}")
            self._act[i] = 1
            self._rdy[0][i] = 1
            if self._policy:
                heapq.heappush(self._rf, (v * self._fsign, mb, stage))

    @property
    def peak_bytes(self) -> int:
        """Most activation bytes held at once this step (0 without ``act_bytes``)."""
        return 0 if self.memory is None else self.memory.peak_held

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
        # _make_ready inlined: the simulator calls this once per task.
        if self.memory is not None:
            if k == F:
                self.memory.forward_done(s, m, nbytes)
            elif k != I:
                self.memory.backward_done(s, m)
            elif self._wsize is not None:
                # W still reads each split layer's input and output gradient: only the rest
                # of what F saved is free at I (unknown: all of it stays until W).
                self.memory.input_backward_done(s, m, self._wsize(s, m))
        if k == F:
            self._done[0][i] = 1
            self.inflight += 1
            if self.inflight > self.peak_inflight:
                self.peak_inflight = self.inflight
            if v == 0:
                self.mb_inflight += 1
                if self.mb_inflight > self.peak_mb_inflight:
                    self.peak_mb_inflight = self.mb_inflight
            if s == self._last_stage or self._grad[i]:
                self._rdy[1][i] = 1
                if self._policy:
                    heapq.heappush(self._rb, (-v, m, s))
        elif k == W:
            self._done[2][i] = 1
        else:
            self._done[1][i] = 1
            self.inflight -= 1
            if v == 0:
                self.mb_inflight -= 1
            if k == I:
                self._rdy[2][i] = 1
                if self._policy:
                    heapq.heappush(self._rw, (m, -v, s))

    # --------------------------------------------------------------- decisions
    def next(self) -> Task | None:
        """Take the best-ranked ready task (it becomes :attr:`running`), or return None when
        nothing may run until the next event: :meth:`propose` then :meth:`commit`.

        Raises:
            SchedulingError: if a task is already running (one compute task at a time).
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: next() while {self.running} is running")
        t = self._choose()
        if t is not None:
            self._take(t)
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
        return self._choose()

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
        if v is None or c is None or not 0 <= task[2] < self._n_mb or not self._rdy[c][v * self._n_mb + task[2]]:
            raise SchedulingError(f"rank {self.rank}: commit of {task}, which is not ready")
        self._take(task)

    def _choose(self) -> Task | None:
        # Pure: which task the hint, the order and the guards (limit, admission, completion
        # order, byte budget) pick now. Only caches advance (a strict order's position past
        # finished tasks, stale heap entries dropped), never a decision.
        if self.strict:
            if self.backfill is not None:
                return self._choose_backfill()
            if self._pos < len(self._order):
                c, i = self._keys[self._pos]
                if self._rdy[c][i]:
                    return self._order[self._pos]
            return None
        mem = self._mem
        if mem is not None:
            return self._choose_budget(mem)
        if self._admission:
            if self.mb_inflight < self.limit:
                return self._choose_policy(True) if self._policy else self._choose_in_order(True)
            return self._choose_policy_admission() if self._policy else self._choose_in_order(True, admit=False)
        if self._interleaved and self.inflight >= self.limit:
            return self._choose_completion_order()
        if self._policy:
            return self._choose_policy(self.inflight < self.limit)
        return self._choose_in_order(self.inflight < self.limit)

    def _take(self, t: Task) -> None:
        # The one place a chosen task leaves the ready set. The simulator calls this once per
        # task: key and heap entry are computed inline.
        s, k, m = t
        self.running = t
        if self._policy:
            if k == F:
                heap, c, phase = self._rf, 0, "B"
            elif k == W:
                heap, c, phase = self._rw, 2, None
            else:
                heap, c, phase = self._rb, 1, F
            top = heap[0]
            if top[2] == s and top[0 if c == 2 else 1] == m:  # the usual case: the heap's top
                heapq.heappop(heap)
                if self._n_stale:
                    self._drop_stale(heap)
                v = top[0] * self._fsign if c == 0 else -top[0] if c == 1 else -top[1]
            else:  # from the heap's middle (admission scan, completion order, commit)
                v = self._vidx[s]
                self._stale[id(heap)].add((v * self._fsign, m, s) if c == 0 else (-v, m, s) if c == 1 else (m, -v, s))
                self._n_stale += 1
            self._rdy[c][v * self._n_mb + m] = 0
            # A BF/FB round alternates after each F or backward it picks; the completion
            # order overrides the hint and leaves its round where it was.
            if phase is not None and self._alternate and not (self._canon and self.inflight >= self.limit):
                self._phase = phase
            return
        v = self._vidx[s]
        c = 0 if k == F else 2 if k == W else 1
        self._rdy[c][v * self._n_mb + m] = 0
        if self.strict:
            pos = self._pos
            if pos < len(self._order) and self._order[pos] == t:
                self._pos = pos + 1
            elif self.backfill is not None:
                self.backfill.n_backfilled += 1
                if c == 0:
                    self._bf_ahead.append((self._order_index[t], self._bf_size(t)))

    def _choose_policy(self, f_allowed: bool, f_entry: tuple[int, int, int] | None = None) -> Task | None:
        # The simulator calls this once per task. ``f_entry``: the one F heap entry the
        # guards allow (any, when None and f_allowed).
        rf, rb = self._rf, self._rb
        if f_entry is not None or (f_allowed and rf):
            kind = self._phase if rb else F
        elif rb:
            kind = "B"
        elif self._rw:
            m, _, s = self._rw[0]
            return _new(Task, (s, W, m))
        else:
            return None
        if kind == F:
            _, m, s = rf[0] if f_entry is None else f_entry
            return _new(Task, (s, F, m))
        _, m, s = rb[0]
        return _new(Task, (s, self._bk, m))

    def _choose_backfill(self) -> Task | None:
        # Strict order with backfilling (rrfp.scheduler.backfill): the planned task if ready,
        # else the first later ready task that ends before the planned task's input arrives.
        order, keys, rdy, done = self._order, self._keys, self._rdy, self._done
        n, pos = len(order), self._pos
        while pos < n and done[keys[pos][0]][keys[pos][1]]:
            pos += 1
        self._pos = pos
        if pos == n:
            return None
        c, i = keys[pos]
        if rdy[c][i]:
            return order[pos]
        bf = self.backfill
        room = bf.room(order[pos])
        if room <= 0:
            return None
        for j in range(pos + 1, n):
            c, i = keys[j]
            if rdy[c][i]:
                t = order[j]
                if bf.fits(t, room) and (c != 0 or self._backfill_bytes_ok(pos, j, t)):
                    return t
        return None

    def _bf_size(self, t: Task) -> int | None:
        return self.memory.size(t.stage, t.mb) if self.memory is not None else 1

    def _backfill_bytes_ok(self, pos: int, j: int, t: Task) -> bool:
        # A forward run ahead of the order adds its bytes from now until the order reaches it:
        # allowed only if the order's own bytes over that stretch, plus those of forwards
        # already run ahead, plus this one, stay within the order's peak. Without sizes the
        # count of activations stands in for bytes.
        if self._bf_prefix is None:
            size = self.memory.size if self.memory is not None else (lambda s, m: 1)
            self._bf_prefix = order_bytes(self._order, size, self._wsize if self.memory is not None else None)
            self._order_index = {x: k for k, x in enumerate(self._order)}
        x = self._bf_size(t)
        if x is None:
            return False
        prefix = self._bf_prefix
        extra = sum(b for k, b in self._bf_ahead if k > pos) + x
        cap = max(prefix)
        lo = prefix[pos - 1] if pos else 0
        return max(prefix[pos:j], default=lo) + extra <= cap and lo + extra <= cap

    def _choose_in_order(self, f_allowed: bool, admit: bool = True, budget: bool = False) -> Task | None:
        # ``budget``: every forward asks the memory ledger, admissions within the count limit.
        order, keys, rdy, done = self._order, self._keys, self._rdy, self._done
        n, M = len(order), self._n_mb
        while self._pos < n and done[keys[self._pos][0]][keys[self._pos][1]]:
            self._pos += 1
        if budget:
            mem, stages, room = self._mem, self.stages, self.mb_inflight < self.limit
            for j in range(self._pos, n):
                c, i = keys[j]
                if rdy[c][i] and (c != 0 or ((room or i >= M) and mem.grants(stages[i // M], i % M))):
                    return order[j]
            return None
        for j in range(self._pos, n):
            c, i = keys[j]
            # Flag index i < M is the first virtual stage: F there admits a new microbatch.
            if rdy[c][i] and (c != 0 or (f_allowed and (i >= M or admit))):
                return order[j]
        return None

    # ------------------------------------------------------------- internals
    @staticmethod
    def _interleaved_flag(spec: PipelineSpec, rank: int) -> bool:
        return len(spec.placement.stages_of(rank)) > 1

    def _key(self, t: Task) -> tuple[int, int]:
        """(kind code, flag index) of one of this rank's tasks."""
        s, k, m = t
        return _CODE[k], self._vidx[s] * self._n_mb + m

    def _make_ready(self, t: Task) -> None:
        if self._policy:
            s, k, m = t
            v = self._vidx[s]
            if k == F:
                heapq.heappush(self._rf, (v * self._fsign, m, s))
            elif k == W:
                heapq.heappush(self._rw, (m, -v, s))
            else:
                heapq.heappush(self._rb, (-v, m, s))
        c, i = self._key(t)
        self._rdy[c][i] = 1

    def _drop_stale(self, heap: list[tuple[int, int, int]]) -> None:
        stale = self._stale[id(heap)]
        while heap and heap[0] in stale:
            stale.discard(heapq.heappop(heap))
            self._n_stale -= 1

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
            for v, s in enumerate(self.stages):
                i = v * self._n_mb + m
                if not self._act[i]:
                    missing.append(f"activation for {Task(s, F, m)} from stage {s - 1} (rank {place.rank_of(s - 1)})")
                elif self._done[0][i] and s != self._last_stage and not self._grad[i]:
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
