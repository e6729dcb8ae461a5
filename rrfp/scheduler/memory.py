"""The memory budget: activation bytes a rank may hold, counted per microbatch (RRFP §4.3,
App. C).

The in-flight limit counts microbatches; a memory budget counts the bytes they hold, which
differ with sequence length and image count. Sizes come per ``(stage, microbatch)`` from a
function the caller supplies (the simulator's size model, or the runtime's estimate, corrected
by the measured size when the forward finishes).

State (one rank, virtual stages ``v = 0..V-1``): a forward on the rank's *first* virtual
stage admits a microbatch; it is *in flight* until its input backward (``B`` or ``I``) on that
stage, and each input backward frees its stage's bytes. An in-flight microbatch ``m`` holds
``h(m)`` bytes now and will still take ``a(m)`` (the sizes of its forwards on the rank not run
yet). ``free = budget - held``. The state is **safe** when the in-flight microbatches, oldest
first (``m_1, m_2, ...``, in admission order), can each take what they still need from what
the older ones free once they finish (the banker's algorithm, Dijkstra 1965)::

    a(m_i) <= free + h(m_1) + ... + h(m_{i-1})      for every i

**Split backward.** ``I`` frees what the forward saved except what ``W`` reads (each split
layer's input and output gradient: ``w_bytes(stage, mb)``, measured in the runtime, a per-stage
figure from the trace profile in the simulator), and ``W`` frees the rest
(:meth:`MemoryLedger.input_backward_done`). When that figure is unknown everything stays held
until ``W`` (the conservative rule). A microbatch stays in flight until its last
backward task on the rank's first virtual stage (``B``, or ``W`` when split).

**The rule** (:meth:`MemoryLedger.grants`; only forwards are gated, never B, I or W):

- ``F`` on a later virtual stage of an in-flight microbatch runs if that microbatch is the
  oldest in flight, or if the state after it is safe.
- ``F`` on the first virtual stage (an admission) runs if nothing is in flight, or if the state
  after it is safe *and* the in-flight microbatches' held and still-needed bytes, the new one's
  included, stay within :data:`ADMISSION_OVERCOMMIT` times the budget. With several virtual
  stages a rank admits microbatches in microbatch order (``0, 1, 2, ...``).

Reserving every virtual stage's bytes at admission (the overcommit at 1.0) would also be safe,
but a microbatch holds its later stages' bytes only for the last part of its time on the rank,
so that reservation left a fifth to a third of the budget unused (measured on the suite). The banker's
check alone admits as long as any completion order exists, and then younger microbatches wait
at their later stages for the oldest: the overcommit bound between the two is measured on the
suite (``docs/suite.md``).

**Bound.** A grant other than the two exceptions leaves the state safe, and safe implies
``held <= budget`` (``a(m_1) >= 0``). The oldest's forward keeps a safe state safe (its own
inequality loses the forward's bytes on both sides; the others are unchanged), and a finishing
task only frees bytes. So the state is unsafe only after a microbatch was admitted alone whose
bytes exceed the budget; until it leaves, no other forward is granted (``free`` is short of
any size). The bytes held never exceed ``max(budget, max_m need(m))`` with ``need(m)`` the
microbatch's bytes on every virtual stage of the rank. When a measured size differs from its
estimate the check uses the measured one from then on, and the bound holds with measured sizes.

**Deadlock freedom.** Suppose no task runs, no message is in transit and some task is
unfinished. Every started, unfinished microbatch has a next task on its dependency chain
``F_0..F_{S-1}, B_{S-1}..B_0`` whose input is there, so it is ready; ``W`` and backwards are
never gated, and the arbiter dispatches a ready task whenever one is granted, so each such next
task is a refused forward.

- One stage per rank: every refused forward is an admission on a rank ``r`` with a microbatch
  in flight, whose next task is again a refused admission on a later rank (its next stage);
  the chain of ranks increases forever: impossible. (If no microbatch has started, rank 0 has
  nothing in flight and admits.)
- Several virtual stages: let ``m*`` be the lowest microbatch with an unfinished task; every
  lower one is finished on every rank. Its next task is a forward on some rank ``r``. If it is
  an admission, rank ``r`` admits in order, so it has admitted nothing above ``m*`` and nothing
  below is in flight: nothing is in flight, and it admits. Otherwise ``m*`` is in flight on
  ``r`` and, admitted in order, is the oldest there, and the oldest's forward is granted.
  Either way the forward runs: a contradiction.

The count limit (``>= 1``) keeps its own rule and admits too when nothing is in flight, so
both gates together keep the argument. The property tests (``tests/test_scheduler_memory.py``)
check the bound and completion with random sizes and delays for 1 and 2 virtual stages.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from .tasks import B, F, I, Task

SizeFn = Callable[[int, int], "int | None"]
"""``size(stage, microbatch) -> bytes`` that ``F(stage, microbatch)`` leaves held until its
input backward; None when not known yet (the runtime before it measured the stage once): a
microbatch with an unknown size is admitted only when nothing is reserved."""

BUDGET_NAMES = ("1f1b", "gpipe")
"""Budget names: what that schedule would hold on the rank (:func:`order_peak_bytes`)."""

ADMISSION_OVERCOMMIT = 1.5
"""How far admissions may reserve beyond the budget: held bytes plus every in-flight
microbatch's remaining forwards, the new one's included, stay within this many budgets (the
banker's check keeps what is actually held within one). Measured on the suite at 1F1B's memory
(``bfw-alt-df``, 2 virtual stages, 4-16 ranks, every scenario), mean speedup
over strict interleaved 1F1B at 1.0 / 1.25 / 1.5 / 1.75 / 2.0: 1.054x / 1.087x / 1.089x /
1.074x / 1.026x. At 1.0 (every virtual stage reserved at admission) a
fifth to a third of the budget stays unused; from 2.0 on the bound never binds and the
banker's check alone lets younger microbatches wait at their later stages for the oldest
(worst point 0.797x)."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")
MAX_BUDGET = 2**62


def parse_size(text: str | int) -> int:
    """Bytes from ``"64MiB"``, ``"1.5GB"``, ``"4096"`` (or an int). Units: B, kB/MB/GB/TB
    (powers of 10), KiB/MiB/GiB/TiB (powers of 2), case-insensitive.

    Raises:
        ValueError: one line naming the text and the expected form, or a size < 1 byte.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            what = "a positive size" if str(text).strip().startswith("-") else "a number of bytes"
            raise ValueError(f"memory size {text!r}: expected {what} with an optional unit, e.g. 64MiB, 1.5GB")
        x = float(m.group(1)) * _UNITS[unit]
        if not x <= MAX_BUDGET:  # also inf and nan: int() of them raises a traceback
            raise ValueError(f"memory size {text!r}: expected 1 byte to 2**62 bytes")
        n = int(x)
    if not 1 <= n <= MAX_BUDGET:
        raise ValueError(f"memory size {text!r}: expected 1 byte to 2**62 bytes")
    return n


def order_peak_bytes(order: Sequence[Task], size: SizeFn, w_size: SizeFn | None = None) -> int:
    """The most activation bytes a rank holds running ``order`` (its tasks in dispatch
    order): ``+size`` at each ``F``, ``-size`` at each ``B``/``I``. Timing does not change it:
    a rank's memory depends only on its own order. Used for the ``1f1b``/``gpipe`` budgets.

    With ``w_size`` (bytes ``W(stage, mb)`` reads; None from it: unknown), the split backward
    follows the ledger's rule instead: ``I`` frees all but ``w_size`` (all of it kept when
    unknown), ``W`` frees the rest (:meth:`MemoryLedger.input_backward_done`)."""
    return max(order_bytes(order, size, w_size), default=0)


def order_bytes(order: Sequence[Task], size: SizeFn, w_size: SizeFn | None = None) -> list[int]:
    """Bytes held after each task of ``order`` (``out[k]``: after ``order[k]``), by the rule
    of :func:`order_peak_bytes`. Unknown sizes (None) count as 0."""
    cur = 0
    out = []
    kept: dict[tuple[int, int], int] = {}
    for s, k, m in order:
        if k == F:
            cur += size(s, m) or 0
        elif k == B:
            cur -= size(s, m) or 0
        elif k == I:
            n = size(s, m) or 0
            if w_size is None:
                cur -= n
            else:
                w = w_size(s, m)
                keep = n if w is None else min(max(int(w), 0), n)
                kept[(s, m)] = keep
                cur -= n - keep
        else:
            cur -= kept.pop((s, m), 0)
        out.append(cur)
    return out


class MemoryLedger:
    """One rank's activation bytes for one step, and the banker's check that grants forwards
    (the rule and its proofs: the module docstring).

    Args:
        stages: the rank's stages, first virtual stage first.
        size: expected bytes of ``F(stage, mb)``.
        budget: bytes the rank may hold, or None to count without gating (strict mode,
            reporting only).

    Attributes:
        held, peak_held: bytes held now / at most (forward done, its backward not: B, or W
            when the backward is split, since W reads what F saved).
        reserved, peak_reserved: bytes held plus what the admitted microbatches' remaining
            forwards on the rank will hold, now / at most (what a rank reserving every virtual
            stage at admission would have to set aside).
        n_admitted: microbatches admitted so far this step (admission is in microbatch order,
            so the next one to admit is this number).
        peak_one: the most bytes one microbatch held on the rank at once (what a budget below
            it still lets the oldest microbatch hold: :func:`over_budget`).
    """

    __slots__ = ("budget", "size", "stages", "held", "peak_held", "reserved", "peak_reserved", "n_admitted",
                 "peak_one", "_got", "_res", "_hold", "_left")

    def __init__(self, stages: Sequence[int], size: SizeFn, budget: int | None) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"memory budget {budget!r}: expected an integer number of bytes >= 1")
        self.budget = budget
        self.size = size
        self.stages = tuple(stages)
        self.held = self.peak_held = self.reserved = self.peak_reserved = self.n_admitted = self.peak_one = 0
        self._got: dict[tuple[int, int], int] = {}  # bytes held by (stage, mb)
        self._res: dict[tuple[int, int], int] = {}  # bytes reserved for (stage, mb)
        # In-flight microbatches in admission (= microbatch) order: bytes held, and the stages
        # of the rank whose forward has not finished yet (what the microbatch still needs).
        self._hold: dict[int, int] = {}
        self._left: dict[int, list[int]] = {}

    def need(self, mb: int) -> int | None:
        """Bytes microbatch ``mb`` will hold on every virtual stage of the rank (None: unknown)."""
        total = 0
        for s in self.stages:
            n = self.size(s, mb)
            if n is None:
                return None
            total += n
        return total

    def in_flight(self):
        """The in-flight microbatches, oldest (first admitted) first."""
        return self._hold.keys()

    def admits(self, mb: int) -> bool:
        """Whether ``mb`` may be admitted now (its forward on the first virtual stage run):
        :meth:`grants` for that forward."""
        return self.grants(self.stages[0], mb)

    def grants(self, stage: int, mb: int) -> bool:
        """Whether ``F(stage, mb)`` may run now: the banker's check of the module docstring.
        An admission must be the next microbatch in order and is granted when nothing is in
        flight; a later virtual stage's forward is granted to the oldest microbatch in flight;
        otherwise the state after the forward must be safe. Always True without a budget."""
        b = self.budget
        if b is None:
            return True
        hold = self._hold
        if stage == self.stages[0]:
            if len(self.stages) > 1 and mb != self.n_admitted:
                return False
            if not hold:
                return True
            rest = self.stages[1:]
            # Overcommit bound: held plus every in-flight microbatch's remaining forwards.
            size, left = self.size, self._left
            total = self.held
            for m in hold:
                for s in left[m]:
                    n = size(s, m)
                    if n is None:
                        return False
                    total += n
            need = self.need(mb)
            if need is None or total + need > ADMISSION_OVERCOMMIT * b:
                return False
        else:
            if mb not in hold:
                return False  # not admitted here: cannot happen in a correct pipeline
            if next(iter(hold)) == mb:
                return True
            rest = None
        x = self.size(stage, mb)
        if x is None:
            return False
        # Safe: the in-flight microbatches, oldest first, can each take what it still needs
        # from what is free once the older ones have finished and freed theirs.
        size = self.size
        avail = b - self.held - x
        if avail < 0:
            return False
        for m, h in hold.items():
            need = 0
            for s in self._left[m]:
                if m == mb and s == stage:
                    continue
                n = size(s, m)
                if n is None:
                    return False
                need += n
            if need > avail:
                return False
            avail += h + (x if m == mb else 0)
        if rest is not None:  # the admitted microbatch is the youngest
            need = 0
            for s in rest:
                n = size(s, mb)
                if n is None:
                    return False
                need += n
            if need > avail:
                return False
        return True

    def forward_done(self, stage: int, mb: int, nbytes: int | None = None) -> None:
        """``F(stage, mb)`` finished holding ``nbytes`` (None: the expected size). The first
        virtual stage's forward admits the microbatch."""
        if stage == self.stages[0]:
            self.n_admitted += 1
            self._hold[mb] = 0
            self._left[mb] = list(self.stages)
            for s in self.stages:
                r = self.size(s, mb) or 0  # unknown: reserved when measured, below
                self._res[(s, mb)] = r
                self.reserved += r
        got = (self.size(stage, mb) or 0) if nbytes is None else nbytes
        self._got[(stage, mb)] = got
        self.held += got
        if self.held > self.peak_held:
            self.peak_held = self.held
        if mb in self._hold:
            self._hold[mb] += got
            if self._hold[mb] > self.peak_one:
                self.peak_one = self._hold[mb]
            self._left[mb].remove(stage)
        est = self._res.get((stage, mb), got)
        if got != est:  # a measured size replaces its estimate in the reservation
            self._res[(stage, mb)] = got
            self.reserved += got - est
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def input_backward_done(self, stage: int, mb: int, keep: int | None) -> None:
        """The split backward's ``I`` of ``(stage, mb)`` finished and its ``W`` still reads
        ``keep`` bytes (each split layer's input and output gradient): the rest of what the
        forward saved is free now. ``keep=None`` (unknown) frees nothing until ``W``, the
        conservative rule. ``keep`` is capped at what the forward holds, so an ``I`` never
        raises the bytes held and the bound of the module docstring is unchanged."""
        if keep is None:
            return
        key = (stage, mb)
        got = self._got.get(key)
        if got is None:
            return
        keep = min(max(int(keep), 0), got)
        freed = got - keep
        if not freed:
            return
        self._got[key] = keep
        self.held -= freed
        if key in self._res:
            self._res[key] -= freed
            self.reserved -= freed
        if mb in self._hold:
            self._hold[mb] -= freed

    def backward_done(self, stage: int, mb: int) -> None:
        """The backward of ``(stage, mb)`` finished (B, or W when split): its bytes are free; the microbatch
        leaves the rank with its first virtual stage's."""
        got = self._got.pop((stage, mb), 0)
        self.held -= got
        self.reserved -= self._res.pop((stage, mb), 0)
        if mb in self._hold:
            self._hold[mb] -= got
            if stage == self.stages[0]:
                del self._hold[mb]
                del self._left[mb]


def over_budget(peak: int, one: int, budget: int | None) -> bool:
    """Whether a rank that held at most ``peak`` bytes, at most ``one`` of them for a single
    microbatch, broke ``budget`` (None: no budget): it held more than the budget and more than
    one microbatch alone (the budget's rule always lets the oldest microbatch run, however
    large). A strict order ignores the budget (it cannot wait for bytes), so its run can."""
    return budget is not None and peak > budget and peak > one


def overrun_line(hint: str, budget: int, step: int, over: Sequence[tuple[int, int, int]]) -> str:
    """The one line that says a step broke the memory budget: ``over`` is ``(rank, bytes held,
    microbatches in flight)`` of each rank that did (:func:`over_budget`), ``step`` 1-based."""
    held = ", ".join(f"rank {r} held {mib(b)} ({n} microbatch{'es' if n != 1 else ''})" for r, b, n in over)
    return (f"hint {hint} broke the memory budget {mib(budget)} in step {step}: {held}; it runs its order's "
            f"forwards whatever the budget (a strict order cannot wait for bytes); bf, bfw-mem, auto or the "
            f"order as a hint (without strict-) hold to it (said once)")


def mib(n: int | float) -> str:
    """``n`` bytes as ``"8.07 MiB"`` (``"4096 bytes"`` below 1 MiB), for one-line messages."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{int(n)} bytes"


def budget_bytes(memory_budget: int | str | None) -> int | None:
    """A memory budget in bytes (None: none), from ``Pipeline(memory_budget=...)`` or
    ``rrfp train --memory-budget``.

    Raises:
        ValueError: a bad size, or a schedule name (the runtime learns sizes as it runs, so
            it cannot know ahead what a schedule would hold; ``rrfp simulate`` can).
    """
    if memory_budget is None:
        return None
    if memory_budget in BUDGET_NAMES:
        raise ValueError(f"memory budget {memory_budget!r}: the runtime takes a size in bytes (e.g. 64MiB); "
                         "schedule names need sizes known ahead (rrfp simulate --memory-budget)")
    return parse_size(memory_budget)
