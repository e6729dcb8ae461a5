"""The scenario suite (``rrfp simulate --suite``): every hint against the fixed-order baseline,
at 1F1B's memory and unlimited, over the variability the paper's workloads show.

Scenarios (:data:`SCENARIOS`), each on 4, 8, 16 and 32 ranks, 1 and 2 virtual stages
(``loop`` placement), ``M = 4 x ranks`` microbatches, ``F = 10 ms``, ``B = 20 ms`` (``I = W =
10 ms`` split), 1 MiB of activations per stage and microbatch (scaled by sequence length and,
on the encoder stage, image count):

- ``J0``..``J3``: the paper's injected compute jitter (RRFP §7).
- ``comm-J2``: messages take 2 ms plus J2's injected delays; compute is steady.
- ``seqlen``: each microbatch's length ratio ~ lognormal(0.4): time and bytes scale with it.
- ``multimodal``: 4 samples per microbatch, each 0-6 images (uniform); the first stage is
  the image encoder, whose time and bytes follow the microbatch's image count.
- ``straggler``: the middle rank runs 1.5x slower.

Memory: ``1f1b`` gives each rank a budget of the bytes the baseline (strict 1F1B, or strict
interleaved 1F1B with virtual stages) holds on it with the same sizes
(:meth:`~rrfp.sim.compare.SimConfig.memory_budgets`); ``unlimited`` gives no budget and an
in-flight limit of ``M``.

Pure module: no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..scheduler.hints import DEFAULT_HINT
from .compare import SimConfig, compare, default_baseline
from .costs import CostModel
from .duration import Dist
from .jitter import parse_jitter

MIB = 2**20

SCENARIOS: dict[str, dict[str, Any]] = {
    "J0": {},
    "J1": {"jitter": parse_jitter("J1")},
    "J2": {"jitter": parse_jitter("J2")},
    "J3": {"jitter": parse_jitter("J3")},
    "comm-J2": {"latency": 0.002, "comm_jitter": parse_jitter("J2")},
    "seqlen": {"seqlen": Dist.parse("lognormal:0.4")},
    "multimodal": {"images": Dist.parse("randint:0,6"), "samples_per_microbatch": 4, "encoder_stages": 1},
    "straggler": {"stragglers": "middle"},
}
"""Scenario name -> :class:`~rrfp.sim.compare.SimConfig` fields (``"middle"``: the middle
rank, ``ranks // 2``, at 1.5x)."""

VARIABLE = tuple(s for s in SCENARIOS if s != "J0")
"""Scenarios with variability (the median target is over these)."""

RANKS = (4, 8, 16, 32)
VIRTUAL = (1, 2)
MEMORIES = ("1f1b", "unlimited")


@dataclass
class SuiteRow:
    """One configuration of the suite: makespans (s), peak bytes per rank and lower bound per
    hint (the baseline included)."""

    scenario: str
    n_ranks: int
    n_virtual: int
    memory: str
    baseline: str
    makespan: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)

    def speedup(self, hint: str) -> float:
        return self.makespan[self.baseline] / self.makespan[hint]


def suite_config(scenario: str, n_ranks: int, n_virtual: int, memory: str, seed: int = 0) -> SimConfig:
    """The :class:`SimConfig` of one suite point.

    Raises:
        KeyError: an unknown scenario; ValueError: an unknown memory setting.
    """
    over = dict(SCENARIOS[scenario])
    if over.get("stragglers") == "middle":
        over["stragglers"] = {n_ranks // 2: 1.5}
    m = 4 * n_ranks
    if memory not in MEMORIES:
        raise ValueError(f"suite memory {memory!r}: expected one of {', '.join(MEMORIES)}")
    costs = CostModel.uniform(1, 0.010, 0.020, act_bytes=MIB)
    return SimConfig(n_ranks=n_ranks, n_microbatches=m, n_virtual=n_virtual, limit=m, costs=costs, seed=seed,
                     memory_budget="1f1b" if memory == "1f1b" else None, **over)


def run_suite(
    hints: Sequence[str],
    *,
    scenarios: Sequence[str] = tuple(SCENARIOS),
    ranks: Sequence[int] = RANKS,
    virtual: Sequence[int] = VIRTUAL,
    memories: Sequence[str] = MEMORIES,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[SuiteRow]:
    """Run every hint on every suite point (with the point's baseline added).

    Raises:
        KeyError / ValueError: an unknown scenario or memory; ValueError or DeadlockError
            from a hint that does not fit (named).
    """
    rows = []
    for sc in scenarios:
        for p in ranks:
            for v in virtual:
                for mem in memories:
                    cfg = suite_config(sc, p, v, mem, seed)
                    base = default_baseline(v, cfg.placement) or "strict-1f1b"
                    runs = compare(cfg, list(hints), base)
                    row = SuiteRow(sc, p, v, mem, base)
                    for r in runs:
                        row.makespan[r.hint] = r.makespan
                        row.bound[r.hint] = r.lower_bound
                        row.peak_bytes[r.hint] = max(r.peak_memory_rank)
                    rows.append(row)
                    if progress:
                        progress(f"{sc} ranks={p} V={v} memory={mem}: done")
    return rows


def suite_table(rows: Sequence[SuiteRow], hints: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: one row per point; the baseline's makespan and peak MiB, the ideal
    (the baseline's makespan over the lower bound: no hint can beat it, at any memory), then
    per hint its speedup over the baseline, then the first hint's makespan over the lower bound
    (the smallest bound of the point's runs, so it holds for each) and its peak MiB."""
    header = ["scenario", "ranks", "V", "memory", "baseline (s)", "baseline MiB", "ideal"]
    header += [f"{h}" for h in hints] + [f"{hints[0]}/bound", f"{hints[0]} MiB"]
    cells = []
    for r in rows:
        bound = min(r.bound.values())
        row = [r.scenario, str(r.n_ranks), str(r.n_virtual), r.memory, f"{r.makespan[r.baseline]:.3f}",
               f"{r.peak_bytes[r.baseline] / MIB:.1f}", f"{r.makespan[r.baseline] / bound:.2f}x"]
        row += [f"{r.speedup(h):.2f}x" for h in hints]
        row += [f"{r.makespan[hints[0]] / bound:.3f}", f"{r.peak_bytes[hints[0]] / MIB:.1f}"]
        cells.append(row)
    return header, cells


def variable_median(rows: Sequence[SuiteRow], hint: str) -> float:
    """``hint``'s median speedup at 1F1B's memory over the scenarios with variability
    (:data:`VARIABLE`): the figure of the issue's median target (nan without such points)."""
    var = [r.speedup(hint) for r in rows if r.memory == "1f1b" and r.scenario in VARIABLE]
    return statistics.median(var) if var else math.nan


def suite_targets(rows: Sequence[SuiteRow], hint: str) -> list[tuple[str, str, bool]]:
    """The issue's simulator targets for ``hint``: (target, figure, met). Each figure has the
    ideal beside it: the baseline over the point's lower bound (at any memory: the bound knows
    no budget, so at 1F1B's memory the reachable ideal may be lower)."""
    eq = [r for r in rows if r.memory == "1f1b"]
    worst = min((r.speedup(hint) for r in eq), default=math.nan)
    ideal_min = min((r.makespan[r.baseline] / min(r.bound.values()) for r in eq), default=math.nan)
    med = variable_median(rows, hint)
    unl = [r.makespan[hint] / min(r.bound.values()) for r in rows if r.memory == "unlimited"]
    med_b = statistics.median(unl) if unl else math.nan
    ideal = [r.makespan[r.baseline] / min(r.bound.values()) for r in eq if r.scenario in VARIABLE]
    med_ideal = statistics.median(ideal) if ideal else math.nan
    # The hint's own ideal: the baseline over the hint's own lower bound (durations depend on
    # the dispatch order through the jitter's running average, so bounds differ a little).
    own = [r.makespan[r.baseline] / r.bound[hint] for r in eq if r.scenario in VARIABLE]
    med_own = statistics.median(own) if own else math.nan
    worst_row = min(eq, key=lambda r: r.speedup(hint)) if eq else None
    where = f" ({worst_row.scenario}, {worst_row.n_ranks} ranks, V={worst_row.n_virtual})" if worst_row else ""
    if worst_row is not None and worst < 1.0 and worst_row.bound[hint] > worst_row.makespan[worst_row.baseline]:
        where += (f"; there {hint}'s own lower bound, {worst_row.bound[hint]:.3f} s, is above the baseline's "
                  f"makespan, {worst_row.makespan[worst_row.baseline]:.3f} s: out of its reach")
    reach = "in reach of" if med_ideal >= 1.15 else "out of reach of"
    return [
        (f"{hint} at 1F1B's memory never below 1.00x the baseline",
         f"min {worst:.3f}x{where} (ideal: min {ideal_min:.3f}x)", worst >= 1.0),
        (f"{hint} at 1F1B's memory, median over scenarios with variability >= 1.15x",
         f"median {med:.3f}x (ideal, the baseline over the lower bound at any memory: median {med_ideal:.3f}x, "
         f"so 1.15x is {reach} the ideal; over {hint}'s own lower bound: {med_own:.3f}x)",
         med >= 1.15),
        (f"{hint} unlimited, median makespan within 1.10x of the lower bound",
         f"median {med_b:.3f}x (ideal 1.000x)", med_b <= 1.10),
    ]


def judged_hints(hints: Sequence[str]) -> list[str]:
    """The hints the targets table judges: the first (the suite's best) and the default hint
    (:data:`rrfp.scheduler.hints.DEFAULT_HINT`) when it ran and differs."""
    return list(dict.fromkeys([hints[0]] + ([DEFAULT_HINT] if DEFAULT_HINT in hints else [])))


def median_speedups(rows: Sequence[SuiteRow], hints: Sequence[str]) -> list[list[str]]:
    """Per hint and memory: min and median speedup over all points (the hint comparison)."""
    out = []
    for h in hints:
        for mem in MEMORIES:
            sp = [r.speedup(h) for r in rows if r.memory == mem]
            if sp:
                out.append([h, mem, f"{min(sp):.3f}x", f"{statistics.median(sp):.3f}x"])
    return out



SUITE_HINTS = ("bfw-mem", "bfw-alt-df", "bfw-df", "bfw", "bf")
"""Hints the suite compares without ``--hints``: the targets judge the first (the best) and the
default hint (:func:`judged_hints`)."""

COMMAND = "rrfp simulate --suite --markdown docs/suite.md"


def suite_markdown(rows: Sequence[SuiteRow], hints: Sequence[str], wall_s: float, command: str,
                   cpu_s: float | None = None) -> str:
    """The document: how it was made, the targets met or missed, the per-hint summary, the table."""
    from .metrics import format_markdown

    lines = [
        "# The scenario suite",
        "",
        f"Regenerate with `{command}` (one process, one core: {cpu_s if cpu_s is not None else wall_s:.0f} s of CPU,",
        f"{wall_s:.0f} s of wall time on the shared 2-core machine it was last run on).",
        "Scenarios, memory settings and costs: `rrfp/sim/suite.py`.",
        "Speedups are over the placement's fixed-order baseline (strict 1F1B; strict interleaved",
        "1F1B with 2 virtual stages) on the same workload and seed. At `1f1b` memory every rank's",
        "byte budget is what the baseline holds there (the memory rule: `rrfp/scheduler/memory.py`);",
        "`unlimited` has no budget. MiB columns are the most activation bytes any rank held. The",
        "baseline runs the full backward (B); split-backward hints (`bfw*`) run I and W, which share",
        "the full backward's injected-jitter draw (`rrfp/sim/jitter.py`), so every hint gets the same",
        "injected work per microbatch.",
        "",
        "## Targets (rrfp issue 13)",
        "",
        f"The first hint ({hints[0]}) and the default hint (`rrfp.scheduler.hints.DEFAULT_HINT`) when it ran.",
        "",
        "| target | figure | met |",
        "|---|---|---|",
    ]
    for h in judged_hints(hints):
        for t, fig, ok in suite_targets(rows, h):
            lines.append(f"| {t}{' (the default)' if h == DEFAULT_HINT else ''} | {fig} | {'met' if ok else 'missed'} |")
    lines += ["", "## Per hint: min and median speedup over the baseline", "",
              format_markdown(["hint", "memory", "min", "median"], median_speedups(rows, hints)), "",
              "## Every point", ""]
    header, cells = suite_table(rows, hints)
    lines += [format_markdown(header, cells), ""]
    return "\n".join(lines)


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
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        rows = run_suite(hints, scenarios=scen, ranks=ranks, seed=args.seed,
                         progress=lambda s: print(s, file=sys.stderr))
    except (ValueError, DeadlockError) as e:
        raise UsageError(str(e)) from None
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    header, cells = suite_table(rows, hints)
    print(format_text(header, cells))
    for h in judged_hints(hints):
        for t, fig, ok in suite_targets(rows, h):
            print(f"# {'met   ' if ok else 'MISSED'} {t}: {fig}")
    print(f"# {wall:.1f} s wall, {cpu:.1f} s CPU")
    if args.markdown:
        write(args.markdown, suite_markdown(rows, hints, wall, COMMAND, cpu))
    return 0
