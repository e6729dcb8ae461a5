"""Why ``auto`` misses the best of its candidates: ``python -m benchmarks.auto_misses``.

For each scenario-suite point (:mod:`rrfp.sim.suite`: scenario, ranks, virtual stages and
placement, memory, seed) this reruns ``auto`` exactly as the suite does
(:func:`rrfp.sim.auto.simulate_auto` on the point's seed-0 configuration, the choice made once
per point) and every one of its candidates on the point's own seed, and prints each point where
``auto``'s makespan is more than :data:`TOLERANCE` above the best candidate's (the suite's
"within 2%" target, :func:`rrfp.sim.suite.auto_within`), with the step that lost it:

- ``ranking``: the best candidate never ran in the trial: the simulation on the measured profile
  (:func:`rrfp.sim.auto.rank`) did not put it among its best two (``tie`` beside it: it was
  simulated exactly as fast as one that was, and lost on the order of preference);
- ``trial``: it ran in the trial, but another hint's trial median was smaller (the trial's
  steps, other batches than the judged one, said otherwise);
- ``keep``: its trial median was the smallest, but within the margin
  (:func:`rrfp.sim.trial.margin`: the larger of 1% and the trial's spread), so the order of
  preference (the strict schedule first) kept another.

Columns: the point; the best candidate and its makespan; ``auto``'s choice and its makespan over
the best's; the ranking's order (simulated ms on the profile); the trial's medians (ms,
adjusted to equal batch work, :func:`rrfp.sim.trial.scaled`) with the kept hint starred; the margin.

Pure simulation (seconds at 4 ranks, minutes at 16): no OR-Tools, no torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rrfp.sim import auto, suite  # noqa: E402
from rrfp.sim.trial import margin, medians  # noqa: E402
from rrfp.sim.compare import default_baseline, run_one  # noqa: E402

TOLERANCE = 0.02
"""A point is a miss where ``auto``'s makespan exceeds the best candidate's by more than this."""


@dataclass
class Point:
    """One suite point: ``auto``'s run on the point's seed-0 configuration (as the suite runs it)
    and every candidate's makespan (s) at the point's seed."""

    scenario: str
    n_ranks: int
    n_virtual: int
    placement: str
    memory: str
    seed: int
    run: auto.AutoRun
    makespan: dict[str, float]

    @property
    def name(self) -> str:
        lay = f"{self.n_virtual}" + ("" if self.n_virtual == 1 else f" {self.placement}")
        return f"{self.scenario} {self.n_ranks}r V={lay} {self.memory} s{self.seed}"

    @property
    def best(self) -> str:
        """The fastest candidate here (ties: the ranking's order)."""
        return min(self.makespan, key=lambda h: self.makespan[h])

    def ratio(self, hint: str | None = None) -> float:
        """``hint``'s (default ``auto``'s choice) makespan over the best candidate's."""
        return self.makespan[hint or self.run.chosen] / self.makespan[self.best]

    @property
    def missed(self) -> bool:
        return self.ratio() > 1 + TOLERANCE

    def cause(self) -> str:
        """``ranking`` / ``trial`` / ``keep`` (module docstring); ``-`` where ``auto`` kept the best."""
        best, run = self.best, self.run
        if self.makespan[run.chosen] <= self.makespan[best]:
            return "-"
        if best not in run.walls:
            sim = run.ranking.makespan(best)
            tried = [h for h in run.walls if h != run.ranking.strict]
            tie = any(run.ranking.makespan(h) == sim for h in tried)
            return "ranking (tie)" if tie else "ranking"
        med = medians(run.walls)
        return "keep" if med[best] == min(med.values()) else "trial"


def run_points(*, scenarios: Sequence[str] = tuple(suite.SCENARIOS), ranks: Sequence[int] = (4, 8),
               layouts: Sequence[tuple[int, str]] = suite.LAYOUTS, memories: Sequence[str] = suite.MEMORIES,
               seeds: Sequence[int] = suite.SEEDS, rule=None) -> list[Point]:
    """Every requested suite point, ``auto`` run by ``rule`` (default
    :func:`rrfp.sim.auto.simulate_auto`; a callable taking the point's seed-0 configuration).

    Raises:
        KeyError / ValueError: an unknown scenario or memory.
    """
    rule = rule or auto.simulate_auto
    out = []
    for sc in scenarios:
        for p in ranks:
            for v, pl in layouts:
                for mem in memories:
                    run = rule(suite.suite_config(sc, p, v, mem, seeds[0], pl))
                    cands = [h for h, _ in run.ranking.order]
                    for seed in (seeds[:1] if sc in suite.STEADY else seeds):
                        cfg = suite.suite_config(sc, p, v, mem, seed, pl)
                        budgets = cfg.memory_budgets()
                        if budgets is not None:
                            cfg = replace(cfg, memory_budget=budgets)
                        ms = {h: run_one(cfg, h, record=False)[0].makespan for h in cands}
                        out.append(Point(sc, p, v, pl, mem, seed, run, ms))
    return out


def cells(points: Sequence[Point]) -> tuple[list[str], list[list[str]]]:
    """The table of misses: header and one row per point missed (module docstring)."""
    header = ["point", "best (s)", "auto kept", "kept/best", "cause", "ranking (simulated ms)",
              "trial medians (ms)", "margin"]
    rows = []
    for p in points:
        if not p.missed:
            continue
        rk, med = p.run.ranking, medians(p.run.walls)
        order = ", ".join(f"{h} {1e3 * t:.1f}" for h, t in rk.order)
        trial = ", ".join(f"{h}{'*' if h == p.run.chosen else ''} {1e3 * t:.1f}" for h, t in
                          sorted(med.items(), key=lambda x: x[1]))
        rows.append([p.name, f"{p.best} {p.makespan[p.best]:.4f}", p.run.chosen, f"{p.ratio():.3f}", p.cause(),
                     order, trial, f"{100 * margin(p.run.walls):.1f}%"])
    return header, rows


def summary(points: Sequence[Point]) -> dict[str, float]:
    """The suite's figures for ``auto`` over ``points``: within-2% share, and at 1F1B's memory
    the min and median speedup over the strict schedule (median over the scenarios with
    variability), the points below it, and the causes of the misses."""
    def speedup(p: Point) -> float:
        base = default_baseline(p.n_virtual, p.placement)
        return p.makespan[base] / p.makespan[p.run.chosen]

    eq = [p for p in points if p.memory == "1f1b"]
    var = [speedup(p) for p in eq if p.scenario in suite.VARIABLE]
    hits = sum(1 for p in points if not p.missed)
    causes: dict[str, int] = {}
    for p in points:
        if p.missed:
            c = p.cause().split(" ")[0]
            causes[c] = causes.get(c, 0) + 1
    return {"within": hits, "points": len(points), "min_1f1b": min(map(speedup, eq), default=float("nan")),
            "median_var_1f1b": statistics.median(var) if var else float("nan"),
            "below_strict": sum(1 for p in eq if speedup(p) < 1.0), **{f"cause_{k}": v for k, v in causes.items()}}


def ceiling(points: Sequence[Point]) -> int:
    """How many of ``points`` a rule that keeps one candidate per point (as ``auto`` does: its
    choice is made once and judged at every seed) can have within :data:`TOLERANCE` of the best
    there at most: per point, the candidate within it at the most seeds."""
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault((p.scenario, p.n_ranks, p.n_virtual, p.placement, p.memory), []).append(p)
    total = 0
    for pts in groups.values():
        hints = set.intersection(*(set(p.makespan) for p in pts))
        total += max(sum(1 for p in pts if p.ratio(h) <= 1 + TOLERANCE) for h in hints)
    return total


def main(argv: Sequence[str] | None = None) -> int:
    from rrfp.sim.metrics import format_markdown

    p = argparse.ArgumentParser(prog="python -m benchmarks.auto_misses", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="4,8", help="suite ranks (default %(default)s: the report's points)")
    p.add_argument("--seeds", default=",".join(map(str, suite.SEEDS)), help="seeds (default %(default)s)")
    p.add_argument("--scenarios", default=",".join(suite.SCENARIOS), help="suite scenarios (default all)")
    p.add_argument("--memories", default=",".join(suite.MEMORIES), help="1f1b, unlimited (default both)")
    args = p.parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        scen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        mems = [m.strip() for m in args.memories.split(",") if m.strip()]
        bad = [s for s in scen if s not in suite.SCENARIOS] + [m for m in mems if m not in suite.MEMORIES]
        if bad or not (ranks and seeds and scen and mems) or any(r < 2 for r in ranks):
            raise ValueError(f"{bad[0] if bad else 'an empty or bad list'}: expected scenarios among "
                             f"{', '.join(suite.SCENARIOS)}, memories among {', '.join(suite.MEMORIES)}, "
                             "ranks >= 2 and integer seeds")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    points = run_points(scenarios=scen, ranks=ranks, memories=mems, seeds=seeds)
    header, rows = cells(points)
    s = summary(points)
    print(f"auto within {100 * TOLERANCE:.0f}% of the best candidate at {s['within']} of {s['points']} points "
          f"(one kept candidate per point: at most {ceiling(points)}); "
          f"misses by cause: {', '.join(f'{k[6:]} {v}' for k, v in s.items() if k.startswith('cause_')) or 'none'}\n")
    print(format_markdown(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
