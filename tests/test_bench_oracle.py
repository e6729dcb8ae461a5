"""The exact optimiser of the benchmarks (benchmarks/oracle.py, OR-Tools CP-SAT): it finds the
shortest schedule that a brute force over every per-rank order finds, no hint beats it, and its
plan replays in the simulator within the budget. Skipped where OR-Tools is not installed (an
optional benchmark dependency: ``pip install -e '.[bench]'``)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import oracle  # noqa: E402
from rrfp.scheduler.tasks import B, F, I, W, PipelineSpec, Task  # noqa: E402
from rrfp.sim.compare import SimConfig, run_one  # noqa: E402
from rrfp.sim.costs import CostModel  # noqa: E402
from rrfp.sim.jitter import LEVELS  # noqa: E402

MIB = 2**20
needs_ortools = pytest.mark.skipif(not oracle.have_ortools(), reason="OR-Tools not installed (pip install -e '.[bench]')")


def _cfg(seed: int, **kw) -> SimConfig:
    base = dict(n_ranks=2, n_microbatches=2, costs=CostModel.uniform(1, 0.010, 0.020, act_bytes=MIB),
                jitter=LEVELS["J3"], latency=0.002, comm_jitter=LEVELS["J2"], seed=seed, memory_budget="1f1b")
    return SimConfig(**{**base, **kw})


def _orders(tasks: list[Task], fifo: bool):
    """Every order of one rank's tasks that its own stage's rules allow (F before its B or I,
    I before its W; forwards in microbatch order where ``fifo``)."""
    for perm in itertools.permutations(tasks):
        pos = {t: i for i, t in enumerate(perm)}
        ok = all(pos[Task(t.stage, F, t.mb)] < pos[t] for t in perm if t.kind in (B, I))
        ok = ok and all(pos[Task(t.stage, I, t.mb)] < pos[t] for t in perm if t.kind == W)
        s = perm[0].stage  # one stage per rank
        ok = ok and not (fifo and pos[Task(s, F, 1)] < pos[Task(s, F, 0)])
        if ok:
            yield perm


def _brute_force(cfg: SimConfig, split: bool) -> float:
    """The smallest makespan over every pair of per-rank orders that keeps the budget, each
    scheduled as early as possible with the float durations: an independent reference."""
    place = cfg.make_placement()
    spec = PipelineSpec(place, cfg.n_microbatches, split)
    dur_m, comm = cfg.duration_model(), cfg.comm_model()
    budgets = cfg.memory_budgets()
    dur = {t: dur_m(0, place.rank_of(t.stage), t) for t in spec.all_tasks()}
    release = W if split else B
    fifo_all = cfg.comm_jitter is None

    def fits(order, r) -> bool:
        held = 0
        for t in order:
            if t.kind == F:
                held += dur_m.act_bytes(0, t.stage, t.mb)
                if held > budgets[r]:
                    return False
            elif t.kind == release:
                held -= dur_m.act_bytes(0, t.stage, t.mb)
        return True

    def makespan(orders) -> float | None:
        start, pos, free = {}, [0, 0], [0.0, 0.0]
        moved = True
        while moved:
            moved = False
            for r, order in enumerate(orders):
                while pos[r] < len(order):
                    t = order[pos[r]]
                    deps = spec.dependencies(t)
                    if any(q not in start for q in deps):
                        break
                    ready = [start[q] + dur[q] + (comm(0, place.rank_of(q.stage), r, q)
                                                  if place.rank_of(q.stage) != r else 0.0) for q in deps]
                    start[t] = max([free[r], *ready])
                    free[r] = start[t] + dur[t]
                    pos[r] += 1
                    moved = True
        return max(free) if len(start) == len(dur) else None

    per_rank = [[o for o in _orders(spec.tasks_of(r), fifo=(r == 0 or fifo_all)) if fits(o, r)] for r in range(2)]
    found = [m for pair in itertools.product(*per_rank) if (m := makespan(pair)) is not None]
    return min(found)


@needs_ortools
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("seed", [0, 3])
def test_the_optimum_is_the_brute_forces(split, seed):
    cfg = _cfg(seed)
    plan = oracle.optimise(cfg, split, time_limit=20, workers=2)
    assert plan.optimal
    # Whole microseconds in the solver: the replayed plan is within rounding of the float optimum.
    assert plan.makespan == pytest.approx(_brute_force(cfg, split), abs=20e-6)
    assert all(p <= b for p, b in zip(plan.peak_bytes, cfg.memory_budgets()))


@needs_ortools
def test_no_hint_beats_the_optimum():
    cfg = SimConfig(n_ranks=3, n_microbatches=6, costs=CostModel.uniform(1, 0.010, 0.020, act_bytes=MIB),
                    jitter=LEVELS["J2"], seed=1, limit=6, memory_budget="1f1b")
    best = min(oracle.optimise(cfg, sp, time_limit=30).makespan for sp in (False, True))
    for hint in ("strict-1f1b", "strict-split", "bf", "bfw-mem", "wfloat"):
        assert run_one(cfg, hint)[1].makespan >= best * (1 - 1e-6), hint


def test_bad_options_are_one_line_errors(capsys):
    assert oracle.main(["--layouts", "3v"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --layouts '3v': expected 1, 2, 2loop or 2v"
    assert oracle.main(["--scenarios", "J9"]) == 2
    assert "--scenarios 'J9': expected some of J0" in capsys.readouterr().err
    assert oracle.parse_layouts("2") == [(2, "loop"), (2, "v")]


def test_the_section_names_its_heading_load_and_date():
    from rrfp.sim import suite

    row = suite.SuiteRow("J1", 4, 1, "1f1b", "strict-1f1b", seed=0, auto_choice="strict-split",
                         candidates=("strict-split", "strict-1f1b"),
                         makespan={"strict-1f1b": 0.64, "strict-split": 0.60, "auto": 0.60})
    plan = oracle.Plan(True, 0.57, 0.57, True, [], 1.0)
    pt = oracle.OraclePoint(row, oracle.Plan(False, 0.62, 0.62, True, [], 1.0), plan)
    text = oracle.markdown([pt], "python -m benchmarks.oracle --layouts 1", 2.0, title="one stage per rank",
                           measured=oracle.measured_line([3.0, 1.5, 2.25], "2026-12-05, 13:40 UTC"))
    lines = text.splitlines()
    assert lines[0] == "## one stage per rank"
    assert lines[2].startswith("Measured on a ") and "at load 1.5-3.0 (2026-12-05, 13:40 UTC)" in lines[2]
    # auto's fraction of the optimum: 0.57 / 0.60; strict-1f1b's 0.57 / 0.64.
    assert "| J1 | 1 | 0 | 0.5700 | split | 0.6200 | 0.5700 | optimal | 1.123x | 0.950 | 0.891 | 0.950 |" in text
    plain = oracle.markdown([pt], "c", 2.0).splitlines()
    assert plain[:2] == [f"## {oracle.TITLE}", ""] and plain[2].startswith("`c` (2 s of wall time")


def test_the_shown_command_leaves_out_where_it_was_written():
    argv = ["--layouts", "2", "--title", "The x's 4-rank points", "--markdown", "/tmp/out.md", "--seeds", "0"]
    assert oracle.shown_command(argv) == 'python -m benchmarks.oracle --layouts 2 --title "The x\'s 4-rank points" --seeds 0'
    assert oracle.shown_command(["--markdown=o.md", "--title", 'a "b" $c']) == 'python -m benchmarks.oracle --title "a \\"b\\" \\$c"'
