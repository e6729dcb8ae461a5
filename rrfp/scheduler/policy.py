"""Policies: what a rank runs next among its ready tasks (RRFP §4, App. A), and what a hint
is once resolved (:class:`Hint`).

A :class:`Policy` looks at the ready set and the rank's counters and names one task, or None
(nothing may run until the next event); it changes no decision state (only caches, such as a
position past finished tasks of its order). What it may choose is filtered by the rank's guard
(:mod:`rrfp.scheduler.guards`: in-flight limit, admission, completion order, byte budget),
which it asks for the verdict on forwards; backwards and ``W`` are never gated.

A policy is a :class:`Policy`: it declares at construction what it asks of the ready set
(:attr:`Policy.queues`, :attr:`Policy.depth_first`), keeps its own state (a round, a position
in an order) and is told every task the arbiter took (:meth:`Policy.taken`, always called).
The arbiter has no policy-specific branch. Policies are built per rank and step by the
factories of the hint table (:mod:`rrfp.scheduler.registry`); the mechanisms a hint runs by:

- kind-ranking policies (:class:`KindPolicy`: ``bf``, ``fb``, ``bfw``, ``b-priority``,
  ``f-priority``, ``bfw-alt``, the depth-first ``-df`` variants, the memory-aware ``bfw-mem``)
  rank whatever is ready by kind, from the ready set's heaps;
- :class:`InOrder`: a total order in readiness mode, the first ready task of the order that
  the guard allows (a named schedule, ``split``, a user order);
- :class:`StrictOrder`: the order's next task, waiting for it (the fixed-order baseline; no
  guard);
- :class:`BackfillOrder`: the strict order with conservative backfilling
  (:mod:`rrfp.scheduler.backfill`).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from heapq import heappop
from typing import Callable, Sequence

from .backfill import Backfill
from .guards import ANY, LATER, REFUSED, Only, RankState, admits
from .memory import MemoryLedger, SizeFn, order_bytes
from .readyset import B_CODE, KIND_CODE, ReadySet
from .schedules import Order
from .tasks import B, F, F_CODE, W, W_CODE, Task

_new = tuple.__new__  # Task(...) runs a Python-level __new__; this builds the same tuple faster


def placement_schedule(n_virtual: int, kind: str = "loop") -> str | None:
    """The fixed order a placement has (:data:`~rrfp.scheduler.schedules.SCHEDULES` name):
    ``1f1b`` with one stage per rank, ``interleaved-1f1b`` for the ``loop`` placement with
    virtual stages, ``zb-v`` for the ``v`` placement with two; None otherwise."""
    if n_virtual == 1:
        return "1f1b"
    if kind == "loop":
        return "interleaved-1f1b"
    return "zb-v" if n_virtual == 2 else None


class Policy:
    """Chooses one rank's next task (module docstring). Subclass it; a policy is built once per
    rank and step by its factory, so it may keep state of its own.

    Attributes (declared, fixed at construction; the arbiter configures the ready set from
    them before any task joins it):
        name: the policy's name (for messages).
        queues: it reads the ready set's heaps (:attr:`ReadySet.f`, ``b``, ``w``); False: the
            flags only, and the heaps are not kept.
        depth_first: the forward heap puts later virtual stages first.
    """

    name = "policy"
    queues = False
    depth_first = False

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        """The task to run now, or None (nothing may run until the next event). No side
        effects: the arbiter may ask again, or take another task (a TP group's agreement)."""
        raise NotImplementedError(f"policy {self.name!r}: choose() is not implemented")

    def taken(self, task: Task, state: RankState) -> None:
        """The arbiter took ``task`` (it runs); called once for every task taken, chosen by
        this policy or not (a TP group may agree on another ready task). The place to move
        the policy's own state (a round, what ran ahead of an order)."""

    def planned(self) -> Task | None:
        """The task the policy's order runs next (a strict order's planned task), or None
        (no order). Read for messages and by backfilling's notices."""
        return None

    def next_taken(self, ready: ReadySet, state: RankState) -> Task | None:
        """:meth:`choose`, and the chosen task taken: out of the ready set
        (:meth:`ReadySet.take`) and told to :meth:`taken`. What :meth:`Arbiter.next` runs. A
        policy may fuse the three for speed; ``tests/test_scheduler_policy.py`` checks that a
        fused path dispatches what this one does and leaves the same ready set."""
        t = self.choose(ready, state)
        if t is not None:
            ready.take(t)
            self.taken(t, state)
        return t


class KindPolicy(Policy):
    """Ranks ready tasks by kind (RRFP App. A): a backward or a forward, each the best of its
    kind in the ready set's order; ``W`` only when neither may run. Built per rank: it keeps
    the round of an alternating policy (:attr:`phase`).

    Args:
        name: the hint name.
        first: the kind preferred when both a forward and a backward may run, in the first
            round (alternating) or always (a fixed priority).
        alternate: BF/FB rounds (one of each kind in turn) instead of a fixed priority.
        depth_first: among ready forwards prefer the latest virtual stage, so a microbatch
            already admitted moves on to its backward (and frees its memory) before a new one
            starts; with one stage per rank it changes nothing.
        free_first: when the byte budget refuses an admission the count allows
            (:data:`~rrfp.scheduler.guards.REFUSED`), run a ready ``W`` first: it frees the
            bytes the forward waits for.
        guard_binds: the rank's guard can decide (:attr:`Guard.may_bind`); False spares
            :meth:`taken` asking it (the simulator calls it once per task).

    Attributes:
        phase: the kind the policy prefers next (``F`` or ``B``): ``first``, then, when
            alternating, flipped after each forward or backward taken while the guard does
            not decide (:meth:`taken`).
    """

    queues = True

    def __init__(self, name: str, first: str, alternate: bool, *, depth_first: bool = False,
                 free_first: bool = False, guard_binds: bool = True) -> None:
        self.name, self.first, self.alternate = name, first, alternate
        self.depth_first, self.free_first = depth_first, free_first
        self.guard_binds = guard_binds
        self.phase = first

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        # The simulator calls this once per decision.
        f = state.guard.forward(ready, state)
        if f is ANY:
            f = ready.f[0] if ready.f else None
        elif f is None:
            pass
        elif f is LATER:
            f = ready.later_forward()
        elif f is REFUSED:
            if self.free_first and ready.w:
                m, _, s = ready.w[0]
                return _new(Task, (s, W, m))
            f = None
        elif f.__class__ is Only:
            if f.task is not None:
                return f.task
            if not ready.w:  # a W may fill the completion order's wait; no other task
                return None
            m, _, s = ready.w[0]
            return _new(Task, (s, W, m))
        rb = ready.b
        if f is not None and (not rb or self.phase == F):
            return _new(Task, (f[2], F, f[1]))
        if rb:
            _, m, s = rb[0]
            return _new(Task, (s, state.backward_kind, m))
        if ready.w:
            m, _, s = ready.w[0]
            return _new(Task, (s, W, m))
        return None

    def taken(self, task: Task, state: RankState) -> None:
        """A BF/FB round alternates after each forward or backward; a guard that decides (the
        completion order) leaves the round where it was. A fixed priority keeps no round."""
        if self.alternate:
            k = task[1]
            if k != W and not (self.guard_binds and state.guard.binding(state)):
                self.phase = B if k == F else F

    def next_taken(self, ready: ReadySet, state: RankState) -> Task | None:
        """:meth:`Policy.next_taken` fused (the simulator's one call per decision): the best
        task of each kind is its heap's top, so taking it pops that top. Verdicts other than
        any forward, none, or later forwards (a byte budget's, the completion order's) take
        the plain path."""
        rb, rf, rw = ready.b, ready.f, ready.w
        if not rb and not rf and not rw:
            # Nothing ready (the heaps hold exactly the ready tasks): no verdict can name a
            # task. About half the simulator's decisions end here; guards keep no state
            # but caches, so skipping their verdict changes nothing.
            return None
        f = state.guard.forward(ready, state)
        if f is ANY:
            f = rf[0] if rf else None
        elif f is LATER:
            f = ready.later_forward()
        elif f is not None:
            return Policy.next_taken(self, ready, state)
        # Each branch takes its kind's best task (a heap's top: popped, its flag cleared) and
        # moves an alternating round unless the guard decides.
        if f is not None and (not rb or self.phase == F):
            v, m, s = f
            i = v * ready.fsign * ready.n_mb + m
            if rf[0] is f or rf[0] == f:
                heappop(rf)
                if ready.n_stale:
                    ready.drop_stale(rf, F_CODE)
            else:  # a later forward below first-stage ones: dropped lazily
                ready.stale[F_CODE].add(f)
                ready.n_stale += 1
            ready.ready[F_CODE][i] = 0
            if self.alternate and not (self.guard_binds and state.guard.binding(state)):
                self.phase = B
            return _new(Task, (s, F, m))
        if rb:
            v, m, s = heappop(rb)
            if ready.n_stale:
                ready.drop_stale(rb, B_CODE)
            ready.ready[B_CODE][-v * ready.n_mb + m] = 0
            if self.alternate and not (self.guard_binds and state.guard.binding(state)):
                self.phase = F
            return _new(Task, (s, state.backward_kind, m))
        if rw:
            m, v, s = heappop(rw)
            if ready.n_stale:
                ready.drop_stale(rw, W_CODE)
            ready.ready[W_CODE][-v * ready.n_mb + m] = 0
            return _new(Task, (s, W, m))
        return None


def kind_policy(name: str, first: str, alternate: bool, *, depth_first: bool = False,
                free_first: bool = False) -> "PolicyFactory":
    """A factory of :class:`KindPolicy` (a fresh one per rank and step: it keeps its round)."""
    def factory(*, state: RankState | None = None, **_) -> KindPolicy:
        return KindPolicy(name, first, alternate, depth_first=depth_first, free_first=free_first,
                          guard_binds=state is None or state.guard.may_bind)
    return factory


class _OrderPolicy(Policy):
    def __init__(self, order: Sequence[Task], ready: ReadySet) -> None:
        self.order = list(order)
        M, vidx = ready.n_mb, ready.vidx
        self.keys = [(KIND_CODE[k], vidx[s] * M + m) for s, k, m in self.order]
        self.pos = 0  # cache: no task before it is left to run

    def _skip_done(self, done) -> int:
        order_keys, pos, n = self.keys, self.pos, len(self.keys)
        while pos < n and done[order_keys[pos][0]][order_keys[pos][1]]:
            pos += 1
        self.pos = pos
        return pos

    def planned(self) -> Task | None:
        """The order's first task not finished (as of the last decision)."""
        return self.order[self.pos] if self.pos < len(self.order) else None


class InOrder(_OrderPolicy):
    """A total order in readiness mode: its first ready task that the guard allows.

    Args:
        order: the rank's order (each of its tasks once).
        ready: the rank's ready set.
    """

    name = "order"

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        g = state.guard
        f = g.forward(ready, state)
        order, keys, rdy = self.order, self.keys, ready.ready
        pos = self._skip_done(ready.done)
        if f.__class__ is Only:
            if f.task is not None:
                return f.task
            rw = rdy[W_CODE]
            for j in range(pos, len(order)):  # a W fills the completion order's wait
                c, i = keys[j]
                if c == W_CODE and rw[i]:
                    return order[j]
            return None
        cf = F_CODE
        for j in range(pos, len(order)):
            c, i = keys[j]
            if rdy[c][i] and (c != cf or admits(f, g, ready, state, i)):
                return order[j]
        return None


class StrictOrder(_OrderPolicy):
    """The fixed-order baseline: the order's next task once it is ready, waiting for it; no
    guard applies.

    Args:
        order: the rank's order.
        ready: the rank's ready set.
    """

    name = "strict"

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        pos = self._skip_done(ready.done)
        if pos < len(self.order):
            c, i = self.keys[pos]
            if ready.ready[c][i]:
                return self.order[pos]
        return None


class BackfillOrder(_OrderPolicy):
    """A strict order with conservative backfilling (:mod:`rrfp.scheduler.backfill`): the
    planned task if ready, else the first later ready task of the order that ends before the
    planned task's input can arrive and, for a forward, keeps the rank within the order's own
    peak bytes.

    Args:
        order: the rank's order.
        ready: the rank's ready set.
        backfill: the rank's backfilling state (estimates, notices, clock).
        memory: the rank's counting ledger (sizes), or None: activations are counted instead.
        w_bytes: bytes a split backward's ``W`` reads (the ledger's rule), or None.
    """

    name = "backfill"

    def __init__(self, order: Sequence[Task], ready: ReadySet, backfill: Backfill,
                 memory: MemoryLedger | None = None, w_bytes: SizeFn | None = None) -> None:
        super().__init__(order, ready)
        self.backfill = backfill
        self.memory = memory
        self._wsize = w_bytes
        self._prefix: list[int] | None = None  # bytes after each task of the order
        self._index: dict[Task, int] = {}
        self._ahead: list[tuple[int, int | None]] = []  # (order index, bytes) of forwards run ahead

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        order, keys, rdy = self.order, self.keys, ready.ready
        n = len(order)
        pos = self._skip_done(ready.done)
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
                if bf.fits(t, room) and (c != F_CODE or self._bytes_ok(pos, j, t)):
                    return t
        return None

    def taken(self, task: Task, state: RankState) -> None:
        """The arbiter took ``task``: count it if it ran ahead of the order."""
        if self.pos < len(self.order) and self.order[self.pos] == task:
            return
        self.backfill.n_backfilled += 1
        if task[1] == F:
            self._ahead.append((self._index[task], self._size(task)))

    def _size(self, t: Task) -> int | None:
        return self.memory.size(t[0], t[2]) if self.memory is not None else 1

    def _bytes_ok(self, pos: int, j: int, t: Task) -> bool:
        # A forward run ahead of the order adds its bytes from now until the order reaches it:
        # allowed only if the order's own bytes over that stretch, plus those of forwards
        # already run ahead, plus this one, stay within the order's peak. Without sizes the
        # count of activations stands in for bytes.
        if self._prefix is None:
            size = self.memory.size if self.memory is not None else (lambda s, m: 1)
            self._prefix = order_bytes(self.order, size, self._wsize if self.memory is not None else None)
            self._index = {x: k for k, x in enumerate(self.order)}
        x = self._size(t)
        return x is not None and room_ahead(self._prefix, self._ahead, pos, j, x)


def room_ahead(prefix: Sequence[int], ahead: Sequence[tuple[int, int | None]], pos: int, j: int, x: int) -> bool:
    """Whether a forward of ``x`` bytes at index ``j`` of an order may run while the order is
    at index ``pos < j``: it adds its bytes from now until the order reaches it, so the
    order's own bytes over that stretch (``prefix[k]``: bytes held after the order's task
    ``k``), plus those of forwards already run ahead (``ahead``: ``(order index, bytes)``, those
    past ``pos`` still count), plus ``x``, must stay within the order's peak. Keeps a policy
    that runs forwards ahead within its strict order's own memory."""
    extra = sum(b or 0 for k, b in ahead if k > pos) + x
    cap = max(prefix)
    lo = prefix[pos - 1] if pos else 0
    return max(prefix[pos:j], default=lo) + extra <= cap and lo + extra <= cap


PolicyFactory = Callable[..., Policy]
"""Builds one rank's policy for one step from keywords (``order``: the rank's order or None;
``ready``: its :class:`ReadySet`; ``state``: its :class:`RankState`, guard set; ``backfill``;
``memory``: its :class:`MemoryLedger` or None; ``w_bytes``), taking what it needs and ignoring
the rest (``**_``)."""


def in_order(*, order, ready, **_) -> InOrder:
    """Factory of :class:`InOrder` (a total order in readiness mode)."""
    return InOrder(order, ready)


def strict_order(*, order, ready, **_) -> StrictOrder:
    """Factory of :class:`StrictOrder` (strict mode)."""
    return StrictOrder(order, ready)


def backfill_order(*, order, ready, backfill, memory=None, w_bytes=None, **_) -> BackfillOrder:
    """Factory of :class:`BackfillOrder` (strict mode with backfilling)."""
    return BackfillOrder(order, ready, backfill, memory, w_bytes)


@dataclass(frozen=True)
class Hint:
    """A resolved hint.

    Attributes:
        name: the hint's name as the user gave it, without ``strict-``.
        policy: the hint-table name (:data:`rrfp.scheduler.registry.HINTS`) whose policy runs
            in readiness mode (None: ``name`` for a policy; for a total order, readiness over
            the order, :class:`InOrder`). With an order it names an entry that takes the
            order (``wfloat``: :mod:`rrfp.scheduler.wfloat`); a policy's name beside an order
            of its own (a compiled ``strict-bf``) is only a label.
        order: for a total-order hint, the per-rank order; None for a policy.
        backpressure: what readiness mode does at the in-flight limit with virtual stages
            (``admission`` or ``completion-order``, :mod:`rrfp.scheduler.guards`); one stage
            per rank always disables forwards.
        backfill: strict order with conservative backfilling (:mod:`rrfp.scheduler.backfill`).
        held_to_order: readiness over the order holds at most what the order holds: a forward
            waits for every backward task the order puts before it
            (:class:`~rrfp.scheduler.guards.OrderPeak`; set by the front doors' plan for a
            schedule used as a hint without a limit or budget).
    """

    name: str
    policy: str | None = None
    order: Order | None = field(default=None, compare=False)
    backpressure: str = "admission"
    backfill: bool = False
    held_to_order: bool = False
