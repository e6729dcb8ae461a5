"""Smoke tests of the benchmarks (benchmarks/): the jitter wrapper, the meters, the launcher,
a tiny comparison in real processes, and the ``rrfp bench`` command line. Fast: the real
benchmark runs with ``rrfp bench --all``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import compare, harness, launcher, micro  # noqa: E402
from benchmarks.harness import ActivationMeter, BenchError, Injector, JitterStage  # noqa: E402
from rrfp.sim.jitter import LEVELS  # noqa: E402


def test_injected_delays_depend_on_the_microbatch_not_the_order(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(harness.time, "sleep", sleeps.append)
    inj = Injector(LEVELS["J3"], seed=1, stage=2, e={"F": 0.001, "B": 0.002})
    inj.enabled, inj.step = True, 5

    def delays(stage: JitterStage, order) -> dict[int, list[float]]:
        got = {}
        for m in order:
            sleeps.clear()
            y, mb = stage(torch.randn(2, 3, requires_grad=True), torch.full((2,), m))
            assert int(mb[0]) == m
            y.sum().backward()
            got[m] = list(sleeps)
        return got

    stage = JitterStage(nn.Linear(3, 3), inj, 1.0, ActivationMeter(), last=False)
    forward_order = delays(stage, range(8))
    assert forward_order == delays(stage, reversed(range(8)))
    assert any(forward_order.values()), "J3 over 16 draws should inject something"
    # Two virtual stages with half shares inject the rank's whole delay between them.
    inj.reset()
    half = JitterStage(nn.Linear(3, 3), inj, 0.5, ActivationMeter(), last=False)
    for m in range(8):
        for _ in range(2):
            y, _mb = half(torch.randn(2, 3, requires_grad=True), torch.full((2,), m))
            y.sum().backward()
    assert abs(inj.total - sum(map(sum, forward_order.values()))) < 1e-12


def test_backward_delay_sleeps_in_backward(monkeypatch):
    events: list = []
    monkeypatch.setattr(harness.time, "sleep", lambda s: events.append(("sleep", s)))
    inj = Injector(LEVELS["J0"], 0, 0, {"F": 0.0, "B": 0.0})
    x = torch.randn(4, requires_grad=True)
    y = harness.SleepInBackward.apply(x * 2, 0.25)
    assert not y._is_view()
    events.append("forward done")
    y.sum().backward()
    assert events == ["forward done", ("sleep", 0.25)]
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    assert inj.delay(0, "F") == 0.0


def _recorded_stage(monkeypatch, base):
    """A sleep-based stage 1 of 2 (sleeps recorded by phase, no clock) and the simulator's
    duration model of the same costs, seed and jitter level (every draw a hit)."""
    from rrfp.sim.costs import CostModel, StageCost
    from rrfp.sim.duration import DurationModel
    from rrfp.sim.jitter import JitterLevel

    slept: list[tuple[str, float]] = []
    phase = ["F"]
    monkeypatch.setattr(harness.time, "sleep", lambda s: slept.append((phase[0], s)))
    level = JitterLevel("always", 1.0, 0.010, 1.0)
    inj = Injector(level, seed=3, stage=1, e={"F": base["F"], "B": base["B"]}, base=base)
    inj.enabled, inj.step = True, 7
    stage = JitterStage(nn.Linear(3, 3), inj, 1.0, ActivationMeter(), last=False, stage=1)
    sim = DurationModel(CostModel((StageCost.from_mapping(base),) * 2), seed=3, jitter=level)
    return stage, sim, slept, phase


@pytest.mark.parametrize("system", ["rrfp", "torch"])
def test_split_backward_sleeps_the_simulators_i_and_w_in_i_and_w(monkeypatch, system):
    # Issue 33: I and W of one split microbatch sleep what the simulator gives them (the
    # backward's draw shared in proportion to I : W, its sleep too), I's share in the
    # input-gradient task and W's in the weight-gradient task; rrfp's runtime split
    # (enable_split_backward, deferring, run_backward, flush) and PyTorch's (its input and
    # weight passes). Asserted on the recorded sleeps, not on a clock.
    from rrfp.runtime.engine.compute import run_backward
    from rrfp.runtime.engine.split import WeightGradStore, deferring, enable_split_backward
    from rrfp.scheduler.tasks import Task

    base = {"F": 0.010, "B": 0.020, "I": 0.008, "W": 0.012}
    stage, sim, slept, phase = _recorded_stage(monkeypatch, base)
    ref = nn.Linear(3, 3)
    ref.load_state_dict(stage.inner.state_dict())
    if system == "rrfp":
        enable_split_backward(stage)
    for m in (0, 5):
        slept.clear()
        stage.zero_grad(set_to_none=True)
        phase[0] = "F"
        x = torch.randn(2, 3, requires_grad=True)
        y, _ = stage(x, torch.full((2,), m))
        g = torch.randn_like(y)
        phase[0] = "I"
        if system == "rrfp":
            store = WeightGradStore()
            with deferring(store, stage):
                run_backward([y], [g])
            phase[0] = "W"
            store.flush()
        else:
            from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

            _, groups = stage_backward_input([y], [g], [x], stage.parameters())
            phase[0] = "W"
            stage_backward_weight(stage.parameters(), groups)
        want = {k: sim(7, 1, Task(1, k, m)) for k in "FIW"}
        assert want["I"] > base["I"] and want["W"] > base["W"]  # a hit, shared
        assert [p for p, _ in slept] == ["F", "I", "W"]
        for p, s in slept:
            assert s == pytest.approx(want[p], rel=1e-12), p
        # The gradients are the model's own (the carrier adds 0.0).
        ref.zero_grad()
        ref(x.detach()).backward(g)
        assert torch.allclose(stage.inner.weight.grad, ref.weight.grad, atol=1e-6)
        assert float(stage.carrier.grad) == 0.0


def test_full_backward_sleeps_both_shares_in_b(monkeypatch):
    from rrfp.scheduler.tasks import Task

    base = {"F": 0.010, "B": 0.020}
    stage, sim, slept, phase = _recorded_stage(monkeypatch, base)
    y, _ = stage(torch.randn(2, 3, requires_grad=True), torch.full((2,), 4))
    phase[0] = "B"
    y.sum().backward()
    got = sum(s for p, s in slept if p == "B")
    assert len([p for p, _ in slept if p == "B"]) == 2  # I's share on the output path, W's on the carrier's
    assert got == pytest.approx(sim(7, 1, Task(1, "B", 4)), rel=1e-12)


def test_activation_meter_counts_saved_tensors_until_backward():
    meter = ActivationMeter()
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    meter.exclude(list(mlp.parameters()))
    x = torch.randn(32, 64, requires_grad=True)
    with meter.hooks():
        y = mlp(x)
    held = meter.current
    # The input (32x64), the first linear's output and the GELU's output (32x256 each), fp32.
    assert held >= 4 * (32 * 64 + 2 * 32 * 256)
    y.sum().backward()
    del y
    assert meter.current == 0
    assert meter.peak == held


def test_statistics_and_gradient_check():
    s = harness.summarize([3.0, 1.0, 2.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert harness.paired_speedup([1.0, 2.0, 1.0], [2.0, 2.0, 3.0]) == 2.0
    model = compare.GPT(compare.GPTConfig(n_layer=2, n_head=2, d_model=8, max_len=8))
    index = compare.GradIndex(model)
    ref = torch.randn(index.total)
    assert compare.check_close(ref.clone(), ref, "same", index) == 0.0
    bad = ref.clone()
    i = index.offsets["blocks.1.mlp.fc.weight"][0] + 3
    bad[i] += 1e-3 + 1e-4 * abs(float(ref[i]))
    with pytest.raises(BenchError, match=r"blocks\.1\.mlp\.fc\.weight"):
        compare.check_close(bad, ref, "perturbed", index)


def test_arbiter_micro_benchmark_runs():
    r = micro.arbiter_cycle_us("bf", 32, cycles=200, repeats=1)
    assert 0 < r["median"] < 1000
    r = micro.arbiter_cycle_us("1f1b", 8, cycles=200, repeats=1)
    assert 0 < r["median"] < 1000


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_launcher_kills_ranks_on_timeout_and_reports_failures():
    with pytest.raises(BenchError, match="timed out"):
        launcher.launch("benchmarks.launcher:idle", 2, {"seconds": 600}, timeout=6)
    # A failing rank is reported at once and the idle one is killed, before the timeout: the
    # launcher says "exited with code 1", not "timed out" (50 s is only a deadline for a hang).
    with pytest.raises(BenchError, match="rank 1 exited with code 1") as err:
        launcher.launch("benchmarks.launcher:idle", 2, {"seconds": 600, "fail_rank": 1}, timeout=50)
    assert "failing on purpose" in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_comparison_runs_every_system_with_equal_gradients():
    # With a default row: auto (Pipeline's default) measures and tries after the memory round,
    # then its timed rounds run the hint it kept, named per phase.
    from rrfp.sim.auto import known_candidates

    systems = [*compare.LEGACY_SYSTEMS, "rrfp default, 1F1B memory"]
    cfg = compare.setting_config("compute2", quick=True, systems=systems)
    cfg.update(model={"n_layer": 4, "n_head": 2, "d_model": 16}, seq_len=16, batch_size=8, n_microbatches=4,
               phases=[{"name": "J2", "level": "J2", "varlen": False, "rounds": 1},
                       {"name": "variable length", "level": "J0", "varlen": True, "rounds": 1}])
    res = compare.run_setting(cfg, timeout=100)
    assert [ph["name"] for ph in res["phases"]] == ["J2", "variable length"]
    for ph in res["phases"]:
        assert ph["worst_grad_ratio"] <= 1.0
        assert [r["kind"] for r in ph["rounds"]] == ["warmup", "memory", "timed"]
        timed = ph["rounds"][-1]["systems"]
        assert set(timed) == set(systems)
        assert list(ph["kept"]) == ["rrfp default, 1F1B memory"]
        assert ph["kept"]["rrfp default, 1F1B memory"] in known_candidates(2, 1, "loop", 4)[0]
        for name, rec in timed.items():
            assert rec["step"] > 0, name
            assert all(b > 0 for b in ph["rounds"][1]["systems"][name]["peak_bytes"]), name
        injected = {n: sum(rec["injected"]) for n, rec in timed.items()}
        assert max(injected.values()) - min(injected.values()) < 1e-9
    from benchmarks.report import render_setting

    text, summaries = render_setting(res)
    assert "rrfp bf" in text and "torch InterleavedZB" in text
    assert summaries["J2"]["fastest_torch"].startswith("torch")


@pytest.mark.slow
def test_rrfp_bench_bad_input_is_a_usage_error(capfd):
    from rrfp.cli import main

    assert main(["bench", "--settings", "nope"]) == 2
    assert "--settings 'nope'" in capfd.readouterr().err
    assert main(["bench", "--rounds", "0"]) == 2
    assert main(["bench", "--hint", "nope"]) == 2
    assert "--hint 'nope': unknown hint" in capfd.readouterr().err
    assert main(["bench", "--candidates", "bfw-alt-df,nope"]) == 2
    assert "--candidates 'nope': unknown hint" in capfd.readouterr().err
    for bad in ("nan", "inf", "-1", "0", "1e300"):
        capfd.readouterr()
        assert main(["bench", "--timeout", bad]) == 2
        err = capfd.readouterr().err
        assert err.startswith(f"rrfp bench: error: --timeout {float(bad)}: expected a positive number") and err.count("\n") == 1
    assert main(["bench", "--out", "/no/such/dir/x.md"]) == 2
    assert main(["bench", "--from-json", "/no/such/results.json"]) == 2
    assert "--from-json /no/such/results.json: no such file" in capfd.readouterr().err


def test_a_damaged_raw_results_file_is_one_line_not_a_traceback(tmp_path, capfd, monkeypatch):
    """A phase without its rounds (a damaged or hand-edited ``--json`` file): the report's peer
    table reads ``rounds[0]`` (report_peers.peer_rows), an IndexError that escaped as a traceback
    (exit 1) while every other damage was one line (exit 2)."""
    from benchmarks import run_all

    def first_rounds(results, args, command=None):  # what peer_rows reads first, alone
        return str([ph["rounds"][0] for res in results["compare"].values() for ph in res["phases"]])

    monkeypatch.setattr(run_all, "render", first_rounds)
    raw = tmp_path / "results.json"
    raw.write_text(__import__("json").dumps({"compare": {"jitter4": {"phases": [{"name": "J2", "rounds": []}]}},
                                             "quick": True, "micro": None, "errors": []}))
    capfd.readouterr()
    assert run_all.rerender(run_all.build_parser().parse_args(["--from-json", str(raw)])) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rrfp bench: error: --from-json {raw}: not the raw results"), err
    assert err[0].endswith("(list index out of range)"), err


@pytest.mark.slow
def test_report_renders_again_from_raw_results(tmp_path, capfd):
    """``--from-json`` writes the report of an earlier run without running anything: the same
    text as the run itself would write, and a clear error for a file that is not results."""
    from benchmarks import report, run_all
    from rrfp.cli import main

    results = {"machine": report.machine_info(), "quick": True, "compare": {}, "micro": None, "errors": [],
               "seconds": 12.0, "command": "rrfp bench --micro --quick"}
    raw = tmp_path / "results.json"
    raw.write_text(__import__("json").dumps(results))
    out = tmp_path / "report.md"
    assert main(["bench", "--from-json", str(raw), "--out", str(out)]) == 0
    args = run_all.build_parser().parse_args(["--quick"])
    assert out.read_text() == run_all.render(results, args, command="rrfp bench --micro --quick")
    assert "Generated by `rrfp bench --micro --quick`" in out.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["bench", "--from-json", str(bad)]) == 2
    assert "not the raw results of a benchmark run" in capfd.readouterr().err


def test_overhead_reference_runs_the_pipelines_tasks():
    """The runtime-overhead reference (tasks run by hand) computes what the pipeline computes:
    the same weight gradients on every stage, so it is the same work, minus the runtime."""
    from rrfp.runtime.doors.local import LocalPipeline

    P, M = 3, 5
    ref, n_tasks, stages = micro.sequential_runner(P, M)
    assert n_tasks == 2 * P * M
    mods = [micro.Scale() for _ in range(P)]
    for k in range(P):
        stages[k].w.data.fill_(k + 2.0)
        mods[k].w.data.fill_(k + 2.0)
        stages[k].zero_grad()
    ref()
    with LocalPipeline(mods, M, micro.scalar_loss, hint="bf", watchdog=60) as pipe:
        pipe.step(torch.ones(M, 1), target=torch.ones(M, 1))
    # loss = mean over microbatches of w_0 w_1 w_2 (x = y = 1): dL/dw_k = prod of the others.
    expected = [12.0, 8.0, 6.0]
    assert [st.w.grad.item() for st in stages] == pytest.approx(expected, rel=1e-6)
    assert [m.w.grad.item() for m in mods] == pytest.approx(expected, rel=1e-6)


def test_schedule_budget_is_what_the_schedule_holds():
    """Hand-computed: sizes 1, 2, 3, 4 bytes. 1F1B on rank 0 of 2 runs F0 F1 B0 F2 B1 F3 B2 B3
    (peak 3 + 4 = 7 after F3); on rank 1, F B alternating (peak 4); GPipe holds all (10)."""
    from benchmarks.workloads import schedule_budget

    sizes = [[1, 2, 3, 4]]
    assert schedule_budget("1f1b", 2, 0, sizes) == 7
    assert schedule_budget("1f1b", 2, 1, sizes) == 4
    assert schedule_budget("gpipe", 2, 0, sizes) == 10
    assert schedule_budget("1f1b", 2, 0, [[1, 1, 1, 1], [1, 2, 3, 4]]) == 7  # the worst step


def test_message_delays_are_keyed_and_the_same_for_rrfp(monkeypatch):
    """Two wrapped stages in one process: the forward of stage 1 sleeps until the activation's
    stamp + its keyed delay, the backward of stage 0 until the gradient's stamp + its delay;
    rrfp's inbox hold draws the same delays from the same stamps; gradients are untouched."""
    from types import SimpleNamespace

    from benchmarks import workloads
    from rrfp.transport.keys import Direction, MsgKey

    clock = [100.0]
    sleeps: list[float] = []
    monkeypatch.setattr(workloads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(workloads.time, "sleep", lambda s: sleeps.append(s))
    inj = Injector(LEVELS["J0"], seed=3, stage=0, e={"F": 0.0, "B": 0.0})
    inj.enabled, inj.step = True, 7
    delays = workloads.MessageDelays(LEVELS["J3"], inj)
    hits = [m for m in range(64) if delays.draw(0, m, workloads.F) > 0 and delays.draw(1, m, workloads.B) > 0]
    assert hits, "J3 over 64 draws should delay some microbatch both ways"
    m = hits[0]
    d_f, d_b = delays.draw(0, m, workloads.F), delays.draw(1, m, workloads.B)
    assert d_f >= 0.005 and d_b >= 0.005  # the level's 10 ms floor, times (0.5 + U)
    lin0, lin1 = nn.Linear(3, 3), nn.Linear(3, 1)
    s0 = JitterStage(lin0, inj, 1.0, ActivationMeter(), last=False, stage=0, delays=delays)
    s1 = JitterStage(lin1, inj, 1.0, ActivationMeter(), last=True, stage=1, delays=delays)
    x = torch.randn(2, 3)
    mb = torch.full((2,), m)
    y, mb_out, stamp = s0(x, mb, torch.zeros(2, dtype=torch.float64))
    assert stamp.dtype == torch.float64 and float(stamp.detach()[0]) == 100.0 and stamp.requires_grad
    hold = workloads.rrfp_hold(delays)
    act = SimpleNamespace(key=MsgKey("j", 7, m, 1, Direction.ACT), tensors=[y.detach(), mb_out, stamp.detach()])
    assert hold(act) == pytest.approx(d_f)  # held until 100 + d_f, from t = 100
    clock[0] = 100.001
    y_in = y.detach().requires_grad_()
    stamp_in = stamp.detach().requires_grad_()
    out = s1(y_in, mb_out, stamp_in)
    assert sleeps == [pytest.approx(d_f - 0.001)]
    clock[0] = 100.5
    out.sum().backward()
    assert float(stamp_in.grad[0]) == 100.5  # the gradient message's send time
    grad = SimpleNamespace(key=MsgKey("j", 7, m, 0, Direction.GRAD), tensors=[y_in.grad, None, stamp_in.grad])
    clock[0] = 100.502
    assert hold(grad) == pytest.approx(d_b - 0.002)
    torch.autograd.backward([y, stamp], [y_in.grad, stamp_in.grad])
    assert sleeps[-1] == pytest.approx(d_b - 0.002)
    # The stamps add nothing to the gradients: the same as the plain composition.
    ref0, ref1 = nn.Linear(3, 3), nn.Linear(3, 1)
    ref0.load_state_dict(lin0.state_dict()), ref1.load_state_dict(lin1.state_dict())
    ref1(ref0(x)).sum().backward()
    torch.testing.assert_close(lin0.weight.grad, ref0.weight.grad)
    assert inj.count == 2 and inj.total == pytest.approx(d_f + d_b)


def test_a_v_turn_between_stages_of_one_rank_gets_no_message_delay(monkeypatch):
    """Stages 1 and 2 on one rank (a V placement's turn, ``local_stages``): the activation from 1
    to 2 and the gradient back never leave the rank, so neither waits, as in the simulator; the
    same pair held on two ranks waits for both draws (the J3 draws of the test above)."""
    from benchmarks import workloads

    clock = [100.0]
    monkeypatch.setattr(workloads.time, "monotonic", lambda: clock[0])
    inj = Injector(LEVELS["J0"], seed=3, stage=0, e={"F": 0.0, "B": 0.0})
    inj.enabled, inj.step = True, 7
    delays = workloads.MessageDelays(LEVELS["J3"], inj)
    m = next(m for m in range(64) if delays.draw(1, m, workloads.F) > 0 and delays.draw(2, m, workloads.B) > 0)
    d_f, d_b = delays.draw(1, m, workloads.F), delays.draw(2, m, workloads.B)
    for local, want in ((frozenset({1, 2}), []), (frozenset({1}), [d_f, d_b])):
        sleeps: list[float] = []
        monkeypatch.setattr(workloads.time, "sleep", lambda s, out=sleeps: out.append(s))
        s1 = JitterStage(nn.Linear(3, 3), inj, 1.0, ActivationMeter(), last=False, stage=1, delays=delays,
                         local_stages=local)
        s2 = JitterStage(nn.Linear(3, 1), inj, 1.0, ActivationMeter(), last=True, stage=2, delays=delays,
                         local_stages=local if 2 in local else frozenset({2}))
        y, mb_out, stamp = s1(torch.randn(2, 3), torch.full((2,), m), torch.zeros(2, dtype=torch.float64))
        y_in, stamp_in = y.detach().requires_grad_(), stamp.detach().requires_grad_()
        s2(y_in, mb_out, stamp_in).sum().backward()  # the clock stands still: a wait is its whole draw
        torch.autograd.backward([y, stamp], [y_in.grad, stamp_in.grad])
        assert sleeps == [pytest.approx(d) for d in want], local


@pytest.mark.timeout(60)
def test_inbox_hold_delays_the_input_not_the_result():
    """A hold on one activation: the arbiter does not see it until the hold ends (the rank runs
    the next microbatch's forward first), and the gradients are those of a plain run."""
    from rrfp.runtime.doors.local import LocalPipeline
    from rrfp.transport.keys import Direction

    M = 4
    ref, _, ref_stages = micro.sequential_runner(2, M)
    for st in ref_stages:
        st.zero_grad()  # it ran once to warm up
    ref()
    calls = []

    def hold(msg) -> float:
        calls.append((msg.key.direction, msg.key.microbatch))
        return 0.5 if msg.key.direction == Direction.ACT and msg.key.microbatch == 0 else 0.0

    with LocalPipeline([micro.Scale(), micro.Scale()], M, micro.scalar_loss, hint="bf", watchdog=60, record=True) as pipe:
        pipe.runtimes[1].inbox.hold = hold
        pipe.step(torch.ones(M, 1), target=torch.ones(M, 1))
        order = [(r.task.stage, r.task.kind, r.task.mb) for r in pipe.last_stats[1].records]
        grads = [m.w.grad.item() for m in pipe.modules]
    from rrfp.scheduler.tasks import F

    fwd = [m for s, k, m in order if k == F]
    assert fwd[0] != 0 and fwd.index(0) > 0, order
    assert sorted(calls) == sorted([(Direction.ACT, m) for m in range(M)])
    assert grads == pytest.approx([st.w.grad.item() for st in ref_stages], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["comm4", "multimodal4"])
def test_core_settings_run_at_equal_memory_with_equal_gradients(setting):
    """The tiny comm4 / multimodal4 settings in real processes: every system's gradients match
    (checked inside the run), the injected totals are equal, and the default hint held to 1F1B's
    bytes holds no more than PyTorch's Schedule1F1B on any rank (sizes here are exact)."""
    systems = ["rrfp default, 1F1B memory", "rrfp strict-1f1b", "torch 1F1B"]
    # comm4 also runs a candidate hint (--candidates) at both budgets, paired in the same rounds.
    cand = ["bfw-alt-df"] if setting == "comm4" else []
    cfg = compare.setting_config(setting, quick=True, systems=systems, candidates=cand)
    assert cfg["systems"] == systems + [f"rrfp {h}, {m} memory" for h in cand for m in ("1F1B", "GPipe")]
    res = compare.run_setting(cfg, timeout=100)
    assert res["default_hint"] == compare.default_hint()
    ph = res["phases"][0]
    assert ph["worst_grad_ratio"] <= 1.0
    mem = ph["rounds"][1]["systems"]
    budgets = [b["1f1b"] for b in res["budgets"]]
    for r, (mine, theirs) in enumerate(zip(mem["rrfp default, 1F1B memory"]["peak_bytes"], mem["torch 1F1B"]["peak_bytes"])):
        assert 0 < mine <= budgets[r] and mine <= theirs, (r, mine, theirs, budgets[r])
        if r > 0:  # fixed shapes after stage 0: the budget is what 1F1B measured (within 5%)
            # but for one thing: PyTorch's loss saves each microbatch's targets as a view of
            # the batch's (its own split), so its peak holds the whole batch's targets; rrfp's
            # targets have their own storages, which its budget counts (benchmarks.batches).
            B, T, M = cfg["batch_size"], cfg["seq_len"], cfg["n_microbatches"]
            shared = 8 * T * (B - B // M) if r == len(budgets) - 1 else 0  # int64 targets
            assert theirs - shared <= budgets[r] <= 1.05 * theirs, (r, theirs, shared, budgets[r])
    from benchmarks.report import equal_memory, phase_summary

    s = phase_summary(ph)
    rows = equal_memory({setting: {ph["name"]: s}}, None)
    assert rows and rows[0][2] == "default@1F1B-mem vs 1F1B"
    for h in cand:  # the candidate at 1F1B's bytes holds what the default hint may, and no more
        for r, (mine, b) in enumerate(zip(mem[f"rrfp {h}, 1F1B memory"]["peak_bytes"], budgets)):
            assert 0 < mine <= b, (h, r, mine, b)
        from benchmarks.report import candidates

        got = candidates({setting: {ph["name"]: s}}, {"compare": {setting: res}})
        # Only the 1F1B row: this run has no torch GPipe to pair the GPipe-memory row with.
        assert [row[:4] for row in got] == [[setting, ph["name"], "1F1B", f"`{h}`"]]
        # The default row is named by the hint auto kept there.
        assert got[0][4].startswith(f"`{ph['kept']['rrfp default, 1F1B memory']}` ") and "n=1" in got[0][6]


def test_regenerating_the_report_keeps_the_hand_written_sections():
    """``--out`` over an existing BENCHMARKS.md replaces the generated sections and keeps the
    sections engineers appended after them (their measurements are not this command's)."""
    from benchmarks.run_all import kept_sections

    old = ("# Benchmarks\n\n## Machine\n\nold\n\n## Targets\n\nold\n\n## Micro-benchmarks of the runtime\n\n"
           "### Transports\n\nold\n\n## Data planes\n\nkept 1\n\n### Sub\n\nkept 2\n")
    assert kept_sections(old) == "\n## Data planes\n\nkept 1\n\n### Sub\n\nkept 2\n"
    assert kept_sections("# Benchmarks\n\n## Machine\n\nonly generated\n") == ""
    # The candidates' section is generated too (rrfp bench --candidates), never kept as hand-written.
    assert kept_sections("# Benchmarks\n\n## Candidate hints at equal memory (`--candidates`)\n\nold\n") == ""


def test_round_order_runs_target_rows_side_by_side_and_balances_who_goes_first():
    from benchmarks.harness import round_order

    seven = ["rrfp default", "rrfp default, 1F1B memory", "rrfp default, GPipe memory", "rrfp strict-1f1b",
             "torch GPipe", "torch 1F1B", "rrfp bfw-alt, 1F1B memory"]
    assert compare.target_groups(seven)[0] == ["rrfp default, 1F1B memory", "torch 1F1B", "rrfp bfw-alt, 1F1B memory"]
    for names in (seven, seven[:6]):  # an odd and an even number of systems
        _check_round_order(names, round_order)
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"] and round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert round_order(["a", "b", "c"], 2) == ["b", "c", "a"]


def _check_round_order(names, round_order):
    groups = compare.target_groups(names)
    n = len(names)
    first = {"rrfp default, 1F1B memory": 0, "torch 1F1B": 0}
    places = {name: set() for name in names}
    for k in range(2 * n):
        order = round_order(names, k, groups)
        assert sorted(order) == sorted(names)
        for i, name in enumerate(order):
            places[name].add(i)
        a, b = order.index("rrfp default, 1F1B memory"), order.index("torch 1F1B")
        # Neighbours, except the one rotation that splits the group across the round's ends.
        assert abs(a - b) in (1, n - 1), (k, order)
        if abs(a - b) == 1:
            first[order[min(a, b)]] += 1
    assert first["rrfp default, 1F1B memory"] == first["torch 1F1B"]  # each runs first as often
    assert all(p == set(range(n)) for p in places.values())  # every system takes every place


def test_median_confidence_interval_holds_the_median_and_narrows_with_rounds():
    import numpy as np

    from benchmarks.harness import median_ci

    rng = np.random.default_rng(1)
    few, many = rng.lognormal(0.1, 0.2, 10), rng.lognormal(0.1, 0.2, 160)
    lo, hi = median_ci(few)
    assert lo <= float(np.median(few)) <= hi and median_ci(few) == (lo, hi)  # seeded: renders the same
    lo2, hi2 = median_ci(many)
    assert lo2 <= float(np.median(many)) <= hi2 and hi2 - lo2 < (hi - lo) / 2  # 16x the rounds: ~1/4 the width
    assert median_ci([1.25] * 5) == (1.25, 1.25)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ideal_speedups_of_the_auto_default():
    """The report's simulator column for a setting whose default rows run ``auto``: rrfp simulate
    labels auto's row with the hint it kept ("auto (strict-split)"), and the full run failed
    with KeyError 'auto' until that row was also keyed "auto"."""
    from benchmarks import run_all

    setting = {"calibration": [{"F": 0.010, "B": 0.020}] * 4, "default_hint": "auto",
               "config": {"n_ranks": 4, "n_microbatches": 8, "seed": 0},
               "phases": [{"name": "J0", "level": "J0"}]}
    got = run_all.ideal(setting)["J0"]
    # Uniform costs at 1F1B's memory: auto keeps a hint no slower than strict 1F1B.
    assert got["1f1b"] is not None and got["1f1b"] >= 1.0
    assert got["gpipe"] is not None and got["gpipe"] > 0


def test_the_starters_files_are_read_only_once_whole(tmp_path):
    """The launcher polls for each rank's exit code while the starter writes it: a file written
    in place exists, empty, before its text (a whole ``rrfp bench`` setting failed on
    ``int('')``). ``publish`` writes beside and renames, so a write under way is not read."""
    from benchmarks.launcher import _Ranks, publish

    ranks = _Ranks(tmp_path, 2)
    (tmp_path / "rank0.code.tmp").write_text("")  # rank 0's code being written
    assert ranks.codes() == [None, None]
    publish(tmp_path / "rank1.code", "-9")
    assert ranks.codes() == [None, -9] and sorted(p.name for p in tmp_path.iterdir()) == ["rank0.code.tmp", "rank1.code"]


def test_a_code_published_as_the_starter_exits_is_read_not_taken_for_a_kill(tmp_path):
    """The starter publishes the last rank's exit code, then exits. Had the launcher read the
    files before seeing the starter gone, and the starter published and exited in between, the
    rank that exited 0 read as killed (-9) and failed the setting. Forced order: the fake
    starter publishes rank 1's code at the moment it is polled."""
    from benchmarks.launcher import _Ranks, publish

    class Starter:
        def poll(self):
            publish(tmp_path / "rank1.code", "0")  # the starter's last act ...
            return 0  # ... then it has exited

    ranks = _Ranks(tmp_path, 2)
    ranks.starter = Starter()  # type: ignore[assignment]
    publish(tmp_path / "rank0.code", "0")
    assert ranks.codes() == [0, 0]
    # A rank the starter never published (it died with the starter) is reported killed.
    (tmp_path / "rank1.code").unlink()
    ranks.starter = type("Gone", (), {"poll": lambda self: 1})()  # type: ignore[assignment]
    assert ranks.codes() == [0, -9]
