"""The memory budget: activation bytes a rank may hold, counted per microbatch (rrfp issue 13).

The in-flight limit counts microbatches; a memory budget counts the bytes they hold, which
differ with sequence length and image count. Sizes come per ``(stage, microbatch)`` from a
function the caller supplies (the simulator's size model, or the runtime's estimate, corrected
by the measured size when the forward finishes).

Admission (one rank, virtual stages ``v = 0..V-1``): a forward on the rank's *first* virtual
stage admits a new microbatch. It reserves the bytes the microbatch will hold on every
virtual stage of the rank, ``need(m) = sum_v size(stage_v, m)``. It is admitted only when

    reserved == 0   or   reserved + need(m) <= budget

where ``reserved`` is what the admitted, unfinished microbatches hold or will hold. A stage's
input backward (``B`` or ``I``) releases that stage's bytes. No other task is ever gated.

**Bound.** With sizes known at admission, ``held <= reserved`` at all times, and ``reserved``
only grows at an admission, which either finds ``reserved == 0`` or stays within the budget.
So the bytes held never exceed ``max(budget, max_m need(m))``: the budget, unless one
microbatch alone is larger than it (then that microbatch runs alone). When the measured size
of a forward differs from its estimate, the reservation takes the measured size, and the bound
holds with measured sizes for every admission made after it.

**Deadlock freedom.** Suppose no task runs, no message is in transit and some task is
unfinished. Every started, unfinished microbatch has a next task on its dependency chain
``F_0..F_{S-1}, B_{S-1}..B_0`` whose input is there, so it is ready. Only first-virtual-stage
forwards are gated, and the arbiter dispatches any ready ungated task, so each such next task
is a gated admission on some rank ``r`` with ``reserved_r > 0``: rank ``r`` holds an admitted
microbatch whose next task is again a gated admission, on a rank whose first virtual stage is
a later stage. In the ``loop`` and ``v`` placements the first virtual stages are stages
``0..P-1`` on ranks ``0..P-1``, so this is a later rank, and the chain of ranks increases
forever: impossible. If no microbatch has started, rank 0 has ``reserved == 0`` and admits.
The count limit (``>= 1``) keeps its own rule and admits too when nothing is in flight, so
both gates together keep the argument. The property tests
(``tests/test_scheduler_memory.py``) check the bound and completion with random sizes and
delays for 1 and 2 virtual stages.

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
            raise ValueError(f"memory size {text!r}: expected a number of bytes with an optional unit, e.g. 64MiB, 1.5GB")
        x = float(m.group(1)) * _UNITS[unit]
        if not x <= MAX_BUDGET:  # also inf and nan: int() of them raises a traceback
            raise ValueError(f"memory size {text!r}: expected 1 byte to 2**62 bytes")
        n = int(x)
    if not 1 <= n <= MAX_BUDGET:
        raise ValueError(f"memory size {text!r}: expected 1 byte to 2**62 bytes")
    return n


def order_peak_bytes(order: Sequence[Task], size: SizeFn) -> int:
    """The most activation bytes a rank holds running ``order`` (its tasks in dispatch
    order): ``+size`` at each ``F``, ``-size`` at each ``B``/``I``. Timing does not change it:
    a rank's memory depends only on its own order. Used for the ``1f1b``/``gpipe`` budgets."""
    cur = peak = 0
    for s, k, m in order:
        if k == F:
            cur += size(s, m)
            if cur > peak:
                peak = cur
        elif k == B or k == I:
            cur -= size(s, m)
    return peak


class MemoryLedger:
    """One rank's activation bytes for one step: reservations by admission and bytes held.

    Args:
        stages: the rank's stages, first virtual stage first.
        size: expected bytes of ``F(stage, mb)``.
        budget: bytes the rank may reserve, or None to count without gating (strict mode,
            reporting only).

    Attributes:
        held, peak_held: bytes held now / at most (forward done, input backward not).
        reserved, peak_reserved: bytes reserved by admitted microbatches now / at most.
    """

    __slots__ = ("budget", "size", "stages", "held", "peak_held", "reserved", "peak_reserved", "_got", "_res")

    def __init__(self, stages: Sequence[int], size: SizeFn, budget: int | None) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"memory budget {budget!r}: expected an integer number of bytes >= 1")
        self.budget = budget
        self.size = size
        self.stages = tuple(stages)
        self.held = self.peak_held = self.reserved = self.peak_reserved = 0
        self._got: dict[tuple[int, int], int] = {}  # bytes held by (stage, mb)
        self._res: dict[tuple[int, int], int] = {}  # bytes reserved for (stage, mb)

    def need(self, mb: int) -> int | None:
        """Bytes microbatch ``mb`` will hold on every virtual stage of the rank (None: unknown)."""
        total = 0
        for s in self.stages:
            n = self.size(s, mb)
            if n is None:
                return None
            total += n
        return total

    def admits(self, mb: int) -> bool:
        """Whether admitting ``mb`` now keeps the budget (always when nothing is reserved)."""
        b = self.budget
        if b is None or self.reserved == 0:
            return True
        n = self.need(mb)
        return n is not None and self.reserved + n <= b

    def forward_done(self, stage: int, mb: int, nbytes: int | None = None) -> None:
        """``F(stage, mb)`` finished holding ``nbytes`` (None: the expected size). The first
        virtual stage's forward reserves the microbatch's bytes on every stage of the rank."""
        if stage == self.stages[0]:
            for s in self.stages:
                r = self.size(s, mb) or 0  # unknown: reserved when measured, below
                self._res[(s, mb)] = r
                self.reserved += r
        got = (self.size(stage, mb) or 0) if nbytes is None else nbytes
        self._got[(stage, mb)] = got
        self.held += got
        if self.held > self.peak_held:
            self.peak_held = self.held
        est = self._res.get((stage, mb), got)
        if got != est:  # a measured size replaces its estimate in the reservation
            self._res[(stage, mb)] = got
            self.reserved += got - est
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def backward_done(self, stage: int, mb: int) -> None:
        """The input backward of ``(stage, mb)`` finished: its bytes are free."""
        self.held -= self._got.pop((stage, mb), 0)
        self.reserved -= self._res.pop((stage, mb), 0)
