"""The ``--sim-targets`` part of ``rrfp bench``: the simulator and training targets in
the generated report (benchmarks/sim_targets.py)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import run_all, sim_targets  # noqa: E402


def _speed(wall: float) -> dict:
    return {"ranks": 128, "virtual": 2, "microbatches": 1024, "hint": "bf", "wall_s": wall, "cpu_s": wall,
            "walls": [wall, wall + 1], "loadavg": 1.0}


def _train(wall: float, first: float, last: float) -> dict:
    return {"wall_s": wall, "steps": 40, "first": first, "last": last, "fall": 1 - last / first, "quick": False}


@pytest.mark.parametrize("wall,verdict", [(2.49, "met"), (2.51, "**missed**")])
def test_simulator_speed_verdict_is_the_issues_bound(wall, verdict):
    rows = sim_targets.target_rows({"speed": _speed(wall), "quick": False})
    assert len(rows) == 1 and rows[0][2] == verdict
    assert f"{wall:.2f} s wall" in rows[0][1]


@pytest.mark.parametrize("wall,first,last,verdict", [
    (299.0, 5.0, 3.45, "met"),          # -31%
    (299.0, 5.0, 3.55, "**missed**"),   # -29%
    (301.0, 5.0, 1.0, "**missed**"),    # over 5 minutes
])
def test_training_run_verdict_needs_both_time_and_loss_fall(wall, first, last, verdict):
    rows = sim_targets.target_rows({"train": _train(wall, first, last), "quick": False})
    assert rows[0][2] == verdict
    assert f"loss {first:.4f} -> {last:.4f} ({-100 * (1 - last / first):+.1f}%)" in rows[0][1]


def test_quick_figures_carry_no_verdict():
    rows = sim_targets.target_rows({"speed": _speed(0.01), "train": _train(20, 5, 1), "quick": True})
    assert [r[2] for r in rows] == ["- (quick)", "- (quick)"]


@pytest.mark.slow
def test_suite_part_judges_the_default_and_the_best_hint():
    """The best hint is the one with the highest median at 1F1B's memory over the variable
    scenarios, computed here from an independent run of the same (quick) suite."""
    from rrfp.scheduler.hints import DEFAULT_HINT
    from rrfp.sim import suite

    res = sim_targets.run_suite_part(quick=True)
    hints = list(dict.fromkeys([*suite.SUITE_HINTS, DEFAULT_HINT]))
    rows = suite.run_suite(hints, scenarios=("J0", "J2"), ranks=(4,), seeds=(0,))
    med = {h: statistics.median(r.speedup(h) for r in rows if r.memory == "1f1b" and r.scenario == "J2")
           for h in rows[0].makespan if all(h in r.makespan for r in rows)}
    assert res["default"] == suite.SUITE_HINTS[0] == "auto"
    assert med[res["best"]] == max(med.values())
    assert res["targets"]["auto"] == [list(t) for t in suite.suite_targets(rows, "auto")]
    assert res["points"] == len(rows) == 2 * 3 * 2


def test_training_run_reads_the_loss_file_and_names_a_failure(tmp_path, monkeypatch):
    """The training part reads ``<step> <float.hex>`` lines; a failed run is an error naming its
    exit status and last line, not a figure."""
    script = tmp_path / "fake_train.py"
    script.write_text(
        "import sys\n"
        "path = sys.argv[sys.argv.index('--loss-file') + 1]\n"
        "open(path, 'w').write(f'1 {(5.5).hex()}\\n2 {(2.75).hex()}\\n')\n"
    )
    monkeypatch.setattr(sim_targets, "TRAIN_COMMAND", [sys.executable, str(script)])
    res = sim_targets.run_multimodal_train(quick=False, timeout=60)
    assert (res["steps"], res["first"], res["last"], res["fall"]) == (2, 5.5, 2.75, 0.5)
    script.write_text("import sys\nprint('rank 1 failed: boom', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"exited 3: rank 1 failed: boom"):
        sim_targets.run_multimodal_train(quick=False, timeout=60)


def test_command_line_names_the_part():
    args = run_all.build_parser().parse_args(["--sim-targets", "--quick"])
    assert run_all._command(args) == "rrfp bench --sim-targets --quick"


@pytest.mark.parametrize("measured,ideal,verdict", [
    (1.02, 1.02, "**missed** (out of reach of the ideal, 1.02x)"),  # the ideal is below the goal
    (1.10, 1.20, "**missed**"),                                      # the ideal reaches the goal
    (1.16, 1.02, "met"),
])
def test_a_real_target_beyond_the_ideal_says_so(measured, ideal, verdict):
    """Issue 13: where a target is out of reach of the simulator's ideal, the report says so."""
    from benchmarks import report

    steps_torch = [1.0 * measured] * 4
    s = {"names": [report.R1, report.T1], "speedup": {report.R1: {report.T1: measured}},
         "steps": {report.R1: [1.0] * 4, report.T1: steps_torch}}
    rows = report.targets({"jitter4": {"J2": s}}, None, {"jitter4": {"J2": {"1f1b": ideal}}})
    assert rows[0][0].startswith("4 ranks, J2, at 1F1B's memory") and rows[0][2] == verdict
    assert rows[0][3] == f"{ideal:.2f}x"
