"""How held activations slow a rank's tasks (rrfp.sim.held): the count by hand, the factors
read back from runs simulated with known factors, and the calibrated simulation by hand."""

from __future__ import annotations

import json
import math

import pytest

from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.tasks import Task, TaskRecord
from rrfp.sim import held as held_mod
from rrfp.sim.calibration import Calibration
from rrfp.sim.held import Held, held_counts, read_held, record_factors, without_held

# Per rank, forward factors by held count and backward ones (a backward counts its own).
TRUE = Held(forward=((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7), (1.0, 1.2, 1.25, 1.3, 1.35, 1.4, 1.45, 1.5)),
            backward=((1.0, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), (1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3, 1.4)))


def _rec(kind: str, mb: int, start: float, stage: int = 0) -> TaskRecord:
    return TaskRecord(0, 0, Task(stage, kind, mb), start, start + 1.0)


def test_what_a_rank_holds_at_each_tasks_start_by_hand():
    # F0 F1 B0 F2 B1 B2 (1F1B's order on a first stage): a forward counts what is held before
    # it, a backward counts its own too, and a full backward frees its microbatch.
    recs = [_rec("F", 0, 0), _rec("F", 1, 1), _rec("B", 0, 2), _rec("F", 2, 3), _rec("B", 1, 4), _rec("B", 2, 5)]
    assert [h for _, h in held_counts(reversed(recs))] == [0, 1, 2, 1, 2, 1]
    # A split backward frees the microbatch at W, not at I.
    split = [_rec("F", 0, 0), _rec("F", 1, 1), _rec("I", 0, 2), _rec("I", 1, 3), _rec("W", 0, 4), _rec("W", 1, 5)]
    assert [h for _, h in held_counts(split)] == [0, 1, 2, 2, 2, 1]


def _rows(held: Held, steps: int = 8) -> dict[str, list[TaskRecord]]:
    """Three schedules of the same 8 microbatches on 2 ranks, simulated with ``held``'s
    factors: each task's cost differs by step, microbatch and stage."""
    rows = {}
    for hint in ("strict-1f1b", "strict-gpipe", "bf"):
        spec, h, strict = resolve_hint(hint, Placement(2), 8)

        def cost(k, r, t):
            return (1.0 + 0.1 * t.mb + 0.05 * k) * (2.0 if t.kind == "B" else 1.0) * (1 + 0.3 * t.stage)

        res = Calibration(held=held).simulate(spec, h, cost, strict=strict, steps=steps, record=True,
                                              inflight_limit=8)
        rows[hint] = res.records
    return rows


def _relative(fs, base: int) -> list[float]:
    return [f / fs[base] for f in fs[base:]]


def test_factors_are_read_back_from_runs_simulated_with_them(monkeypatch):
    rows = _rows(TRUE)
    # Rank 0's first two forwards start at 0 and 1 held in every order, and its last backward
    # at 1: those counts cannot be told apart from the next, so its factors are relative to
    # 1 held (forward) and 2 (backward); rank 1's forwards move between 0 and 1 held.
    base = {("F", 0): 1, ("F", 1): 0, ("B", 0): 2, ("B", 1): 0}
    monkeypatch.setattr(held_mod, "TRIM", math.inf)  # plain least squares: exact
    got = read_held(rows, 2)
    for (d, r), b in base.items():
        want = (TRUE.forward if d == "F" else TRUE.backward)[r]
        have = (got.forward if d == "F" else got.backward)[r]
        assert len(have) == len(want)
        assert _relative(have, b) == pytest.approx(_relative(want, b), rel=1e-6), (d, r)
        assert have[:b] == pytest.approx([1.0] * b)  # counts it cannot tell apart: as the first it can
    monkeypatch.undo()  # the default trims spikes: within 2% of them here
    got = read_held(rows, 2)
    for (d, r), b in base.items():
        want = (TRUE.forward if d == "F" else TRUE.backward)[r]
        have = (got.forward if d == "F" else got.backward)[r]
        assert _relative(have, b) == pytest.approx(_relative(want, b), rel=0.02), (d, r)


def test_runs_without_a_held_cost_read_factors_of_1_and_a_row_can_be_left_out():
    flat = read_held(_rows(Held(((1.0,), (1.0,)), ((1.0,), (1.0,)))), 2)
    assert all(f == pytest.approx(1.0) for per in (*flat.forward, *flat.backward) for f in per)
    rows = _rows(TRUE)
    # One row left: no task ran at two held counts.
    assert read_held(rows, 2, exclude=["strict-gpipe", "bf"]) is None
    two = read_held(rows, 2, exclude=["bf"])
    assert two is not None and two.forward[1][1] / two.forward[1][0] == pytest.approx(1.2, rel=0.02)


def test_costs_measured_in_place_are_taken_back_to_nothing_held():
    rows = _rows(TRUE, steps=1)
    recs = rows["strict-gpipe"]
    plain = without_held(recs, record_factors(recs, TRUE))
    # Rank 0, step 0: F7 starts with 7 held (x1.7), its cost 1 + 0.1 x 7.
    f7 = next(r for r in plain if r.rank == 0 and r.task == Task(0, "F", 7))
    assert f7.end - f7.start == pytest.approx(1.7)
    # Rank 1's B0 (stage 1): 8 held, its own counted (x1.4); cost 2 x 1.3.
    b0 = next(r for r in plain if r.rank == 1 and r.task == Task(1, "B", 0))
    assert b0.end - b0.start == pytest.approx(2.6)


def test_the_calibrated_simulation_applies_the_factors_by_hand():
    # 2 ranks, 2 microbatches, GPipe's order strictly (F 1 s, B 2 s). Rank 0's second forward
    # starts with one held (x2); rank 1's first backward with both held (x1.5), its second
    # with its own (x1). Rank 0: F0 0-1, F1 1-3. Rank 1: F0 1-2, F1 3-4, B1... in GPipe's
    # order B0 4-7, B1 7-9. Rank 0: B0 7-9, B1 9-11.
    spec, h, strict = resolve_hint("strict-gpipe", Placement(2), 2)
    cost = {"F": 1.0, "B": 2.0}
    held = Held(forward=((1.0, 2.0), (1.0,)), backward=((1.0,), (1.0, 1.0, 1.5)))
    res = Calibration(held=held).simulate(spec, h, lambda k, r, t: cost[t.kind], strict=strict)
    assert res.makespan == pytest.approx(11.0)
    assert Calibration().simulate(spec, h, lambda k, r, t: cost[t.kind], strict=strict).makespan == pytest.approx(9.0)
    # Only the CPU part grows: half of each task waited (a sleep), so F1 of rank 0 takes 1.5 s.
    half = Calibration(held=held).simulate(spec, h, lambda k, r, t: cost[t.kind], strict=strict,
                                           cpu=lambda k, r, t: cost[t.kind] / 2, record=True)
    f1 = next(r for r in half.records if r.rank == 0 and r.task == Task(0, "F", 1))
    assert f1.end - f1.start == pytest.approx(1.5)


def test_held_factors_travel_in_a_calibration_file_and_bad_ones_are_refused():
    cal = Calibration(task=0.001, held=TRUE)
    back = Calibration.from_mapping(json.loads(json.dumps(cal.to_mapping())))
    assert back == cal and "held activations slow a task by up to 1.70x" in back.describe()
    with pytest.raises(ValueError, match=r"^run\.json: held: held forward\[0\] factor 0: expected a finite number above 0$"):
        Calibration.from_mapping({"held": {"forward": [[1.0, 0]], "backward": [[1.0]]}}, "run.json")
    with pytest.raises(ValueError, match=r"^run\.json: held: expected an object of backward and forward factors"):
        Calibration.from_mapping({"held": [1.0]}, "run.json")
    with pytest.raises(ValueError, match=r"^held: 2 ranks of forward factors, 1 of backward$"):
        Held(((1.0,), (1.0,)), ((1.0,),))
    with pytest.raises(ValueError, match=r"^calibration held=\(1\.0,\): expected per rank forward and backward"):
        Calibration(held=(1.0,))


def test_a_recorded_2_rank_runs_rows_are_reproduced_within_5_percent_with_held_factors():
    """``rrfp bench --compare --settings compute2`` as recorded on this 2-core machine (2 ranks,
    real CPU compute): with the factors each row's prediction reads off the other rows
    (benchmarks.report_peers), every rrfp row's median step is within 5% of the simulated one;
    without them the readiness rows that hold more (the default at GPipe's memory) are not."""
    from pathlib import Path

    import numpy as np

    from benchmarks import report_fit, report_peers, sim_pred

    res = json.loads((Path(__file__).parent / "data" / "calibration_run_compute2.json").read_text())
    assert res["cores"] == 2 and res["config"]["n_ranks"] == 2  # a core per rank: the factors apply
    worst = {}
    for name, s in report_fit.check(res).items():
        rows = [n for n in s["names"] if n.startswith("rrfp ") and s["predicted"].get(n)]
        assert len(rows) == 5
        worst[name] = max(abs(float(np.median(np.asarray(s["steps"][n]) / np.asarray(s["predicted"][n]))) - 1)
                          for n in rows)
    assert max(worst.values()) <= 0.05, worst
    # The model of the default row reads its factors off the four other rows, not its own.
    ph = res["phases"][1]
    by = report_peers.ByBackward(res, 1, ph)
    kept = ph["kept"]["rrfp default"]
    loo = by(kept, "rrfp default").calibration.held
    assert loo is not None and loo != by(kept).calibration.held
    # Without held factors (the model before them): the variable-length default row misses.
    plain = report_peers.ByBackward(res, 1, ph, held=None)
    assert plain(kept).calibration.held is None
    real = np.asarray([r["systems"]["rrfp default"]["step"] for r in ph["rounds"] if r["kind"] == "timed"])
    sim = sim_pred.predict(res["config"], res["calibration"], 1, ph, kept, model=plain(kept))
    assert float(np.median(real / np.asarray(sim))) > 1.05
