"""How the activations a rank holds slow its tasks: a factor on a task's CPU part by the number
of microbatches whose activations its rank holds when the task starts, read off recorded steps
(:func:`read_held`), applied by :meth:`rrfp.sim.calibration.Calibration.simulate`.

Why: on a CPU a rank that holds more activations runs its next tasks slower (the allocator hands
out fresh pages, the caches are colder). Measured on this project's 2-core machine
(``benchmarks`` setting ``compute2``, 2 ranks, a 4-layer GPT stage each): the last stage's
forward takes 4.6 ms with nothing held and 5.1-5.4 ms with one or more (+13-16%), the first
stage's grows from 4.6-4.8 ms with one held to 5.3-5.8 ms with five (issue 33). A schedule that
holds more (GPipe's order, a readiness hint at GPipe's memory) pays it; a model calibrated on a
strict 1F1B run, which holds at most ``P - s``, does not see it. On a GPU we expect factors
near 1 (the caching allocator keeps freed blocks); not measured, no GPU was lent.

Counting: a rank's held microbatches at a task's start are those ``(stage, microbatch)`` of
its stages whose forward started before and whose backward (``B``, or ``W`` with a split
backward: the last task that frees them) had not; a backward counts its own microbatch.

Reading: the same task (step, stage, kind, microbatch) ran in several rows of one run (each row
a schedule of the same batches, alternated in the same rounds), at different held counts: each
record's own seconds are its task's cost times its factor, both unknown, read in turn in logs
(:func:`read_held`). Factors are per rank, direction (forward, or any backward kind) and held
count, relative to the fewest held the records can tell apart; a held count with few records
pools with the next (:data:`MIN_SAMPLES`).

Pure module: no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..scheduler.tasks import B, F, W, Task, TaskRecord

MIN_SAMPLES = 8
"""The fewest records of one rank and direction that make a factor: held counts with fewer pool
with the next (:func:`read_held`)."""
ROUNDS = 40
"""How many times :func:`read_held` reads the factors and the tasks' costs in turn."""
TRIM = 3.0
"""A record further than this many scaled median absolute deviations from its group's median
is left out of the group's mean (:func:`read_held`)."""


@dataclass(frozen=True)
class Held:
    """Per rank, the factor on a task's CPU part by the microbatches its rank holds at its start
    (module docstring).

    Attributes:
        forward: per rank, the forward's factor at ``0, 1, 2, ...`` held (a count past the end
            takes the last).
        backward: per rank, a backward's (``B``, ``I`` or ``W``) at ``0, 1, 2, ...`` held (its
            own microbatch counted).

    Raises:
        ValueError: ranks that differ in number between the two, a rank without a factor, or a
            factor that is not a finite number above 0 (naming it).
    """

    forward: tuple[tuple[float, ...], ...]
    backward: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            per = getattr(self, name)
            if isinstance(per, (str, bytes)) or not isinstance(per, Sequence):
                raise ValueError(f"held {name}={per!r}: expected per rank a list of factors")
            ranks = []
            for r, fs in enumerate(per):
                if isinstance(fs, (str, bytes)) or not isinstance(fs, Sequence) or not fs:
                    raise ValueError(f"held {name}[{r}]={fs!r}: expected a non-empty list of factors")
                for f in fs:
                    if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0 < f < math.inf):
                        raise ValueError(f"held {name}[{r}] factor {f!r}: expected a finite number above 0")
                ranks.append(tuple(float(f) for f in fs))
            object.__setattr__(self, name, tuple(ranks))
        if len(self.forward) != len(self.backward):
            raise ValueError(f"held: {len(self.forward)} ranks of forward factors, {len(self.backward)} of backward")

    def factor(self, rank: int, kind: str, held: int) -> float:
        """The factor of a ``kind`` task on ``rank`` that starts with ``held`` microbatches held
        (1 for a rank past the table's)."""
        per = self.forward if kind == F else self.backward
        if rank >= len(per):
            return 1.0
        fs = per[rank]
        return fs[min(held, len(fs) - 1)]

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], source: str = "held") -> "Held":
        """Build from ``{"forward": [[...], ...], "backward": [[...], ...]}`` (the dataclass as
        JSON).

        Raises:
            ValueError: another shape or a bad factor, naming ``source``.
        """
        if not isinstance(d, Mapping) or set(d) != {"forward", "backward"}:
            raise ValueError(f"{source}: expected an object of backward and forward factors per rank, got {d!r:.80}")
        try:
            return cls(d["forward"], d["backward"])
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def _start(holding: set[tuple[int, int]], task: Task) -> int:
    """What a rank holding ``holding`` (``(stage, microbatch)``) holds as ``task`` starts (module
    docstring's count), and ``holding`` updated past it: a forward's microbatch is held from
    then on, a backward counts its own, and ``B`` or ``W`` frees it."""
    s, k, m = task
    if k == F:
        n = len(holding)
        holding.add((s, m))
        return n
    holding.add((s, m))  # a backward counts its own (a record whose forward another rank ran)
    n = len(holding)
    if k in (B, W):
        holding.discard((s, m))
    return n


def held_counts(records: Iterable[TaskRecord]) -> list[tuple[TaskRecord, int]]:
    """One rank's records of one step, in start order, each with the microbatches its rank
    held when it started (module docstring)."""
    holding: set[tuple[int, int]] = set()
    return [(r, _start(holding, r.task)) for r in sorted(records, key=lambda r: r.start)]


def _counted(records: Iterable[TaskRecord]) -> list[tuple[TaskRecord, int]]:
    """:func:`held_counts` of records of several ranks and steps, each rank's step apart."""
    by: dict[tuple[int, int], list[TaskRecord]] = {}
    for r in records:
        by.setdefault((r.step, r.rank), []).append(r)
    return [x for rs in by.values() for x in held_counts(rs)]


def read_held(rows: Mapping[str, Sequence[TaskRecord]], n_ranks: int, exclude: Iterable[str] = (),
              wait: Callable[[int, int, Task], float] | None = None) -> Held | None:
    """The factors read off the records of several rows of one run (module docstring):
    ``rows``, row -> its records (the same step ids across rows: the same batches), less the
    rows in ``exclude`` (a prediction of a row reads the others'); ``wait(step, rank, task)``:
    what a task waited for rather than computed (an injected sleep; None: nothing).

    Each record's own seconds are its task's cost times its factor; both are unknown, so they
    are read in turn (:data:`ROUNDS` times), least squares in logs: each task's log cost the
    mean over its records of their log seconds less their log factors, each factor the mean of
    its records' log seconds less their tasks' log costs (means without records beyond
    :data:`TRIM`). Without noise and with ``TRIM`` infinite this recovers the factors exactly;
    with the default trim, within 2% (``tests/test_sim_held.py``).

    Returns None where no task ran in two of the rows, or no rank has :data:`MIN_SAMPLES`.
    """
    skip = set(exclude)
    own: list[tuple[tuple[int, Task], int, str, int, float]] = []  # (task key, rank, direction, held, seconds)
    for row, recs in rows.items():
        if row in skip:
            continue
        for r, h in _counted(recs):
            d = r.end - r.start - (wait(r.step, r.rank, r.task) if wait else 0.0)
            if d > 0:
                own.append(((r.step, r.task), r.rank, F if r.task.kind == F else B, h, d))
    counts: dict[tuple[int, Task], set[int]] = {}
    for key, _, _, h, _ in own:
        counts.setdefault(key, set()).add(h)
    # A task that started at one held count in every row (in one row, or the first forwards of
    # every order) cannot tell its cost from that count's factor: it says nothing.
    own = [o for o in own if len(counts[o[0]]) >= 2]
    if not own:
        return None
    # Least squares in logs (a record's log seconds: its task's log cost plus its log factor),
    # read in turn: exact without noise, and one slow record moves a figure only by its share.
    factor: dict[tuple[int, str], tuple[float, ...]] = {}
    for _ in range(ROUNDS):
        ds: dict[tuple[int, Task], list[float]] = {}
        for key, rank, dr, h, d in own:
            fs = factor.get((rank, dr), (1.0,))
            ds.setdefault(key, []).append(math.log(d / fs[min(h, len(fs) - 1)]))
        cost = {key: math.exp(_robust_mean(v)) for key, v in ds.items()}
        ratios: dict[tuple[int, str], dict[int, list[float]]] = {}
        for key, rank, dr, h, d in own:
            ratios.setdefault((rank, dr), {}).setdefault(h, []).append(d / cost[key])
        factor = {k: _factors(by_h) for k, by_h in ratios.items()}
    tables = {dr: tuple(factor.get((rank, dr), (1.0,)) for rank in range(n_ranks)) for dr in (F, B)}
    if all(fs == (1.0,) for per in tables.values() for fs in per):
        return None
    return Held(tables[F], tables[B])


def _robust_mean(xs: Sequence[float]) -> float:
    """The mean of ``xs`` within :data:`TRIM` scaled median absolute deviations of their
    median (all of them where they deviate by none): a jitter spike does not move it."""
    mid = statistics.median(xs)
    mad = statistics.median(abs(x - mid) for x in xs) * 1.4826
    if mad <= 0:
        return statistics.fmean(xs)
    return statistics.fmean(x for x in xs if abs(x - mid) <= TRIM * mad)


def _factors(by_h: Mapping[int, list[float]]) -> tuple[float, ...]:
    """Factors by held count from ratios by held count: counts pooled upwards from the fewest
    until a pool has :data:`MIN_SAMPLES` (a short last pool joins the one before), each count
    its pool's mean in logs (:func:`_robust_mean`) over the first pool's; counts below the
    first take the first's; ``(1.0,)`` without a full pool."""
    pools: list[tuple[list[int], list[float]]] = []
    hs: list[int] = []
    vs: list[float] = []
    for h in sorted(by_h):
        hs.append(h)
        vs += by_h[h]
        if len(vs) >= MIN_SAMPLES:
            pools.append((hs, vs))
            hs, vs = [], []
    if not pools:
        return (1.0,)
    if hs:
        pools[-1] = (pools[-1][0] + hs, pools[-1][1] + vs)
    mean = [math.exp(_robust_mean([math.log(x) for x in v])) for _, v in pools]
    out: list[float] = []
    for (counts, _), m in zip(pools, mean):
        while len(out) <= max(counts):
            out.append(m / mean[0])
    return tuple(out)


def record_factors(records: Sequence[TaskRecord], held: Held) -> dict[tuple[int, int, Task], float]:
    """Per ``(step, rank, task)`` of ``records`` (several ranks and steps), its factor at what
    its rank held when it started."""
    return {(r.step, r.rank, r.task): held.factor(r.rank, r.task.kind, h) for r, h in _counted(records)}


def without_held(records: Sequence[TaskRecord], factors: Mapping[tuple[int, int, Task], float],
                 wait: Callable[[int, int, Task], float] | None = None) -> list[TaskRecord]:
    """``records`` (several ranks and steps) with each task's own part (its duration less
    ``wait``) divided by its factor (``factors``: :func:`record_factors`'): what it would have
    taken with nothing held, for costs measured in place
    (:func:`rrfp.sim.calibration.stage_costs`) that a simulation multiplies by the factors of
    its own schedule. In the records' order."""
    out = []
    for r in records:
        w = wait(r.step, r.rank, r.task) if wait else 0.0
        d = max(0.0, r.end - r.start - w) / factors[(r.step, r.rank, r.task)]
        out.append(TaskRecord(r.rank, r.step, r.task, r.start, r.start + w + d))
    return out


def held_tracker(held: Held) -> Callable[[int, int, Task], float]:
    """``factor(step, rank, task)`` for a simulation that asks once per task as it starts, in
    start order per rank (:func:`rrfp.sim.engine.simulate`'s duration calls): it counts what
    each rank holds itself. A task asked again (a second run over the same schedule) gets the
    factor it got first."""
    holding: dict[tuple[int, int], set[tuple[int, int]]] = {}
    seen: dict[tuple[int, int, Task], float] = {}

    def factor(step: int, rank: int, t: Task) -> float:
        key = (step, rank, t)
        f = seen.get(key)
        if f is not None:
            return f
        f = seen[key] = held.factor(rank, t.kind, _start(holding.setdefault((step, rank), set()), t))
        return f

    return factor
