"""An exact optimiser for the scenario suite's 4-rank points: ``python -m benchmarks.oracle``.

For each suite point (:mod:`rrfp.sim.suite`: scenario, virtual stages and placement, seed) at
1F1B's memory, OR-Tools' CP-SAT solver finds the shortest one-step schedule of the point's
tasks, once with full backwards (``F``, ``B``) and once split (``F``, ``I``, ``W``), under:

- each rank runs one task at a time (a no-overlap constraint per rank);
- the dependency rules of :meth:`rrfp.scheduler.tasks.PipelineSpec.dependencies`, with the
  point's message delay between two stages on different ranks
  (:class:`rrfp.sim.duration.CommModel`, keyed by the message);
- the memory rule of :mod:`rrfp.scheduler.memory` at the point's budget (a cumulative
  constraint per rank): a microbatch's activation on a stage holds its bytes from the start of
  its ``F`` to the end of its ``B`` (``W`` when split: the suite's costs give no ``w_bytes``,
  so all of it stays held until ``W``). The budget is the suite's ``1f1b`` budget, the bytes
  the strict baseline holds on each rank; with uniform sizes and one stage per rank that is
  1F1B's in-flight limit ``p - r`` microbatches on rank ``r``.
- forwards keep microbatch order where every hint keeps it (:func:`in_order_stages`: the first
  stage always, every stage when messages are not jittered): the optimum is over schedules that
  feed microbatches in the order of the batch, as the runtime does, not over reorderings of
  the batch.

It minimises the makespan and keeps the better form. The hints the suite runs obey every one of
these constraints (and more: their arbiter decides without knowing the future, admits
microbatches in order, keeps the banker's check), so none can beat the optimum, and a hint's
*fraction of the optimum* is ``optimum makespan / hint makespan`` (1 = optimal).

**What the optimiser knows (it is clairvoyant).** Every task's realised duration and every
message's realised delay at the point's seed (the same :class:`~rrfp.sim.duration.DurationModel`
and :class:`~rrfp.sim.duration.CommModel` draws the hints meet, which depend only on the task or
message, :mod:`rrfp.sim.jitter`), every microbatch's activation bytes, and the budget, all
before the step starts. No hint knows any of that: a readiness policy learns a duration when
its task finishes; ``auto`` chooses from a profile and trial steps under other seeds. The gap
to 1 is therefore what knowing the future is worth plus what the hint leaves on the table; the
hints are compared in the same realised durations (one simulated step at the point's seed).

Solving: durations and delays in whole microseconds (:data:`UNIT`); the best hint's order,
scheduled as early as it allows, is given as the solver's first solution, so the result is
never worse than the best hint. A solve stops when optimal or after ``--time-limit`` seconds:
then the best schedule found and the solver's lower bound are both reported (``gap``). The plan
found is replayed in the simulator as a strict per-rank order (``strict-order:``), which checks
it against the real arbiter's dependencies and reports its exact makespan and peak bytes.

OR-Tools is an optional benchmark dependency (``pip install -e .[bench]``); nothing else in
rrfp needs it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rrfp.scheduler.tasks import B, F, I, W, PipelineSpec, Task  # noqa: E402
from rrfp.sim import auto, suite  # noqa: E402
from rrfp.sim.compare import SimConfig, run_one  # noqa: E402

UNIT = 1e-6
"""Seconds per time unit of the model: durations and delays are rounded to whole microseconds
(a step of the suite lasts about a second, so rounding moves a makespan by well under 0.01%)."""

RANKS = 4
TIME_LIMIT_S = 60.0
"""Default seconds per solve (each point solves twice: full and split backward)."""

WORKERS = 8
"""CP-SAT's parallel portfolio: 8 workers proved the J2 point (4 ranks, V=1, full backward)
optimal in 9-14 s on 2 busy cores, where 2 workers stopped at 20 s with a 12% gap: the
portfolio's variety matters more than the threads' speed."""

HINTS = ("bfw-mem", "bf")
"""Hints reported beside ``auto``, the strict baseline and ``auto``'s candidates."""

INSTALL = "pip install 'ortools>=9.10' (or: pip install -e '.[bench]')"


def have_ortools() -> bool:
    """Whether OR-Tools' CP-SAT can be imported."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Plan:
    """One solve: the form, its makespan (seconds, replayed in the simulator), the solver's lower
    bound (seconds), whether it is proven optimal, its per-rank order, and the seconds spent."""

    split: bool
    makespan: float
    bound: float
    optimal: bool
    orders: list[list[Task]]
    wall_s: float
    peak_bytes: list[int] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """How far the solver's bound is below the plan (0: proven optimal)."""
        return 0.0 if self.optimal else max(0.0, 1.0 - self.bound / self.makespan)


@dataclass
class Instance:
    """A point's tasks for one backward form: integer durations (:data:`UNIT`), dependencies with
    their message lags, per-rank tasks, the bytes each activation holds, the budgets, and the
    stages whose forwards run in microbatch order (:func:`in_order_stages`)."""

    spec: PipelineSpec
    rank_of: list[int]
    dur: dict[Task, int]
    deps: dict[Task, list[tuple[Task, int]]]
    size: dict[tuple[int, int], int]
    budgets: list[int] | None
    in_order: frozenset[int] = frozenset()

    def tasks_of(self, r: int) -> list[Task]:
        return self.spec.tasks_of(r)


def instance(cfg: SimConfig, split: bool) -> Instance:
    """The tasks of one step of ``cfg`` (a point of the suite, its budget resolved or named)
    with their realised durations and message delays (step 0, the point's seed).

    Raises:
        ValueError: a configuration the simulator refuses.
    """
    place = cfg.make_placement()
    spec = PipelineSpec(place, cfg.n_microbatches, split)
    rank_of = [place.rank_of(s) for s in range(spec.n_stages)]
    model, comm = cfg.duration_model(), cfg.comm_model()
    budgets = cfg.memory_budgets() if not isinstance(cfg.memory_budget, list) else list(cfg.memory_budget)
    dur: dict[Task, int] = {}
    deps: dict[Task, list[tuple[Task, int]]] = {}
    for t in spec.all_tasks():
        dur[t] = max(0, round(model(0, rank_of[t.stage], t) / UNIT))
        out = []
        for q in spec.dependencies(t):
            src, dst = rank_of[q.stage], rank_of[t.stage]
            lag = 0 if src == dst or comm.is_zero else max(0, round(comm(0, src, dst, q) / UNIT))
            out.append((q, lag))
        deps[t] = out
    size = {(s, m): model.act_bytes(0, s, m) for s in range(spec.n_stages) for m in range(cfg.n_microbatches)}
    return Instance(spec, rank_of, dur, deps, size, budgets, in_order_stages(cfg, spec.n_stages))


def in_order_stages(cfg: SimConfig, n_stages: int) -> frozenset[int]:
    """The stages whose forwards every hint runs in microbatch order, so the optimiser keeps that
    order too: the first stage (all its inputs are there at the start, and the ready set takes
    the lowest microbatch first, :mod:`rrfp.scheduler.readyset`), and every stage when each
    link's delay is the same for every message (no message jitter or noise): then activations
    arrive in the order they were sent, by induction down the pipeline. With jittered messages a
    later microbatch may arrive first and a hint may run it first, so the optimiser may too."""
    if cfg.comm_jitter is None and not cfg.comm_noise:
        return frozenset(range(n_stages))
    return frozenset({0})


def release_kind(split: bool) -> str:
    """The task whose end frees an activation's bytes: ``B``, or ``W`` when split (no
    ``w_bytes``: the conservative rule of :mod:`rrfp.scheduler.memory`)."""
    return W if split else B


def asap(inst: Instance, orders: Sequence[Sequence[Task]]) -> dict[Task, int] | None:
    """Integer start times of the per-rank ``orders``, each task as early as its order and
    dependencies allow (None: the orders deadlock or miss a task)."""
    start: dict[Task, int] = {}
    pos = [0] * len(orders)
    free = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                t = order[pos[r]]
                if any(q not in start for q, _ in inst.deps[t]):
                    break
                s = max([free[r], *(start[q] + inst.dur[q] + lag for q, lag in inst.deps[t])])
                start[t] = s
                free[r] = s + inst.dur[t]
                pos[r] += 1
                progress = True
    return start if len(start) == len(inst.dur) else None


def solve(inst: Instance, *, time_limit: float = TIME_LIMIT_S, workers: int = WORKERS,
          start_orders: Sequence[Sequence[Task]] | None = None) -> tuple[list[list[Task]], int, int, bool]:
    """Minimise the makespan of ``inst`` with CP-SAT (model in the module docstring).

    Args:
        start_orders: per-rank orders whose as-early-as-possible schedule is the solver's
            first solution (a hint's; None: none).

    Returns:
        ``(orders, makespan, bound, optimal)``: per rank the tasks by start time, the best
        makespan found and the solver's lower bound (both in :data:`UNIT`), and whether the
        two meet.

    Raises:
        ImportError: OR-Tools is not installed.
        RuntimeError: the solver found no schedule within the time limit.
    """
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    horizon = sum(inst.dur.values()) + sum(lag for ds in inst.deps.values() for _, lag in ds)
    start, end, iv = {}, {}, {}
    for t, d in inst.dur.items():
        start[t] = m.new_int_var(0, horizon, f"s{t}")
        end[t] = start[t] + d
        iv[t] = m.new_fixed_size_interval_var(start[t], d, f"i{t}")
    for t, ds in inst.deps.items():
        for q, lag in ds:
            m.add(start[t] >= end[q] + lag)
    for t in inst.dur:  # forwards in microbatch order (Instance.in_order)
        if t.kind == F and t.mb > 0 and t.stage in inst.in_order:
            m.add(start[t] >= end[Task(t.stage, F, t.mb - 1)])
    P = len(set(inst.rank_of))
    rel = release_kind(inst.spec.split_backward)
    for r in range(P):
        mine = inst.tasks_of(r)
        m.add_no_overlap([iv[t] for t in mine])
        if inst.budgets is None:
            continue
        held, demand = [], []
        for t in mine:
            if t.kind != F:
                continue
            a, z = start[t], end[Task(t.stage, rel, t.mb)]
            span = m.new_int_var(inst.dur[t], horizon, f"h{t}")
            held.append(m.new_interval_var(a, span, z, f"held{t}"))
            demand.append(inst.size[(t.stage, t.mb)])
        m.add_cumulative(held, demand, inst.budgets[r])
    makespan = m.new_int_var(0, horizon, "makespan")
    m.add_max_equality(makespan, [end[t] for t in inst.dur])
    m.minimize(makespan)
    if start_orders is not None:
        guess = asap(inst, start_orders)
        if guess is not None:
            for t, s in guess.items():
                m.add_hint(start[t], s)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"CP-SAT found no schedule in {time_limit:g} s ({solver.status_name(status)})")
    at = {t: solver.value(start[t]) for t in inst.dur}
    orders = [sorted(inst.tasks_of(r), key=lambda t: (at[t], t.kind != F)) for r in range(P)]
    return orders, int(solver.objective_value), int(solver.best_objective_bound), status == cp_model.OPTIMAL


def order_hint(orders: Sequence[Sequence[Task]]) -> str:
    """The strict-order hint text of per-rank orders (``strict-order:rank0: 0F0 ... | ...``)."""
    return "strict-order:" + " | ".join(f"rank{r}: {' '.join(map(str, o))}" for r, o in enumerate(orders))


def records_orders(res: Any, n_ranks: int) -> list[list[Task]]:
    """Per rank, the tasks of a simulated run's first step in the order they started."""
    out: list[list[Task]] = [[] for _ in range(n_ranks)]
    for rec in sorted(res.records, key=lambda x: (x.start, x.rank)):
        if rec.step == 0:
            out[rec.rank].append(rec.task)
    return out


def optimise(cfg: SimConfig, split: bool, *, start_hint: str | None = None, time_limit: float = TIME_LIMIT_S,
             workers: int = WORKERS) -> Plan:
    """Solve one backward form of ``cfg`` and replay the plan in the simulator.

    Args:
        start_hint: a hint of this form whose simulated run seeds the solver (None: none).

    Raises:
        ImportError: OR-Tools is not installed.
        RuntimeError: no schedule found, or the plan breaks the budget when replayed.
    """
    budgets = cfg.memory_budgets()
    cfg = replace(cfg, memory_budget=budgets) if budgets is not None else cfg
    inst = instance(cfg, split)
    seed_orders = None
    if start_hint is not None:
        _, res = run_one(cfg, start_hint)
        seed_orders = records_orders(res, cfg.n_ranks)
    t0 = time.perf_counter()
    orders, _, bound, optimal = solve(inst, time_limit=time_limit, workers=workers, start_orders=seed_orders)
    wall = time.perf_counter() - t0
    summary, res = run_one(cfg, order_hint(orders))
    peak = list(res.peak_bytes)
    if budgets is not None and any(p > b for p, b in zip(peak, budgets)):
        raise RuntimeError(f"the optimiser's plan holds {peak} bytes against budgets {budgets}")
    return Plan(split, res.makespan, bound * UNIT, optimal, orders, wall, peak)


# --------------------------------------------------------------------------- the suite's points


@dataclass
class OraclePoint:
    """One suite point: the suite's row (every hint's makespan, ``auto``'s choice) and the two
    plans."""

    row: suite.SuiteRow
    full: Plan
    split: Plan

    @property
    def best(self) -> Plan:
        return min((self.full, self.split), key=lambda p: p.makespan)

    def fraction(self, hint: str) -> float:
        """``hint``'s fraction of the optimum: best plan's makespan / the hint's."""
        return self.best.makespan / self.row.makespan[hint]


def _seed_hint(row: suite.SuiteRow, split: bool) -> str | None:
    """The fastest hint of the row with this backward form (the solver's first solution)."""
    from rrfp.scheduler.hints import resolve_hint
    from rrfp.scheduler.tasks import Placement

    place = Placement(row.n_ranks, row.n_virtual, row.placement)
    M = 4 * row.n_ranks
    same = [h for h in row.makespan if h != auto.AUTO and resolve_hint(h, place, M)[0].split_backward == split]
    return min(same, key=lambda h: row.makespan[h], default=None)


def run_points(*, layouts: Sequence[tuple[int, str]] = suite.LAYOUTS, scenarios: Sequence[str] = tuple(suite.SCENARIOS),
               seeds: Sequence[int] = suite.SEEDS, hints: Sequence[str] = HINTS, time_limit: float = TIME_LIMIT_S,
               workers: int = WORKERS, progress=None) -> list[OraclePoint]:
    """Every requested 4-rank suite point at 1F1B's memory: the suite's hints and ``auto``
    (:func:`rrfp.sim.suite.run_suite`), then both plans.

    Raises:
        ImportError: OR-Tools is not installed.
    """
    rows = suite.run_suite([auto.AUTO, *hints], scenarios=scenarios, ranks=[RANKS], layouts=layouts,
                           memories=["1f1b"], seeds=seeds)
    out = []
    for row in rows:
        cfg = suite.suite_config(row.scenario, row.n_ranks, row.n_virtual, "1f1b", row.seed, row.placement)
        plans = [optimise(cfg, sp, start_hint=_seed_hint(row, sp), time_limit=time_limit, workers=workers)
                 for sp in (False, True)]
        pt = OraclePoint(row, *plans)
        out.append(pt)
        if progress:
            progress(f"{row.scenario} V={row.layout} seed {row.seed}: optimum {pt.best.makespan:.4f} s "
                     f"({'split' if pt.best.split else 'full'}, {'optimal' if pt.best.optimal else f'gap {pt.best.gap:.1%}'}, "
                     f"{plans[0].wall_s + plans[1].wall_s:.0f} s); auto {row.auto_choice} {pt.fraction(auto.AUTO):.3f}")
    return out


# --------------------------------------------------------------------------- targets and tables


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def oracle_targets(points: Sequence[OraclePoint]) -> list[tuple[str, str, bool]]:
    """The suite's targets restated against the optimum: (target, figure, met)."""
    var = [p for p in points if p.row.scenario in suite.VARIABLE]
    fr = [p.fraction(auto.AUTO) for p in points]
    worst = min(points, key=lambda p: p.fraction(auto.AUTO), default=None)
    where = f" ({worst.row.scenario}, V={worst.row.layout}, seed {worst.row.seed})" if worst else ""
    med = _median([p.fraction(auto.AUTO) for p in var])
    below = [p for p in points if p.row.speedup(auto.AUTO) < 1.0]
    unproven = sum(1 for p in points if not p.best.optimal)
    note = f"; {unproven} of {len(points)} optima not proven (gap beside each point)" if unproven else ""
    return [
        ("auto at least 0.98 of the optimum, median over the points with variability",
         f"median {med:.3f} over {len(var)} points{note}", med >= 0.98),
        ("auto at least 0.95 of the optimum at every point",
         f"min {min(fr, default=math.nan):.3f}{where}", bool(fr) and min(fr) >= 0.95),
        ("auto never below the strict schedule",
         f"min {min((p.row.speedup(auto.AUTO) for p in points), default=math.nan):.3f}x; below at {len(below)} points",
         not below),
        ("auto within 2% of the best candidate at >= 95% of points",
         _within_figure(points), _within(points)[0] >= 0.95 * max(1, _within(points)[1])),
    ]


def _within(points: Sequence[OraclePoint]) -> tuple[int, int]:
    return suite.auto_within([p.row for p in points])


def _within_figure(points: Sequence[OraclePoint]) -> str:
    hits, n = _within(points)
    return f"{hits} of {n} points ({100 * hits / n if n else math.nan:.1f}%)"


def shown_hints(points: Sequence[OraclePoint]) -> list[str]:
    """``auto``, the baselines, then the other hints that ran at every point."""
    names = [auto.AUTO] + list(dict.fromkeys(p.row.baseline for p in points))
    for p in points:
        names += [h for h in p.row.makespan if h not in names]
    return [h for h in names if all(h in p.row.makespan for p in points) or h.startswith("strict")]


def point_cells(points: Sequence[OraclePoint]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per point: the optimum, each plan's makespan and proof, and each
    hint's fraction of the optimum."""
    hints = shown_hints(points)
    header = ["scenario", "V", "seed", "optimum (s)", "form", "full (s)", "split (s)", "gap", "speedup over strict",
              *hints, "auto chose"]
    cells = []
    for p in points:
        b = p.best
        cells.append([p.row.scenario, p.row.layout, str(p.row.seed), f"{b.makespan:.4f}", "split" if b.split else "full",
                      f"{p.full.makespan:.4f}", f"{p.split.makespan:.4f}",
                      "optimal" if b.optimal else f"{b.gap:.1%}",
                      f"{p.row.makespan[p.row.baseline] / b.makespan:.3f}x",
                      *[f"{p.fraction(h):.3f}" if h in p.row.makespan else "-" for h in hints],
                      p.row.auto_choice or "-"])
    return header, cells


def summary_cells(points: Sequence[OraclePoint]) -> list[list[str]]:
    """Per hint: min and median fraction of the optimum, over every point and over the points
    with variability."""
    out = []
    var = [p for p in points if p.row.scenario in suite.VARIABLE]
    for h in shown_hints(points):
        a = [p.fraction(h) for p in points if h in p.row.makespan]
        v = [p.fraction(h) for p in var if h in p.row.makespan]
        if a:
            out.append([h, f"{min(a):.3f}", f"{_median(a):.3f}", f"{min(v, default=math.nan):.3f}", f"{_median(v):.3f}"])
    return out


TITLE = "The exact optimiser (CP-SAT) on the suite's 4-rank points"
"""The section's heading (``--title`` names another: BENCHMARKS.md keeps one section per layout)."""


def measured_line(load: Sequence[float], when: str) -> str:
    """Where and when the section was measured: the machine's cores, the range of its 1-minute
    load average (``load``: sampled at the start and after each point), the date. The solver's
    limit is wall time, so a busy machine can leave a gap the same solve on a quiet one closes."""
    lo, hi = min(load), max(load)
    return (f"Measured on a {os.cpu_count()}-core machine at load {lo:.1f}-{hi:.1f} ({when}): the solver's time "
            "limit is wall time, so where a point says `gap` its optimum is the best schedule found and the "
            "hints' fractions there are upper bounds on their fractions of the true optimum.")


def markdown(points: Sequence[OraclePoint], command: str, wall_s: float, *, title: str = TITLE,
             measured: str | None = None) -> str:
    """The oracle's section: heading, where it was measured (``measured``, :func:`measured_line`;
    None: not said), how it was made, the targets, the per-hint summary, every point."""
    from rrfp.sim.metrics import format_markdown

    solved = sum(p.full.wall_s + p.split.wall_s for p in points)
    lines = [f"## {title}", "", *([measured, ""] if measured else []),
             f"`{command}` ({wall_s:.0f} s of wall time, {solved:.0f} s in the solver). The optimum is the shortest",
             "schedule of the point's tasks at its 1F1B budget, full or split backward, with every task's",
             "realised duration and every message's realised delay known in advance (clairvoyant:",
             "`benchmarks/oracle.py` says what it uses); each hint's figure is its makespan on the same",
             "realised durations as a fraction of that optimum (1 = optimal). `gap`: how far the solver's",
             "lower bound is below the plan where it stopped at its time limit.", "",
             "| target | figure | met |", "|---|---|---|"]
    lines += [f"| {t} | {f} | {'met' if ok else '**missed**'} |" for t, f, ok in oracle_targets(points)]
    lines += ["", format_markdown(["hint", "min", "median", "min (variable)", "median (variable)"],
                                  summary_cells(points)), ""]
    header, cells = point_cells(points)
    lines += [format_markdown(header, cells), ""]
    return "\n".join(lines)


def parse_layouts(text: str) -> list[tuple[int, str]]:
    """``"1,2loop,2v"`` -> the suite's layouts (``2`` alone: both placements of 2).

    Raises:
        ValueError: naming a bad item.
    """
    out: list[tuple[int, str]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        picked = [lay for lay in suite.LAYOUTS if f"{lay[0]}{lay[1]}" == item or (item == "1" and lay[0] == 1)
                  or (item == "2" and lay[0] == 2)]
        if not picked:
            raise ValueError(f"--layouts {item!r}: expected 1, 2, 2loop or 2v")
        out += [lay for lay in picked if lay not in out]
    if not out:
        raise ValueError(f"--layouts {text!r}: expected some of 1, 2loop, 2v")
    return out


def shown_command(argv: Sequence[str]) -> str:
    """The command the section names: ``argv`` without ``--markdown FILE`` (where it was written
    changes no figure), an argument with a space or a quote in double quotes."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--markdown="):
            skip = False
            continue
        if a == "--markdown":
            skip = True
            continue
        plain = a and not any(c in a for c in " '\"$`\\")
        out.append(a if plain else '"' + "".join("\\" + c if c in '"$`\\' else c for c in a) + '"')
    return " ".join(["python -m benchmarks.oracle", *out])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1,2loop,2v", help="virtual stages and placement: 1, 2loop, 2v (default all)")
    p.add_argument("--scenarios", default=",".join(suite.SCENARIOS), help="suite scenarios (default all)")
    p.add_argument("--seeds", default=",".join(map(str, suite.SEEDS)), help="seeds of the random scenarios")
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per solve (default %(default)s)")
    p.add_argument("--workers", type=int, default=WORKERS, help="CP-SAT workers (default %(default)s)")
    p.add_argument("--markdown", help="write the section to this file")
    p.add_argument("--title", default=TITLE, help="the section's heading (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        layouts = parse_layouts(args.layouts)
        scen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        bad = [s for s in scen if s not in suite.SCENARIOS]
        if bad or not scen:
            raise ValueError(f"--scenarios {bad[0] if bad else args.scenarios!r}: expected some of {', '.join(suite.SCENARIOS)}")
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        if not seeds:
            raise ValueError(f"--seeds {args.seeds!r}: expected comma-separated integers")
        if not (args.time_limit > 0 and math.isfinite(args.time_limit)) or args.workers < 1:
            raise ValueError(f"--time-limit {args.time_limit} / --workers {args.workers}: expected > 0 and >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not have_ortools():
        print(f"error: the optimiser needs OR-Tools: {INSTALL}", file=sys.stderr)
        return 2
    t0, load = time.perf_counter(), [os.getloadavg()[0]]

    def progress(line: str) -> None:  # the load after each point: the section gives its range
        load.append(os.getloadavg()[0])
        print(line, file=sys.stderr, flush=True)

    points = run_points(layouts=layouts, scenarios=scen, seeds=seeds, time_limit=args.time_limit,
                        workers=args.workers, progress=progress)
    command = shown_command(argv if argv is not None else sys.argv[1:])
    when = time.strftime("%Y-%m-%d, %H:%M UTC", time.gmtime())
    text = markdown(points, command.strip(), time.perf_counter() - t0, title=args.title,
                    measured=measured_line(load, when))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
