"""Guards: what a rank may run when its in-flight limit or its memory budget binds (RRFP
§4.3, App. C). A guard filters the forwards a policy (:mod:`rrfp.scheduler.policy`) may
choose; backwards and ``W`` are never gated. Guards read the ready set and the rank's public
counters (:class:`RankState`) and change nothing.

``D`` is the number of forwards minus ``B`` finished so far this step on the rank
(activations held); with the split backward a microbatch counts until its ``W``, not its ``I``
(:data:`~rrfp.scheduler.tasks.IN_FLIGHT_END`: ``W`` reads what ``F`` saved, so at 1F1B's
limits every hint holds at most the microbatches strict 1F1B holds, as ZB-H1 does). In
readiness mode, once ``D`` reaches the in-flight limit:

- one stage per rank (:class:`CountLimit`): forwards are disabled; ready backwards (and ``W``
  fillers) still run;
- ``V > 1`` virtual stages, ``admission`` backpressure (:class:`Admission`, the default): the
  limit counts the microbatches in flight on the rank (its first virtual stage's F done, that
  stage's backward not). At the limit the rank admits no new microbatch, so no F runs on its
  first virtual stage, but every other ready task runs as the policy ranks it. The rank holds
  at most ``limit`` microbatches, that is at most ``limit * V`` activations. It cannot
  deadlock: only first-stage forwards ever wait, and a microbatch already admitted needs no
  first-stage forward of this rank to finish.
- ``V > 1``, ``completion-order`` backpressure (:class:`CompletionOrder`, RRFP App. C.2):
  while ``D`` is at the limit, the rank follows the deterministic microbatch-by-microbatch
  completion order (``m = 0..M-1``, each ``F_0..F_{V-1}, B_{V-1}..B_0``). It waits for its
  next task there instead of skipping it, until ``D`` drops below the limit; with the split
  backward a ready ``W`` runs first (it lowers ``D``) and may fill the wait. The bound is
  ``limit + V``. It serialises deep interleaved
  pipelines once the limit binds: simulated, 16 ranks x 2 virtual stages, 128 microbatches,
  limit 32 took 10x strict interleaved 1F1B.

Memory budget (:class:`ByteBudget`, rule and proofs in :mod:`rrfp.scheduler.memory`): with
``act_bytes`` (the bytes each ``F(stage, mb)`` holds) and ``memory_budget``, every forward asks
the rank's ledger (a banker's check); an admission also needs the count limit and, with virtual
stages, goes in microbatch order. When the ledger refuses an admission that the count allows
the guard says so (:data:`REFUSED`), so a memory-aware policy may first run the ``W`` that
frees bytes: ``W`` is never gated and only frees bytes, so the bound and the deadlock-freedom
argument are unchanged (a ready task is still dispatched whenever one is granted).

A schedule used as a hint (:class:`OrderPeak`, readiness over the order with neither a limit
nor a budget given): a forward waits until every backward task (``B``, ``I``, ``W``) that the
order puts before it is done. Then the rank's activations held on each virtual stage are at
most what the strict order holds at one point of it, on every stage at once, so its bytes are
at most the schedule's own peak whatever each virtual stage's bytes are (the in-flight limit
alone bounds a count: a schedule used as a hint held up to 1.7x the order's bytes in
simulation, and a field trial measured rank 0 of ``Interleaved1F1B`` 15% over PyTorch's own
run). Proof, with ``p`` the order position of the latest forward the rank has run: every
forward run lies at or before ``p``, and every backward task before ``p`` is done (``p``'s
forward waited for them), so per stage ``#F - #done <= `` the order's count after ``p``; a
forward is checked against ``#done`` which only grows, and a backward only lowers the count.
It cannot deadlock: in a global order of the strict run, take the earliest task that is the
first unfinished task of its rank's order; its input comes from an earlier task, finished
(else that task's rank would have an earlier first unfinished task); if it is a forward, every
task before it in its rank's order is done, so it may run; backwards never wait. The count
limits the schedule implies (:func:`~rrfp.runtime.doors.config.schedule_limits`) then hold too.

What a guard answers (:meth:`Guard.forward`), a *verdict* on forwards:

- :data:`ANY`: every ready forward; None: no forward; :data:`REFUSED`: no forward, the ledger
  refused an admission the count allows;
- :data:`LATER`: only forwards past the rank's first virtual stage (no admission);
- :data:`GATED`: each forward asks :meth:`Guard.permits` (a byte budget over an order);
- a ready-set heap entry ``(key, mb, stage)``: exactly that forward (a byte budget over the
  ready heaps: the best granted forward in the ready set's forward order);
- :class:`Only`: the completion order dictates the task (or, ``Only(None)``, only a ``W``).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from .memory import MemoryLedger
from .readyset import ReadySet
from .tasks import B_CODE, F, F_CODE, KIND_CODE, Task

ANY = "any"
"""Verdict: every ready forward may run."""
REFUSED = "refused"
"""Verdict: no forward; the memory ledger refused an admission that the count limit allows."""
LATER = "later"
"""Verdict: only forwards past the rank's first virtual stage (the rank admits nothing new)."""
GATED = "gated"
"""Verdict: every forward asks :meth:`Guard.permits`."""


def admits(verdict, guard: "Guard", ready: ReadySet, state: "RankState", i: int) -> bool:
    """Whether ``verdict`` (``guard.forward``'s) lets the forward at ready-set index ``i``
    (``virtual index * n_mb + mb``) run: every forward under :data:`ANY`, one past the first
    virtual stage under :data:`LATER`, the guard's :meth:`Guard.permits` under :data:`GATED`;
    none under any other verdict (None, :data:`REFUSED`, a heap entry, :class:`Only`). The one
    reading of a verdict for a policy that walks an order."""
    return verdict is ANY or (verdict is LATER and i >= state.n_mb) or (verdict is GATED and guard.permits(ready, state, i))


class Only(NamedTuple):
    """Verdict: the completion order's next task (an ``F`` or a backward), or None: only a
    ``W`` may fill the wait."""

    task: Task | None


_new = tuple.__new__  # Task(...) runs a Python-level __new__; this builds the same tuple faster


class RankState:
    """One rank's counters for one step, kept by the arbiter; guards and policies read them.

    Attributes:
        stages: the rank's stages, first virtual stage first.
        n_mb: microbatches per step.
        limit: the in-flight limit.
        inflight, peak_inflight: activations held (``D``), now / at most.
        mb_inflight, peak_mb_inflight: microbatches in flight (first virtual stage's F done,
            its backward not), now / at most; equal to ``inflight`` with one stage per rank.
        backward_kind: ``B``, or ``I`` with the split backward.
        guard: the rank's guard.
    """

    __slots__ = ("stages", "n_mb", "limit", "inflight", "peak_inflight", "mb_inflight", "peak_mb_inflight",
                 "backward_kind", "guard")

    def __init__(self, stages, n_mb: int, limit: int, backward_kind: str) -> None:
        self.stages = stages
        self.n_mb = n_mb
        self.limit = limit
        self.inflight = self.peak_inflight = self.mb_inflight = self.peak_mb_inflight = 0
        self.backward_kind = backward_kind
        self.guard: Guard = NO_GUARD


class Guard(Protocol):
    """Filters the forwards a policy may choose (module docstring).

    Attributes:
        may_bind: whether :meth:`binding` can ever be True.
    """

    may_bind: bool

    def forward(self, ready: ReadySet, state: RankState):
        """The verdict on forwards now (module docstring)."""

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        """Whether the ready forward at flag index ``i`` (``virtual index * M + mb``) may run
        now, for a policy that scans an order."""

    def binding(self, state: RankState) -> bool:
        """Whether the guard, not the policy, decides now (an alternating policy's round then
        stays where it was)."""


class _Unlimited:
    """Strict mode: the order alone decides."""

    may_bind = False

    def forward(self, ready, state):
        return ANY

    def permits(self, ready, state, i):
        return True

    def binding(self, state):
        return False


NO_GUARD = _Unlimited()


class CountLimit:
    """One stage per rank: no forward while ``D`` is at the in-flight limit."""

    may_bind = False

    def forward(self, ready: ReadySet, state: RankState):
        return ANY if state.inflight < state.limit else None

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        return state.inflight < state.limit

    def binding(self, state: RankState) -> bool:
        return False


class Admission:
    """Virtual stages, ``admission`` backpressure: at the limit no new microbatch is admitted
    (no forward on the first virtual stage); everything else runs."""

    may_bind = False

    def forward(self, ready: ReadySet, state: RankState):
        return ANY if state.mb_inflight < state.limit else LATER

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        # Flag index i < M is the first virtual stage: F there admits a new microbatch.
        return i >= state.n_mb or state.mb_inflight < state.limit

    def binding(self, state: RankState) -> bool:
        return False


class CompletionOrder:
    """Virtual stages, ``completion-order`` backpressure (RRFP App. C.2): at the limit the
    completion order's next task, or a ``W``.

    Args:
        state: the rank's counters (their ``stages`` and ``n_mb`` size the order).
    """

    __slots__ = ("_n", "_pos", "_flag")
    may_bind = True

    def __init__(self, state: RankState) -> None:
        self._n = state.n_mb * 2 * len(state.stages)
        # Position pos of the completion order is microbatch pos // 2V; within it, F on
        # virtual stages 0..V-1, then the backward on V-1..0. Computed, not stored; the flag
        # of the current position is cached because a waiting rank asks again and again.
        self._pos = 0
        self._flag = (F_CODE, 0)  # (kind code, flag index) of position _pos: F_0 of microbatch 0

    def forward(self, ready: ReadySet, state: RankState):
        if state.inflight < state.limit:
            return ANY
        done, n = ready.done, self._n
        pos = self._pos
        if ready.ready[2].find(1) >= 0:  # a ready W lowers D (split backward): it goes first
            return Only(None)
        c, i = self._flag
        nv = len(state.stages)
        if pos < n and done[c][i]:
            M = state.n_mb
            while pos < n and done[c][i]:
                pos += 1
                m, j = divmod(pos, 2 * nv)
                c, i = (F_CODE, j * M + m) if j < nv else (B_CODE, (2 * nv - 1 - j) * M + m)
            self._pos = pos
            self._flag = (c, i)
        if pos < n and ready.ready[c][i]:
            m, j = divmod(pos, 2 * nv)
            if c == F_CODE:
                return Only(_new(Task, (state.stages[j], F, m)))
            return Only(_new(Task, (state.stages[2 * nv - 1 - j], state.backward_kind, m)))
        return Only(None)

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        return state.inflight < state.limit

    def binding(self, state: RankState) -> bool:
        return state.inflight >= state.limit


class OrderPeak:
    """A schedule used as a hint holds at most what its strict order holds (module docstring):
    a forward waits until every backward task the order puts before it is done.

    Args:
        order: the rank's order (each of its tasks once).
        ready: the rank's ready set (its virtual-stage indices and microbatch count).
    """

    __slots__ = ("_need", "_backs", "_k")
    may_bind = False

    def __init__(self, order, ready: ReadySet) -> None:
        M, vidx = ready.n_mb, ready.vidx
        self._need = [0] * (len(vidx) * M)  # per forward flag: backward tasks before it in the order
        self._backs: list[tuple[int, int]] = []  # the order's backward tasks: (kind code, flag index)
        for s, k, m in order:
            if k == F:
                self._need[vidx[s] * M + m] = len(self._backs)
            else:
                self._backs.append((KIND_CODE[k], vidx[s] * M + m))
        self._k = 0  # cache: the order's first this many backward tasks are done

    def _done(self, ready: ReadySet) -> int:
        k, backs, done = self._k, self._backs, ready.done
        while k < len(backs) and done[backs[k][0]][backs[k][1]]:
            k += 1
        self._k = k
        return k

    def forward(self, ready: ReadySet, state: RankState):
        return GATED

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        return self._need[i] <= self._k or self._need[i] <= self._done(ready)

    def binding(self, state: RankState) -> bool:
        return False


class ByteBudget:
    """A memory budget: every forward asks the rank's ledger (the banker's check of
    :mod:`rrfp.scheduler.memory`); an admission also needs the count limit and, with virtual
    stages, goes in microbatch order.

    Args:
        ledger: the rank's ledger, with a budget.
    """

    __slots__ = ("mem",)
    may_bind = False

    def __init__(self, ledger: MemoryLedger) -> None:
        self.mem = ledger

    def forward(self, ready: ReadySet, state: RankState):
        if not ready.queues:
            return GATED
        mem, M, stages = self.mem, state.n_mb, state.stages
        rdy = ready.ready[F_CODE]
        interleaved = len(stages) > 1
        if interleaved:
            m0 = mem.n_admitted
            admit = m0 < M and rdy[m0]
        else:
            # One stage per rank: the lowest ready microbatch, the forward heap's top.
            m0 = ready.f[0][1] if ready.f else M
            admit = m0 < M
        room = admit and state.mb_inflight < state.limit
        admit = room and mem.grants(stages[0], m0)
        if room and not admit and not interleaved:
            return REFUSED
        best = None
        fs = ready.fsign
        if interleaved:
            # Forwards on later virtual stages: only in-flight microbatches have them ready.
            for m in mem.in_flight():
                for v in range(1, len(stages)):
                    if rdy[v * M + m]:
                        e = (v * fs, m, stages[v])
                        if (best is None or e < best) and mem.grants(e[2], m):
                            best = e
        if admit and (best is None or fs > 0):  # an admission has key 0: first unless depth-first
            best = (0, m0, stages[0])
        return best

    def permits(self, ready: ReadySet, state: RankState, i: int) -> bool:
        M = state.n_mb
        return (state.mb_inflight < state.limit or i >= M) and self.mem.grants(state.stages[i // M], i % M)

    def binding(self, state: RankState) -> bool:
        return False
