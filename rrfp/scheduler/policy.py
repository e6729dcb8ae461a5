"""Policies: what a rank runs next among its ready tasks (RRFP §4, App. A), and what a hint
is once resolved (:class:`Hint`).

A :class:`Policy` looks at the ready set and the rank's counters and names one task, or None
(nothing may run until the next event); it changes no decision state (only caches, such as a
position past finished tasks of its order). What it may choose is filtered by the rank's guard
(:mod:`rrfp.scheduler.guards`: in-flight limit, admission, completion order, byte budget),
which it asks for the verdict on forwards; backwards and ``W`` are never gated.

Policies are registered by name (:data:`POLICY_REGISTRY`); the hint resolver
(:mod:`rrfp.scheduler.hints`) names one in :attr:`Hint.policy` and the arbiter builds it
(:func:`build_policy`):

- kind-ranking policies (:class:`KindPolicy`: ``bf``, ``fb``, ``bfw``, ``b-priority``,
  ``f-priority``, ``bfw-alt``, the depth-first ``-df`` variants, the memory-aware ``bfw-mem``)
  rank whatever is ready by kind, from the ready set's heaps;
- ``order`` (:class:`InOrder`): a total order in readiness mode, the first ready task of the
  order that the guard allows (a named schedule, ``split``, a user order);
- ``strict`` (:class:`StrictOrder`): the order's next task, waiting for it (the fixed-order
  baseline; no guard);
- ``backfill`` (:class:`BackfillOrder`): the strict order with conservative backfilling
  (:mod:`rrfp.scheduler.backfill`).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from .backfill import Backfill
from .guards import ANY, LATER, REFUSED, Only, RankState, admits
from .memory import MemoryLedger, SizeFn, order_bytes
from .readyset import KIND_CODE, ReadySet
from .schedules import Order
from .tasks import B, F, W, Task

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


class Policy(Protocol):
    """Chooses one rank's next task (module docstring).

    Attributes:
        name: the registered name.
        queues: whether it reads the ready set's heaps (:attr:`ReadySet.f` ...).
        depth_first: whether the ready set orders forwards depth-first.
        alternate: whether it alternates rounds (:attr:`RankState.phase`).
        first: the kind its first round prefers.
    """

    name: str
    queues: bool
    depth_first: bool
    alternate: bool
    first: str

    def choose(self, ready: ReadySet, state: RankState) -> Task | None:
        """The task to run now, or None; no side effects."""


class KindPolicy:
    """Ranks ready tasks by kind (RRFP App. A): a backward or a forward, each the best of its
    kind in the ready set's order; ``W`` only when neither may run.

    Args:
        name: the registered name.
        first: the kind preferred when both a forward and a backward may run, in the first
            round (alternating) or always (a fixed priority).
        alternate: BF/FB rounds (one of each kind in turn) instead of a fixed priority.
        split: the backward form the policy implies (``I`` + ``W``).
        depth_first: among ready forwards prefer the latest virtual stage, so a microbatch
            already admitted moves on to its backward (and frees its memory) before a new one
            starts; with one stage per rank it changes nothing.
        free_first: when the byte budget refuses an admission the count allows
            (:data:`~rrfp.scheduler.guards.REFUSED`), run a ready ``W`` first: it frees the
            bytes the forward waits for.
    """

    queues = True

    def __init__(self, name: str, first: str, alternate: bool, split: bool, *, depth_first: bool = False,
                 free_first: bool = False) -> None:
        self.name, self.first, self.alternate, self.split = name, first, alternate, split
        self.depth_first, self.free_first = depth_first, free_first

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
        if f is not None and (not rb or state.phase == F):
            return _new(Task, (f[2], F, f[1]))
        if rb:
            _, m, s = rb[0]
            return _new(Task, (s, state.backward_kind, m))
        if ready.w:
            m, _, s = ready.w[0]
            return _new(Task, (s, W, m))
        return None


class _OrderPolicy:
    queues = False
    depth_first = False
    alternate = False
    first = B

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
            for j in range(pos, len(order)):  # a W fills the completion order's wait
                c, i = keys[j]
                if c == 2 and rdy[2][i]:
                    return order[j]
            return None
        for j in range(pos, len(order)):
            c, i = keys[j]
            if rdy[c][i] and (c != 0 or admits(f, g, ready, state, i)):
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
                if bf.fits(t, room) and (c != 0 or self._bytes_ok(pos, j, t)):
                    return t
        return None

    def taken(self, task: Task) -> None:
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


KIND_POLICIES: dict[str, KindPolicy] = {}
"""The registered kind-ranking policies, by name, in registration order."""

PolicyFactory = Callable[..., Policy]
POLICY_REGISTRY: dict[str, PolicyFactory] = {}
"""Registered policies: name -> ``factory(order=, ready=, backfill=, memory=, w_bytes=)``
(each factory takes what it needs)."""


def register(name: str, factory: PolicyFactory) -> None:
    """Register a policy under ``name``.

    Raises:
        ValueError: ``name`` is taken.
    """
    if name in POLICY_REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    POLICY_REGISTRY[name] = factory


def _register_kind(p: KindPolicy) -> None:
    KIND_POLICIES[p.name] = p
    register(p.name, lambda **_: p)


for _p in (
    KindPolicy("bf", B, True, False),
    KindPolicy("fb", F, True, False),
    KindPolicy("bfw", B, False, True),
    KindPolicy("b-priority", B, False, False),
    KindPolicy("f-priority", F, False, False),
    # bfw-alt: bf's rounds with the split backward, W only when neither kind may run. Under a
    # memory budget the forward a round may run is capped by the budget, so a ready F goes
    # downstream as soon as memory allows instead of waiting behind every ready I (bfw).
    KindPolicy("bfw-alt", B, True, True),
    KindPolicy("bf-df", B, True, False, depth_first=True),
    KindPolicy("bfw-df", B, False, True, depth_first=True),
    KindPolicy("bfw-alt-df", B, True, True, depth_first=True),
    # bfw-mem: bfw-alt-df that frees bytes first (KindPolicy.free_first) with one stage per
    # rank. Measured on the suite at 1F1B's memory (docs/suite.md): median speedup 1.085x ->
    # 1.098x, min 1.005x both; with virtual stages the rule was mixed (J3 -2%, J1 +2%), so the
    # guard reports a refusal only with one stage per rank.
    KindPolicy("bfw-mem", B, True, True, depth_first=True, free_first=True),
):
    _register_kind(_p)
register("order", lambda *, order, ready, **_: InOrder(order, ready))
register("strict", lambda *, order, ready, **_: StrictOrder(order, ready))
register("backfill", lambda *, order, ready, backfill, memory=None, w_bytes=None, **_:
         BackfillOrder(order, ready, backfill, memory, w_bytes))


@dataclass(frozen=True)
class Hint:
    """A resolved hint.

    Attributes:
        name: the hint's name as the user gave it, without ``strict-``.
        policy: the registered kind-ranking policy (:data:`KIND_POLICIES`) it runs in
            readiness mode (default: ``name`` when it names one); for a total order, None
            (readiness over the order, ``order``) or another registered policy that takes
            the order (``w-float``: :mod:`rrfp.scheduler.wfloat`).
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

    @property
    def kind_policy(self) -> KindPolicy | None:
        """The kind-ranking policy named by :attr:`policy` (or :attr:`name`), or None."""
        return KIND_POLICIES.get(self.policy or self.name)

    @property
    def is_policy(self) -> bool:
        return self.order is None

    @property
    def first(self) -> str:
        p = self.kind_policy
        return B if p is None else p.first

    @property
    def alternate(self) -> bool:
        p = self.kind_policy
        return True if p is None else p.alternate


def policy_name(hint: Hint, strict: bool, backfill: bool) -> str:
    """The registered policy a rank runs ``hint`` with.

    Raises:
        ValueError: strict mode without a total order, or a policy name nobody registered.
    """
    if strict and hint.order is None:
        raise ValueError(f"strict mode needs a total-order hint, got the policy {hint.name!r}")
    if backfill:
        return "backfill"
    if strict:
        return "strict"
    if hint.order is not None:
        # An order policy named by the hint (w-float...); a compiled kind policy's name is
        # only a label there.
        return hint.policy if hint.policy in POLICY_REGISTRY and hint.policy not in KIND_POLICIES else "order"
    name = hint.policy or hint.name
    if name not in POLICY_REGISTRY:
        raise ValueError(f"hint {hint.name!r}: no policy {name!r} (registered: {', '.join(POLICY_REGISTRY)})")
    return name


def build_policy(name: str, **context) -> Policy:
    """The registered policy ``name``, built for one rank's step from ``context`` (``order``,
    ``ready``, ``backfill``, ``memory``, ``w_bytes``: what its factory takes)."""
    return POLICY_REGISTRY[name](**context)
