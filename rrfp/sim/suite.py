"""The scenario suite (``rrfp simulate --suite``): every hint against the placement's fixed-order
baseline, at 1F1B's memory and unlimited, over the variability the paper's workloads show.

Scenarios (:data:`SCENARIOS`), each on 4, 8, 16 and 32 ranks, with one stage per rank, 2 virtual
stages ``loop`` and 2 virtual stages ``v`` (:data:`LAYOUTS`), ``M = 4 x ranks`` microbatches,
``F = 10 ms``, ``B = 20 ms`` (``I = W = 10 ms`` split), 1 MiB of activations per stage and
microbatch (scaled by sequence length and, on the encoder stage, image count):

- ``J0``..``J3``: the paper's injected compute jitter (RRFP §7).
- ``comm-J2``: messages take 2 ms plus J2's injected delays; compute is steady.
- ``seqlen``: each microbatch's length ratio ~ lognormal(0.4): time and bytes scale with it.
- ``multimodal``: 4 samples per microbatch, each 0-6 images (uniform); the first stage is
  the image encoder, whose time and bytes follow the microbatch's image count.
- ``straggler``: the middle rank runs 1.5x slower.
- ``slow-link``: messages take 2 ms, and the link between the two middle ranks is
  :data:`SLOW_LINK` times slower, all step long.

Random scenarios run under each of :data:`SEEDS`; the others (:data:`STEADY`) draw nothing, so
they run once. Message delays are keyed by the message alone (:mod:`rrfp.sim.duration`), and a
split backward shares the full backward's injected draw (:mod:`rrfp.sim.jitter`): every hint
meets the same workload.

Memory: ``1f1b`` gives each rank a budget of the bytes the baseline (strict 1F1B, strict
interleaved 1F1B, strict ZB-V) holds on it with the same sizes
(:meth:`~rrfp.sim.compare.SimConfig.memory_budgets`); ``unlimited`` gives no budget and an
in-flight limit of ``M``.

Two ceilings per point: the *ideal*, the baseline over the memory-blind lower bound
(:func:`rrfp.sim.metrics.lower_bound`), and the *ceiling*, the baseline over the memory-aware
bound (the larger of that and :func:`rrfp.sim.metrics.memory_bound`), each the smallest over
the point's runs so that it holds for every hint run there.

``auto`` (:mod:`rrfp.sim.auto`) is judged as it runs (:func:`rrfp.sim.auto.simulate_auto`): it
ranks its candidates on a profile measured under its own seed, then runs its trial (the strict
schedule and the best two, :data:`~rrfp.sim.trial.TRIAL_ROUNDS` rounds of one simulated step
each, every step under a seed of its own) and keeps by :func:`rrfp.sim.trial.keep`. Neither step
sees the draws it is judged on; the choice is made once per point and its makespan at each seed
is that of the candidate it kept.

Pure module: no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..scheduler.hints import DEFAULT_HINT
from ..scheduler.tasks import PipelineSpec
from . import auto, trial
from .compare import SimConfig, compare, default_baseline
from .costs import CostModel
from .duration import Dist
from .jitter import parse_jitter
from .metrics import memory_bound

MIB = 2**20
SLOW_LINK = 8.0
"""How many times slower the ``slow-link`` scenario's slow link is than the others."""

SCENARIOS: dict[str, dict[str, Any]] = {
    "J0": {},
    "J1": {"jitter": parse_jitter("J1")},
    "J2": {"jitter": parse_jitter("J2")},
    "J3": {"jitter": parse_jitter("J3")},
    "comm-J2": {"latency": 0.002, "comm_jitter": parse_jitter("J2")},
    "seqlen": {"seqlen": Dist.parse("lognormal:0.4")},
    "multimodal": {"images": Dist.parse("randint:0,6"), "samples_per_microbatch": 4, "encoder_stages": 1},
    "straggler": {"stragglers": "middle"},
    "slow-link": {"latency": 0.002, "slow_links": "middle"},
}
"""Scenario name -> :class:`~rrfp.sim.compare.SimConfig` fields (``"middle"``: the middle
rank, ``ranks // 2``, at 1.5x; the link between ranks ``ranks // 2 - 1`` and ``ranks // 2``
at :data:`SLOW_LINK`)."""

VARIABLE = tuple(s for s in SCENARIOS if s != "J0")
"""Scenarios with variability (the median targets are over these)."""

STEADY = ("J0", "straggler", "slow-link")
"""Scenarios that draw nothing: one seed is every seed."""

RANKS = (4, 8, 16, 32)
LAYOUTS = ((1, "loop"), (2, "loop"), (2, "v"))
"""(virtual stages, placement) of the suite's points."""
VIRTUAL = (1, 2)
MEMORIES = ("1f1b", "unlimited")
SEEDS = (0, 1, 2)


@dataclass
class SuiteRow:
    """One point of the suite under one seed: makespans (s), memory-blind and memory-aware lower
    bounds (s) and peak bytes per rank, per hint (the baseline included), and what ``auto``
    chose there (None when it did not run)."""

    scenario: str
    n_ranks: int
    n_virtual: int
    memory: str
    baseline: str
    placement: str = "loop"
    seed: int = 0
    makespan: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    mem_bound: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    auto_choice: str | None = None
    candidates: tuple[str, ...] = ()

    def speedup(self, hint: str) -> float:
        return self.makespan[self.baseline] / self.makespan[hint]

    @property
    def layout(self) -> str:
        return f"{self.n_virtual}{'' if self.n_virtual == 1 else ' ' + self.placement}"

    @property
    def ideal(self) -> float:
        """The baseline over the smallest memory-blind bound of the point's runs."""
        return self.makespan[self.baseline] / min(self.bound.values())

    @property
    def ceiling(self) -> float:
        """The baseline over the smallest memory-aware bound of the point's runs (each run's
        bound is the larger of its memory-blind and memory bounds)."""
        return self.makespan[self.baseline] / min(max(b, self.mem_bound.get(h, 0.0)) for h, b in self.bound.items())


def suite_config(scenario: str, n_ranks: int, n_virtual: int, memory: str, seed: int = 0,
                 placement: str = "loop") -> SimConfig:
    """The :class:`SimConfig` of one suite point.

    Raises:
        KeyError: an unknown scenario; ValueError: an unknown memory setting.
    """
    over = dict(SCENARIOS[scenario])
    if over.get("stragglers") == "middle":
        over["stragglers"] = {n_ranks // 2: 1.5}
    if over.get("slow_links") == "middle":
        over["slow_links"] = {(n_ranks // 2 - 1, n_ranks // 2): SLOW_LINK}
    m = 4 * n_ranks
    if memory not in MEMORIES:
        raise ValueError(f"suite memory {memory!r}: expected one of {', '.join(MEMORIES)}")
    costs = CostModel.uniform(1, 0.010, 0.020, act_bytes=MIB)
    return SimConfig(n_ranks=n_ranks, n_microbatches=m, n_virtual=n_virtual, placement=placement, limit=m,
                     costs=costs, seed=seed, memory_budget="1f1b" if memory == "1f1b" else None, **over)


def _point(cfg: SimConfig, hints: Sequence[str], base: str, row: SuiteRow) -> None:
    budgets = cfg.memory_budgets()
    if budgets is not None:  # resolved once: each run would compile and measure the baseline again
        cfg = replace(cfg, memory_budget=budgets)
    sizes = cfg.duration_model().act_bytes
    comm = cfg.comm_model()
    delay = None if comm.is_zero else comm
    place = cfg.make_placement()

    def on_result(name: str, summary: Any, res: Any) -> None:
        if budgets is not None:
            spec = PipelineSpec(place, cfg.n_microbatches, summary.extra["split_backward"])
            row.mem_bound[name] = memory_bound(spec, res.records, budgets, sizes, delay=delay)
        res.records.clear()  # the bounds are taken; a 32-rank point's records are large

    for r in compare(cfg, list(hints), base, on_result=on_result):
        row.makespan[r.hint] = r.makespan
        row.bound[r.hint] = r.lower_bound
        row.peak_bytes[r.hint] = max(r.peak_memory_rank)


def run_suite(
    hints: Sequence[str],
    *,
    scenarios: Sequence[str] = tuple(SCENARIOS),
    ranks: Sequence[int] = RANKS,
    layouts: Sequence[tuple[int, str]] = LAYOUTS,
    memories: Sequence[str] = MEMORIES,
    seeds: Sequence[int] = SEEDS,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> list[SuiteRow]:
    """Run every hint on every suite point (with the point's baseline added). ``auto`` among
    the hints adds its known candidates and is filled from the one it chose.

    Args:
        jobs: worker processes, one (scenario, ranks) group each at a time; the rows and
            every figure are the same for any count.

    Raises:
        KeyError / ValueError: an unknown scenario or memory; ValueError or DeadlockError
            from a hint that does not fit (named).
    """
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from functools import partial

        from .._pdeathsig import die_with_parent

        groups = [(sc, p) for sc in scenarios for p in ranks]
        # Workers die with this process: a killed suite leaves no simulations running.
        with ProcessPoolExecutor(jobs, initializer=partial(die_with_parent, launched_only=False)) as ex:
            # Deepest pipelines first: they take longest, so the workers finish together.
            futs = {g: ex.submit(run_suite, hints, scenarios=[g[0]], ranks=[g[1]], layouts=layouts,
                                 memories=memories, seeds=seeds) for g in sorted(groups, key=lambda g: -g[1])}
            if progress:  # as they finish (the deepest first), not in the rows' order
                done = {f: g for g, f in futs.items()}
                for i, f in enumerate(as_completed(done), 1):
                    f.result()
                    progress(f"{done[f][0]} ranks={done[f][1]}: done ({i} of {len(groups)})")
            return [row for g in groups for row in futs[g].result()]
    rows = []
    want_auto = auto.AUTO in hints
    plain = [h for h in hints if h != auto.AUTO]
    for sc in scenarios:
        for p in ranks:
            for v, pl in layouts:
                for mem in memories:
                    cfg0 = suite_config(sc, p, v, mem, seeds[0], pl)
                    base = default_baseline(v, pl) or "strict-1f1b"
                    names, choice, cands = list(plain), None, ()
                    if want_auto:
                        run = auto.simulate_auto(cfg0)
                        choice, cands = run.chosen, tuple(h for h, _ in run.ranking.order)
                        names = list(dict.fromkeys(names + list(cands)))
                    for seed in (seeds[:1] if sc in STEADY else seeds):
                        cfg = suite_config(sc, p, v, mem, seed, pl)
                        row = SuiteRow(sc, p, v, mem, base, pl, seed, auto_choice=choice, candidates=cands)
                        _point(cfg, names, base, row)
                        if choice is not None:
                            row.makespan[auto.AUTO] = row.makespan[choice]
                            row.bound[auto.AUTO] = row.bound[choice]
                            row.peak_bytes[auto.AUTO] = row.peak_bytes[choice]
                            if choice in row.mem_bound:
                                row.mem_bound[auto.AUTO] = row.mem_bound[choice]
                        rows.append(row)
                    if progress:
                        progress(f"{sc} ranks={p} V={v} {pl} memory={mem}: done"
                                 + (f" (auto: {choice})" if choice else ""))
    return rows


def _hints_of(rows: Sequence[SuiteRow], hints: Sequence[str]) -> list[str]:
    """The hints shown: the given ones, then auto's candidates that ran (in the rows' order)."""
    out = list(hints)
    for r in rows:
        out += [c for c in r.candidates if c != r.baseline]
    return list(dict.fromkeys(out))


def suite_table(rows: Sequence[SuiteRow], hints: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: one row per point and seed; the baseline's makespan and peak MiB, the
    ideal and the memory-aware ceiling, then per hint its speedup over the baseline, then what
    ``auto`` chose, and the first hint's makespan over its point's memory-aware bound."""
    shown = _hints_of(rows, hints)
    header = ["scenario", "ranks", "V", "memory", "seed", "baseline (s)", "baseline MiB", "ideal", "ceiling"]
    header += shown + ["auto chose", f"{hints[0]}/bound"]
    cells = []
    for r in rows:
        bound = r.makespan[r.baseline] / r.ceiling
        row = [r.scenario, str(r.n_ranks), r.layout, r.memory, str(r.seed), f"{r.makespan[r.baseline]:.3f}",
               f"{r.peak_bytes[r.baseline] / MIB:.1f}", f"{r.ideal:.3f}x", f"{r.ceiling:.3f}x"]
        row += [f"{r.speedup(h):.3f}x" if h in r.makespan else "-" for h in shown]
        row += [r.auto_choice or "-", f"{r.makespan[hints[0]] / bound:.3f}" if hints[0] in r.makespan else "-"]
        cells.append(row)
    return header, cells


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def variable_median(rows: Sequence[SuiteRow], hint: str) -> float:
    """``hint``'s median speedup at 1F1B's memory over the scenarios with variability
    (:data:`VARIABLE`), every seed (nan without such points)."""
    return _median([r.speedup(hint) for r in rows if r.memory == "1f1b" and r.scenario in VARIABLE])


def auto_within(rows: Sequence[SuiteRow], tolerance: float = 0.02) -> tuple[int, int]:
    """``(hits, points)``: at how many points (every memory and seed) ``auto``'s makespan is
    within ``tolerance`` of the best of its candidates there."""
    pts = [r for r in rows if r.auto_choice is not None]
    hits = sum(1 for r in pts if r.makespan[auto.AUTO] <= (1 + tolerance) * min(r.makespan[c] for c in r.candidates))
    return hits, len(pts)


WITHIN = 0.95
"""``auto`` within 2% of the best of its candidates at this share of points or more."""

ORACLE = "python -m benchmarks.oracle"
"""The exact optimiser that judges the targets against the optimum (OR-Tools, optional)."""


def suite_targets(rows: Sequence[SuiteRow], hint: str) -> list[tuple[str, str, bool | None]]:
    """The simulator's targets for ``hint``: (target, figure, met), ``met`` None where the
    target is judged elsewhere (against the optimum, by :data:`ORACLE` on the 4-rank points;
    the figure here is the speedup it stands for, with the suite's bounds beside it).

    The targets, restated against what is achievable (issue 33): the memory-aware ceiling is
    a bound that no schedule is shown to reach (the best schedules an exact optimiser found on
    the 4-rank points stay well below it), so "median >= 1.10x" and "V=1 median >= 0.95 of the
    ceiling" gave way to fractions of the optimum: ``auto`` at least 0.98 of it at the median
    over the points with variability and at least 0.95 at every point; and ``auto`` within 2%
    of the best of its candidates at :data:`WITHIN` of the points (was 90%)."""
    eq = [r for r in rows if r.memory == "1f1b"]
    var = [r for r in eq if r.scenario in VARIABLE]
    worst_row = min(eq, key=lambda r: r.speedup(hint), default=None)
    worst = worst_row.speedup(hint) if worst_row else math.nan
    where = (f" ({worst_row.scenario}, {worst_row.n_ranks} ranks, V={worst_row.layout}, seed {worst_row.seed}; "
             f"ceiling there {worst_row.ceiling:.3f}x)") if worst_row else ""
    med = variable_median(rows, hint)
    med_ceil = _median([r.ceiling for r in var])
    med_ideal = _median([r.ideal for r in var])
    unl = [r.makespan[hint] / min(r.bound.values()) for r in rows if r.memory == "unlimited"]
    med_b = _median(unl)
    out: list[tuple[str, str, bool | None]] = [
        (f"{hint} at 1F1B's memory never below 1.00x the baseline, every seed",
         f"min {worst:.3f}x{where}; min ceiling {min((r.ceiling for r in eq), default=math.nan):.3f}x", worst >= 1.0),
        (f"{hint} at 1F1B's memory, at least 0.98 of the optimum, median over scenarios with variability "
         f"(judged by `{ORACLE}`)",
         f"median speedup {med:.3f}x (memory-aware ceiling: median {med_ceil:.3f}x; memory-blind ideal "
         f"{med_ideal:.3f}x)", None),
        (f"{hint} at 1F1B's memory, at least 0.95 of the optimum at every point (judged by `{ORACLE}`)",
         f"min speedup {worst:.3f}x", None),
        (f"{hint} unlimited, median makespan within 1.05x of the lower bound",
         f"median {med_b:.3f}x (ceiling 1.000x)", med_b <= 1.05),
    ]
    if hint == auto.AUTO:
        hits, n = auto_within(rows)
        out.append((f"auto within 2% of the best candidate at >= {100 * WITHIN:.0f}% of points",
                    f"{hits} of {n} points ({100 * hits / n if n else math.nan:.1f}%)", n > 0 and hits >= WITHIN * n))
    return out


def verdict(ok: bool | None) -> str:
    """A target's verdict cell: met, **missed**, or where it is judged."""
    return f"- (`{ORACLE}`)" if ok is None else "met" if ok else "**missed**"


def judged_hints(hints: Sequence[str]) -> list[str]:
    """The hints the targets table judges: the first (``auto`` by default, ``rrfp train``'s
    default) and :data:`rrfp.scheduler.hints.DEFAULT_HINT` (the library's) when it ran."""
    return list(dict.fromkeys([hints[0]] + ([DEFAULT_HINT] if DEFAULT_HINT in hints else [])))


def median_speedups(rows: Sequence[SuiteRow], hints: Sequence[str]) -> list[list[str]]:
    """Per hint and memory: min and median speedup over all points and seeds, with the
    ceiling's min and median over the same points beside them."""
    out = []
    for h in _hints_of(rows, hints):
        for mem in MEMORIES:
            pts = [r for r in rows if r.memory == mem and h in r.makespan]
            if pts:
                sp, ce = [r.speedup(h) for r in pts], [r.ceiling for r in pts]
                out.append([h, mem, f"{min(sp):.3f}x", f"{statistics.median(sp):.3f}x",
                            f"{min(ce):.3f}x", f"{statistics.median(ce):.3f}x"])
    return out


SUITE_HINTS = (auto.AUTO, "bfw-mem", "bf")
"""Hints the suite compares without ``--hints`` (``auto`` adds its known candidates); the
targets judge the first and the library's default hint (:func:`judged_hints`)."""

COMMAND = "rrfp simulate --suite --markdown docs/suite.md"


def suite_markdown(rows: Sequence[SuiteRow], hints: Sequence[str], wall_s: float, command: str,
                   cpu_s: float | None = None) -> str:
    """The document: how it was made, the targets met or missed, the per-hint summary, the table."""
    from .metrics import format_markdown

    skipped = sorted({c for c in auto.all_candidates() if c != auto.STRICT} - set(_hints_of(rows, hints)))
    lines = [
        "# The scenario suite",
        "",
        f"Regenerate with `{command}` (last run: {wall_s:.0f} s of wall time"
        + (f", {cpu_s:.0f} s of CPU" if cpu_s is not None else "") + " on the shared 2-core machine;",
        "`--suite-jobs N` runs N worker processes and gives the same figures).",
        "Scenarios, seeds, memory settings and costs: `rrfp/sim/suite.py`; `auto`: `rrfp/sim/auto.py` (its trial rule: `rrfp/sim/trial.py`).",
        "Speedups are over the placement's fixed-order baseline (strict 1F1B; strict interleaved",
        "1F1B with 2 `loop` virtual stages; strict ZB-V with 2 `v` virtual stages) on the same",
        "workload and seed. At `1f1b` memory every rank's byte budget is what the baseline holds",
        "there (the memory rule: `rrfp/scheduler/memory.py`); `unlimited` has no budget. Random",
        f"scenarios run under seeds {', '.join(map(str, SEEDS))}; {', '.join(STEADY)} draw nothing and run once.",
        "Message delays are keyed by the message (direction, stage, microbatch), not by the task that",
        "sent it, a split backward shares the full backward's injected draw, and the injected jitter's",
        "`e` is the stage's expected compute per task (`rrfp.sim.jitter`), so every task's duration is",
        "a pure function of the task: every hint meets the same workload.",
        f"Targets against the optimum are judged by `{ORACLE}` (OR-Tools CP-SAT on the 4-rank points,",
        "its table in BENCHMARKS.md); here their figures, the speedups they stand for.",
        "",
        "*ideal*: the baseline over the memory-blind lower bound. *ceiling*: the baseline over the",
        "memory-aware bound (`rrfp.sim.metrics.memory_bound`: at 1F1B's budget with one stage per",
        "rank the last rank holds one microbatch, so its F, I, W run back to back). Both are the",
        "smallest over the point's runs, so no hint run there can beat them.",
        "`auto` is modelled as `rrfp train` runs it (`rrfp.sim.auto.simulate_auto`): it ranks its",
        "candidates with the simulator on a profile measured under a seed of its own, then runs its",
        f"trial, the strict schedule and the best two by simulation, {trial.TRIAL_ROUNDS} rounds of one step each in",
        "rotating order, every trial step simulated on the point's workload under a seed of its own,",
        "and keeps the smallest median step time (a hint counts as faster only beyond",
        f"{100 * trial.TIE:g}% or the trial steps' spread, where larger; among the tied, the strict schedule,",
        "else the first candidate in order: `rrfp.sim.trial.keep`, the rule `rrfp train` uses). Neither step sees the",
        "draws `auto` is judged on; it chooses once per point and is judged at every seed by the",
        "makespan of the hint it kept" + (f"; candidates not known to this build: {', '.join(skipped)}." if skipped else "."),
        "",
        "## Targets",
        "",
        "| target | figure | met |",
        "|---|---|---|",
    ]
    for h in judged_hints(hints):
        for t, fig, ok in suite_targets(rows, h):
            lines.append(f"| {t} | {fig} | {verdict(ok)} |")
    lines += ["", "## Per hint: min and median speedup over the baseline, ceiling beside", "",
              format_markdown(["hint", "memory", "min", "median", "ceiling min", "ceiling median"],
                              median_speedups(rows, hints)), "",
              "## Every point", ""]
    header, cells = suite_table(rows, hints)
    lines += [format_markdown(header, cells), ""]
    return "\n".join(lines)


def suite_command(args: Any, ranks: Sequence[int]) -> str:
    """The command line that makes this document (the settings that change its figures)."""
    parts = ["rrfp simulate --suite"]
    if tuple(ranks) != RANKS:
        parts.append(f"--suite-ranks {','.join(map(str, ranks))}")
    if args.suite_scenarios is not None:
        parts.append(f"--suite-scenarios {args.suite_scenarios}")
    if args.hints is not None or args.hint:
        parts.append(f"--hints {','.join([*args.hint, *([args.hints] if args.hints else [])])}")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if getattr(args, "seeds", None) is not None:
        parts.append(f"--seeds {args.seeds}")
    if getattr(args, "suite_jobs", 1) != 1:
        parts.append(f"--suite-jobs {args.suite_jobs}")
    return " ".join(parts + [f"--markdown {args.markdown}"])


def _cpu() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_suite_command(args: Any, hints: Sequence[str] | None, ranks: Sequence[int], write: Callable[[str, str], None]) -> int:
    """``rrfp simulate --suite``: print the table and targets; ``--markdown`` writes the document.

    Raises:
        rrfp.errors.UsageError: an unknown scenario or a hint that does not fit.
    """
    import sys
    import time

    from ..errors import UsageError
    from .engine import DeadlockError
    from .metrics import format_text

    hints = list(hints or SUITE_HINTS)
    given = args.suite_scenarios
    scen = [s.strip() for s in given.split(",") if s.strip()] if given is not None else list(SCENARIOS)
    bad = [s for s in scen if s not in SCENARIOS]
    if bad or not scen:  # an empty list is a mistake, not "all"
        raise UsageError(f"--suite-scenarios {bad[0] if bad else given!r}: expected some of {', '.join(SCENARIOS)}")
    if getattr(args, "suite_jobs", 1) < 1:
        raise UsageError(f"--suite-jobs {args.suite_jobs}: expected at least 1")
    n_seeds = len(SEEDS) if getattr(args, "seeds", None) is None else args.seeds
    if n_seeds < 1:
        raise UsageError(f"--seeds {n_seeds}: expected at least 1")
    seeds = tuple(range(args.seed, args.seed + n_seeds))
    t0, c0 = time.perf_counter(), _cpu()
    try:
        rows = run_suite(hints, scenarios=scen, ranks=ranks, seeds=seeds, jobs=getattr(args, "suite_jobs", 1),
                         progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (ValueError, DeadlockError) as e:
        raise UsageError(str(e)) from None
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    header, cells = suite_table(rows, hints)
    print(format_text(header, cells))
    for h in judged_hints(hints):
        for t, fig, ok in suite_targets(rows, h):
            print(f"# {'oracle' if ok is None else 'met   ' if ok else 'MISSED'} {t}: {fig}")
    print(f"# {wall:.1f} s wall, {cpu:.1f} s CPU")
    if args.markdown:
        write(args.markdown, suite_markdown(rows, hints, wall, suite_command(args, ranks), cpu))
    return 0
