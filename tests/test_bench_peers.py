"""The zero-bubble peers and the many-rank rows of the benchmarks: PyTorch's action lists as
strict rrfp hints, the simulator's prediction with the run's own injected delays, the targets'
verdicts, and one tiny real run of the three zero-bubble schedules beside rrfp."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import compare, report_peers, sim_pred  # noqa: E402
from benchmarks.harness import Injector  # noqa: E402
from benchmarks.systems import PEERS, peer_default, peer_strict, torch_order_hint, virtual_stage_ids  # noqa: E402
from rrfp.scheduler import SCHEDULES, Placement, PipelineSpec, format_orders, resolve_hint, validate_schedule  # noqa: E402
from rrfp.sim.engine import simulate  # noqa: E402
from rrfp.sim.jitter import LEVELS  # noqa: E402


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 7)])
def test_pytorchs_action_lists_as_strict_hints(p, m):
    """DualPipeV's and ZBV's lists read from PyTorch equal rrfp's own orders; InterleavedZB's
    (2 virtual stages, which rrfp has no named order for) is a valid strict schedule."""
    def text(name):
        spec = PipelineSpec(Placement(p, 2, "v"), m, True)
        return "strict-order:" + " | ".join(format_orders(SCHEDULES[name](spec)).splitlines())

    if m >= 2 * p:
        assert torch_order_hint("torch-order:ScheduleDualPipeV", p, m) == text("dualpipev")
    assert torch_order_hint("torch-order:ScheduleZBVZeroBubble", p, m) == text("zb-v")
    if m % max(1, m // p) == 0:
        hint = torch_order_hint("torch-order:ScheduleInterleavedZeroBubble", p, m)
        spec, h, strict = resolve_hint(hint, Placement(p, 2, "loop"), m)
        assert strict and spec.split_backward
        validate_schedule(spec, h.order)
    assert torch_order_hint("strict-zb-v", p, m) == "strict-zb-v"


def test_a_pytorch_order_is_predicted_on_the_model_of_its_backward_form():
    """PyTorch's InterleavedZB order splits its backwards (as the prediction runs it), so its
    strict row is predicted on the split rows' model, not on both forms' (jitter4 J0 on a
    recorded run: 1.058 of the simulated, 1.003 on the split rows'); an unknown class or hint is
    unresolved, None."""
    cfg = {"n_ranks": 4, "n_microbatches": 16}
    assert report_peers.splits("torch-order:ScheduleInterleavedZeroBubble", cfg, 2, "loop") is True
    assert report_peers.splits("strict-interleaved-1f1b", cfg, 2, "loop") is False
    assert report_peers.splits("torch-order:NoSuchSchedule", cfg, 2, "loop") is None
    assert report_peers.splits("no-such-hint", cfg) is None


def test_virtual_stage_ids_follow_the_placements():
    assert virtual_stage_ids("loop", 1, 4) == [1, 5] and virtual_stage_ids("v", 1, 4) == [1, 6]


def test_peer_rows_run_side_by_side():
    from benchmarks.systems import PEER_SYSTEMS

    names = [*compare.CORE_SYSTEMS, *PEER_SYSTEMS]
    groups = compare.target_groups(names)
    for label, p in PEERS.items():
        assert [peer_default(label), p["torch"], peer_strict(label)] in groups
        assert compare.RRFP_SYSTEMS[peer_default(label)]["budget_from"] == p["torch"]


def _sleep_cfg(level: str, P: int = 4, M: int = 8) -> tuple[dict, list[dict], dict]:
    cfg = {"n_ranks": P, "n_microbatches": M, "seed": 3, "sleep": {"F": 0.010, "B": 0.020}}
    cal = [{"F": 0.001 * (r + 1), "B": 0.002} for r in range(P)]
    return cfg, cal, {"level": level, "rounds": 3}


def test_prediction_of_balanced_strict_1f1b_is_the_textbook_makespan():
    cfg, _, phase = _sleep_cfg("J0")
    cal = [{"F": 0.0, "B": 0.0}] * 4
    got = sim_pred.predict(cfg, cal, 0, phase, "strict-1f1b")
    assert got == pytest.approx([(8 + 4 - 1) * 0.030] * 3)  # (M + p - 1)(F + B), balanced stages


def test_prediction_uses_the_delays_the_run_injected():
    """Each task of the prediction lasts the rank's calibrated compute plus exactly what the
    harness's Injector sleeps for that (step, rank, microbatch, kind): the same keyed draws."""
    cfg, cal, phase = _sleep_cfg("J2")
    got = sim_pred.predict(cfg, cal, 1, phase, "bf")
    spec, hint, _ = resolve_hint("bf", Placement(4), 8)
    want = []
    for k in range(2, 5):
        injs = [Injector(LEVELS["J2"], 3, r, cfg["sleep"], base=cfg["sleep"]) for r in range(4)]
        for inj in injs:
            inj.enabled, inj.step = True, 1000 + k

        def dur(step, r, t):
            kind = "F" if t.kind == "F" else "B"
            return cal[r][kind] + injs[r].delay(t.mb, kind)

        want.append(simulate(spec, hint, dur).makespan)
    assert got == pytest.approx(want)
    assert got != pytest.approx(sim_pred.predict(cfg, cal, 1, {**phase, "level": "J0"}, "bf"))


def test_prediction_at_a_memory_budget_holds_fewer_microbatches():
    cfg, cal, phase = _sleep_cfg("J0", P=2, M=8)
    free = sim_pred.predict(cfg, cal, 0, phase, "bf", n_virtual=2, placement="v")
    tight = sim_pred.predict(cfg, cal, 0, phase, "bf", n_virtual=2, placement="v", budgets=[100, 100],
                             stage_bytes=[[50, 50], [50, 50]])
    assert min(tight) > max(free)  # at most two microbatches' activations per rank: a slower step


def _phase(name, level, times, peaks):
    rounds = [{"round": 1, "kind": "memory", "systems": {n: {"step": 1.0, "peak_bytes": peaks.get(n, [1.0])}
                                                          for n in times}}]
    n_rounds = len(next(iter(times.values())))
    rounds += [{"round": 2 + i, "kind": "timed", "systems": {n: {"step": t[i]} for n, t in times.items()}}
               for i in range(n_rounds)]
    return {"name": name, "level": level, "rounds": rounds}


def test_peer_targets_use_the_memory_aware_ceiling_where_it_is_lower():
    d, t, s = peer_default("ZBV"), "torch ZBV", peer_strict("ZBV")
    bound = report_peers.BOUND + "ZBV"
    times = {d: [1.0, 1.0, 1.0], t: [1.05, 1.05, 1.05], s: [1.02, 1.02, 1.02]}
    res = {"config": {"n_ranks": 4}, "phases": [_phase("J2", "J2", times, {t: [2048.0] * 4})],
           "predicted": {"J2": {d: [1.0] * 3, s: [1.0] * 3, bound: [1.0] * 3}}}
    table, targets = report_peers.peer_rows({"jitter4": res})
    assert table[0][2] == "ZBV" and table[0][3].startswith("1.05x") and table[0][7] == "2 2 2 2"
    assert table[0][9] == "1.00x" and table[0][10] == "1.00x"  # ideal and ceiling: the order over each
    assert targets[0][2] == "met" and "0.95 x the memory-aware ceiling 1.00x" in targets[0][0]  # 1.05 >= 0.95
    # The default hint's own simulated gain is 1.00x, but some schedule at that memory could
    # reach 1.20x: the 1.10x goal holds.
    res["predicted"]["J2"].update({s: [1.2] * 3, d: [1.2] * 3})
    table, targets = report_peers.peer_rows({"jitter4": res})
    assert table[0][9] == "1.00x" and table[0][10] == "1.20x"
    assert targets[0][2] == "**missed**" and ">= 1.10x" in targets[0][0] and "ceiling 1.20x" in targets[0][3]


def test_memory_aware_bound_of_a_prediction():
    """At 1F1B's memory with one stage per rank and balanced stages the bound is strict 1F1B's
    own makespan, (M + p - 1)(F + B) (rrfp.sim.metrics.memory_bound's docstring); on the V
    placement a budget of one microbatch per stage raises the bound above the memory-blind one."""
    cfg, _, phase = _sleep_cfg("J0")
    cal = [{"F": 0.0, "B": 0.0}] * 4
    one = [[1]] * 4
    steps, bounds = sim_pred.predict_bounded(cfg, cal, 0, phase, "strict-1f1b", bound_budgets=[4, 3, 2, 1],
                                             stage_bytes=one)
    assert steps == pytest.approx([(8 + 4 - 1) * 0.030] * 3) and bounds == pytest.approx(steps)
    v = dict(n_virtual=2, placement="v", stage_bytes=[[1, 1]] * 4)
    _, loose = sim_pred.predict_bounded(cfg, cal, 0, phase, "strict-zb-v", bound_budgets=[64] * 4, **v)
    _, tight = sim_pred.predict_bounded(cfg, cal, 0, phase, "strict-zb-v", bound_budgets=[1] * 4, **v)
    assert min(tight) > max(loose)
    free = sim_pred.predict(cfg, cal, 0, phase, "bf", n_virtual=2, placement="v")
    assert all(b <= f + 1e-12 for b, f in zip(loose, free))  # a lower bound on any schedule


def test_many_rank_targets_compare_real_with_simulated():
    a, b = "rrfp default", "rrfp strict-1f1b"
    times = {a: [1.04, 1.05], b: [1.2, 1.2]}
    res = {"config": {"n_ranks": 16, "sleep": {"F": 0.01, "B": 0.02}}, "default_hint": "bf",
           "phases": [_phase("J2", "J2", times, {})], "predicted": {"J2": {a: [1.0, 1.0], b: [1.0, 1.0]}}}
    table, targets = report_peers.ranks_rows({"ranks16": res})
    verdicts = {row[2]: row[-1] for row in table}
    assert verdicts == {a: "met", b: "**missed**"}  # 4.5% off is within 5%, 20% is not
    assert targets[-1][2] == "**missed**" and targets[-1][3] == "1.00x"  # real 1.15x vs simulated 1.00x


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_bubble_schedules_run_beside_rrfp_at_their_own_memory():
    """A tiny jitter4 in real processes with the virtual-stage schedules: gradients equal
    (checked in the run), each rrfp row at a schedule's memory got the bytes that schedule
    measured on its rank, and the report renders every row with a prediction."""
    from rrfp.scheduler.schedules import SCHEDULES  # noqa: F401 - the dualpipev order exists

    systems = [n for label in PEERS for n in (peer_default(label), PEERS[label]["torch"], peer_strict(label))]
    cfg = compare.setting_config("jitter4", quick=True, systems=systems)
    res = compare.run_setting(cfg, timeout=280)
    ph = res["phases"][0]
    assert ph["worst_grad_ratio"] <= 1.0 and len(ph["rounds"][0]["systems"]) == 3 * len(PEERS)
    res["predicted"] = report_peers.predictions(res)
    table, targets = report_peers.peer_rows({"jitter4": res})
    assert [row[2] for row in table] == ["Interleaved1F1B", "InterleavedZB", "ZBV", "DualPipeV"]
    assert len(targets) == 3  # the zero-bubble schedules carry the targets
    mem = ph["rounds"][1]["systems"]
    for label, p in PEERS.items():
        assert all(x > 0 for x in mem[p["torch"]]["peak_bytes"])
        assert len(res["predicted"][ph["name"]][peer_default(label)]) == len(ph["rounds"]) - 2
    assert np.isfinite([float(r[9][:-1]) for r in table]).all()
    # The memory-aware ceiling: never below the default hint's simulated gain at those bytes.
    assert all(float(r[10][:-1]) >= float(r[9][:-1]) - 0.005 for r in table)


def test_calibration_targets_set_every_real_row_beside_the_calibrated_simulator():
    """The report's issue-33 rows for the settings whose predictions ran on the calibrated
    model: each rrfp row's real step within 5% of the simulated one, its speedup over strict
    1F1B within 0.05 of the simulated one; PyTorch rows and sleeping settings are not judged here."""
    from benchmarks import report
    from benchmarks.harness import paired_speedup

    a, b, t = "rrfp default", "rrfp strict-1f1b", "torch 1F1B"
    steps = {a: [1.04, 1.04], b: [1.2, 1.2], t: [9.0, 9.0]}
    s = {"names": list(steps), "steps": steps, "calibrated": True,
         "speedup": {x: {y: paired_speedup(steps[x], steps[y]) for y in steps} for x in steps},
         "predicted": {a: [1.0, 1.0], b: [1.1, 1.1], t: [1.1, 1.1]}}
    rows = report.calibration_targets({"jitter4": {"J2": s}})
    assert [r[2] for r in rows] == ["**missed**", "**missed**"]
    assert rows[0][1].startswith("1 of 2 rows; real / simulated 1.040-1.091")  # 1.2 / 1.1 is 9% off
    assert rows[1][1].startswith("0 of 1 rows; real - simulated +0.054")  # 1.2/1.04 - 1.1/1.0
    assert report.simulated_speedup(s, a, t) == pytest.approx(1.1)
    s["predicted"][b] = [1.17, 1.17]
    rows = report.calibration_targets({"jitter4": {"J2": s}})
    assert [r[2] for r in rows] == ["met", "met"]
    assert report.calibration_targets({"ranks8": {"J2": {**s, "sleep": True}}}) == []
    assert report.calibration_targets({"jitter4": {"J2": {**s, "calibrated": False}}}) == []


def test_bytes_a_budget_row_held_replayed_from_its_records_by_hand():
    """``report_fit --memory``: a V row's held bytes and microbatches in flight per rank, by the
    ledger's rule on each rank's recorded order. Rank 1 (stages 1, 2 at 100 and 30 bytes, full
    backward): F1m0 F2m0 F1m1 B2m0 B1m0 F2m1 B2m1 B1m1 holds 100 130 230 200 100 130 100 0, at
    most 230 with 2 in flight. Rank 0 (stages 0, 3 at 50 and 70, split, W's bytes unknown: all
    held until W): F0m0 F3m0 I3m0 W3m0 I0m0 W0m0 holds 50 120 120 50 50 0, at most 120, 1 in
    flight."""
    from benchmarks import report_fit

    def rec(rank, acts):
        return {"rank": rank, "tasks": [[int(a[0]), a[1], int(a[2:]), float(i), float(i) + 0.5] for i, a in enumerate(acts)]}

    step = [rec(0, ["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"]),
            rec(1, ["1F0", "2F0", "1F1", "2B0", "1B0", "2F1", "2B1", "1B1"])]
    sb = [[50, 70], [100, 30]]
    assert report_fit.held_peaks({"2": step}, sb, 2, "v") == [(120, 1), (230, 2)]
    # Another step's lower peak does not lower the most.
    small = [rec(0, ["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"]), rec(1, ["1F0", "2F0", "2B0", "1B0"])]
    assert report_fit.held_peaks({"2": step, "3": small}, sb, 2, "v") == [(120, 1), (230, 2)]
    # In KiB beside budgets of 200 and 300 KiB (PyTorch ZBV's peaks in the memory round).
    ph = {"name": "J0", "recorded": {peer_default("ZBV"): {"2": step}},
          "rounds": [{"round": 1, "kind": "memory", "systems": {"torch ZBV": {"peak_bytes": [200 * 1024, 300 * 1024]}}}]}
    res = {"phases": [ph], "virtual_stage_bytes": [{"v": [b * 1024 for b in row]} for row in sb]}
    assert report_fit.memory_lines(res) == [
        f"J0, {peer_default('ZBV')}: per rank budget / held at most (ratio) / in flight at most: "
        "200 / 120 KiB (0.600) / 1; 300 / 230 KiB (0.767) / 2"]
