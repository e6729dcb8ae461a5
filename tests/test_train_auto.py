"""``auto``'s real-step half (rrfp.runtime.features.auto.AutoHint, driven by both front doors and
``rrfp train``), on a stand-in pipeline whose step times the test sets: which hint runs each
step, and what is kept. Shares through a one-rank process group (``rrfp train``'s way) and
in-process (``LocalPipeline``'s)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from rrfp.runtime.features.auto import TRIAL_ROUNDS, AutoHint
from rrfp.runtime.features.share import DistShare, LocalShare
from rrfp.sim.trial import EXTRA_ROUNDS
from rrfp.runtime.doors.config import RuntimeConfig, plan
from rrfp.runtime.doors.front import FrontDoor
from rrfp.runtime.engine.rank import RankRuntime
from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.tasks import TaskRecord

M = 4


@pytest.fixture(scope="module", params=["dist", "local"])
def share(request):
    if request.param == "local":
        yield LocalShare()
        return
    if dist.is_initialized():  # another test's group: use it
        yield DistShare()
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistShare()
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def three_candidates(monkeypatch):
    """The trial's arithmetic below is hand-computed for three candidates (the strict schedule,
    bf, bfw-mem): the registry's other candidates are left out, whatever this build has."""
    from rrfp.sim import auto as sim_auto

    full = sim_auto.known_candidates
    monkeypatch.setattr(sim_auto, "known_candidates", lambda n_ranks, n_virtual, placement, n_microbatches, *_, **__:
                        full(n_ranks, n_virtual, placement, n_microbatches, (sim_auto.STRICT, "bf", "bfw-mem")))


def _pipe():
    """A stand-in front door whose hint switches go through the real ``FrontDoor.set_hint`` and
    ``RankRuntime.set_hint`` (the one way ``auto`` switches)."""
    spec, hint, strict = resolve_hint("strict-1f1b", Placement(2), M)
    rt = SimpleNamespace(rank=0, stages={}, hooks=SimpleNamespace(final_kind="B"), loop=SimpleNamespace(record=False),
                         sizer=None, spec=spec, hint=hint, strict=strict, inflight_limit=M, memory_budget=None)
    rt.set_hint = lambda *a: RankRuntime.set_hint(rt, *a)
    pipe = SimpleNamespace(spec=spec, hint=hint, strict=strict, n_microbatches=M, runtime=rt, runtimes=[rt],
                           plan=SimpleNamespace(limits=[M, M], budget=None), config=RuntimeConfig())
    pipe.set_hint = lambda text: FrontDoor.set_hint(pipe, text)
    return pipe


def _after(ctl, k, stats):
    asyncio.run(ctl.after_step(k, [stats]))


def _stats(pipe, wall: float):
    """A step's records: every task of the current spec, F 10 ms, B 20 ms, I and W 10 ms, run
    back to back on one clock (no time between tasks: the calibrated model's per-task time,
    rrfp.sim.calibration, is 0)."""
    t, recs = 0.0, []
    for task in pipe.spec.all_tasks():
        d = {"F": 0.010, "B": 0.020, "I": 0.010, "W": 0.010}[task.kind]
        recs.append(TaskRecord(0, 0, task, t, t + d))
        t += d
    return SimpleNamespace(wall=wall, records=recs, input_elems=64)  # one batch size throughout


def _run(share, walls: dict[str, float], steps: int):
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    ran = []
    for k in range(steps):
        ctl.before_step(k)
        ran.append(ctl.current)
        assert pipe.runtime.hint.name == ctl.current.removeprefix("strict-")
        assert pipe.runtime.hooks.final_kind == ("W" if pipe.spec.split_backward else "B")
        _after(ctl, k, _stats(pipe, walls[ctl.current]))
    return ctl, ran, lines


def test_measures_ranks_tries_and_keeps_the_faster(share) -> None:
    walls = {"strict-1f1b": 1.0, "bf": 0.9, "bfw-mem": 1.2}
    ctl, ran, lines = _run(share, walls, 3 + 3 * TRIAL_ROUNDS + 2)
    # Warm-up and the two measured steps: strict (F, B), then the first split candidate (I, W).
    assert ran[:3] == ["strict-1f1b", "strict-1f1b", "bfw-mem"]
    assert {(s, k) for s, k in ctl.samples} == {(s, k) for s in (0, 1) for k in "FBIW"}
    # The trial: the strict schedule and the best two by simulation, each once per round.
    assert sorted(ctl.trial) == sorted(walls)
    trial = ran[3:3 + 3 * TRIAL_ROUNDS]
    assert all(sorted(trial[3 * r:3 * r + 3]) == sorted(walls) for r in range(TRIAL_ROUNDS))
    assert ctl.chosen == "bf" and ran[-2:] == ["bf", "bf"]
    # Announced before they run: the measuring steps, then the trial's steps and candidates.
    assert len(lines) == 3
    assert lines[0].startswith("hint auto: steps 1-3 of this run measure costs (strict-1f1b warms up, "
                               "then strict-1f1b, bfw-mem)")
    assert lines[1].startswith(f"hint auto: steps 4-{3 + 3 * TRIAL_ROUNDS} of this run are the trial: ")
    assert lines[1].split(" are the trial: ")[1].startswith(f"{', '.join(ctl.trial)}, {TRIAL_ROUNDS} rounds of one step each")
    # One choice, made once the trial's last round is in.
    assert lines[2].startswith(f"hint auto chose bf: median step over {TRIAL_ROUNDS} trial steps")
    assert "simulated step" in lines[2]


def _run_steps(share, walls: dict[str, list[float]], steps: int, run_length: int | None = None):
    """As :func:`_run`, each hint's steps taking its next time in ``walls`` (the last one repeats)."""
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    if run_length is not None:
        ctl.run_length(run_length)
    ran, seen = [], {h: 0 for h in walls}
    for k in range(steps):
        ctl.before_step(k)
        ran.append(ctl.current)
        times = walls[ctl.current]
        _after(ctl, k, _stats(pipe, times[min(seen[ctl.current], len(times) - 1)]))
        seen[ctl.current] += 1
    return ctl, ran, lines


# By hand: the measuring steps run strict twice and bfw-mem once (their times are not the
# trial's); then bf's trial median is 4% below strict's, beyond the 1% tie but within the
# steps' spread (deviations 0.04 and 0.04 from each median: 0.04 x 1.4826 = 5.9%).
NOISY = {"strict-1f1b": [1.0, 1.0, 1.0, 0.96, 1.04, 1.0], "bf": [0.96, 0.9216, 0.9984, 0.95],
         "bfw-mem": [1.2, 1.2, 1.152, 1.248]}


def test_a_trial_left_to_its_noise_runs_the_two_hints_three_more_rounds(share) -> None:
    trial_end = 3 + 3 * TRIAL_ROUNDS
    ctl, ran, lines = _run_steps(share, NOISY, trial_end + 2 * EXTRA_ROUNDS + 1)
    # The extra rounds: strict and bf in turn (rotating), after the trial's nine steps.
    assert ctl.extension == ["strict-1f1b", "bf"]
    assert ran[trial_end:trial_end + 6] == ["strict-1f1b", "bf", "bf", "strict-1f1b", "strict-1f1b", "bf"]
    assert lines[2] == (f"hint auto: steps {trial_end + 1}-{trial_end + 6} of this run try bf and strict-1f1b 3 more "
                        "rounds each: bf measured 4.0% faster, within the steps' spread (5.9%)")
    # Six steps each: strict's median 1.0, bf's 0.95 (0.9216 0.95 0.95 0.95 0.96 0.9984); most
    # deviations now 0: the margin is the 1% tie, and bf, 5% faster, is kept.
    assert ctl.chosen == "bf" and ran[-1] == "bf"
    assert lines[3].startswith("hint auto chose bf: median step over 6 trial steps (at the trial's median batch "
                               "work): bf 950.0 ms, strict-1f1b 1000.0 ms; faster counts beyond 1.0% (the tie 1% or the "
                               "steps' spread x sqrt(3/6), 6 steps each) ")
    # Without extra rounds the margin is the spread itself, and the line says nothing of narrowing.
    assert "sqrt" not in _run_steps(share, NOISY, trial_end + 1, run_length=trial_end + 1)[2][-1]


def test_a_run_without_room_for_the_extra_rounds_decides_on_the_trial(share) -> None:
    steps = 3 + 3 * TRIAL_ROUNDS + 1
    ctl, ran, lines = _run_steps(share, NOISY, steps, run_length=steps)
    assert ctl.extension == [] and ctl.chosen == "strict-1f1b" and ran[-1] == "strict-1f1b"
    assert not any("more rounds" in x for x in lines)


def test_never_keeps_a_policy_not_clearly_faster_than_strict(share) -> None:
    # bf is faster by less than the tie margin: the strict schedule stays.
    ctl, ran, lines = _run(share, {"strict-1f1b": 1.0, "bf": 0.995, "bfw-mem": 1.2}, 3 + 3 * TRIAL_ROUNDS + 1)
    assert ctl.chosen == "strict-1f1b" and ran[-1] == "strict-1f1b"
    assert [x for x in lines if "chose" in x] == [lines[-1]] and "chose strict-1f1b" in lines[-1]


def test_a_run_too_short_to_choose_runs_strict_and_says_so(share) -> None:
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    need = ctl.steps_needed()
    assert need == 3 + 2 * TRIAL_ROUNDS  # measuring (a split candidate exists), then strict + one, each round
    ctl.run_length(need - 1)
    ran = []
    for k in range(need - 1):
        ctl.before_step(k)
        ran.append(ctl.current)
        _after(ctl, k, _stats(pipe, 1.0))
    # Nothing was chosen (so a checkpoint records no choice for a resumed run to keep).
    assert ran == ["strict-1f1b"] * (need - 1) and ctl.chosen is None and ctl.too_short
    assert lines == [f"hint auto: a run of {need - 1} steps is too short to measure and try candidates "
                     f"(needs at least {need}); it runs strict-1f1b"]


def test_a_long_enough_run_is_not_cut_short(share) -> None:
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    ctl.run_length(ctl.steps_needed())
    assert not ctl.too_short and lines == [] and len(ctl.plan) == 3


@pytest.mark.parametrize("n_ranks, n_virtual, placement, want", [
    (4, 1, "loop", [4, 3, 2, 1]),  # 1F1B: p - r microbatches in flight (hand count)
    (2, 1, "loop", [2, 1]),
])
def test_candidates_run_at_the_strict_schedules_memory(n_ranks, n_virtual, placement, want) -> None:
    # Without --inflight-limit or --memory-budget, every candidate auto tries holds at most what
    # the strict schedule holds (a policy at the default limit of 32 would hold up to M).
    assert plan(RuntimeConfig(placement=placement), n_ranks, n_virtual, 8).limits == want
    # A limit or a budget the user gives is theirs.
    assert plan(RuntimeConfig(inflight_limit=3), n_ranks, n_virtual, 8).limits == [3] * n_ranks
    assert plan(RuntimeConfig(memory_budget="1MiB"), n_ranks, n_virtual, 8).limits == [32] * n_ranks


def test_a_run_that_would_end_inside_the_trial_keeps_strict_and_says_so(share) -> None:
    # Three candidates in the trial (the stand-in's registry): 3 measuring + 9 trial steps, so
    # a run of 10 passes the first check (at least 9) but cannot finish the trial.
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    ctl.run_length(10)
    ran = []
    for k in range(10):
        ctl.before_step(k)
        ran.append(ctl.current)
        _after(ctl, k, _stats(pipe, {"strict-1f1b": 1.0}.get(ctl.current, 0.5)))
    assert len(ctl.trial) == 3 and ctl.chosen is None and ctl.too_short
    assert ran[:3] == ["strict-1f1b", "strict-1f1b", "bfw-mem"] and ran[3:] == ["strict-1f1b"] * 7
    assert lines[-1] == (f"hint auto: a run of 10 steps is too short to try {', '.join(ctl.trial)} "
                         f"({3 * TRIAL_ROUNDS} trial steps after 3 measuring); it runs strict-1f1b")


def _drive(share, wall, steps: int, recheck_every: int, ctl=None):
    """``steps`` steps of a controller whose step ``k`` under hint ``h`` takes ``wall(k, h)`` s;
    also which steps measured or tried (a trial or re-check round: the plan was not empty)."""
    pipe, lines = (ctl.pipe, []) if ctl else (_pipe(), [])
    ctl = ctl or AutoHint(pipe, share, say=lines.append, recheck_every=recheck_every)
    ran, tried = [], []
    for k in range(steps):
        ctl.before_step(k)
        ran.append(ctl.current)
        tried.append(bool(ctl.plan))
        assert pipe.runtime.hint.name == ctl.current.removeprefix("strict-")
        _after(ctl, k, _stats(pipe, wall(k, ctl.current)))
    ctl.tried = tried
    return ctl, ran, lines


TRIAL_END = 3 + 3 * TRIAL_ROUNDS  # steps before the first choice (three candidates)


def _later(after: dict[str, float]):
    """Step times: bf 0.9, strict 1.0, bfw-mem 1.2 through the trial (bf is kept), then ``after``."""
    before = {"strict-1f1b": 1.0, "bf": 0.9, "bfw-mem": 1.2}
    return lambda k, h: (before if k < TRIAL_END else {**before, **after})[h]


@pytest.mark.parametrize("bfw_mem, switches", [(0.893, False), (0.85, True)])
def test_a_recheck_switches_only_beyond_the_tie(share, bfw_mem, switches) -> None:
    # After the trial bfw-mem runs 0.893 s against the kept bf's 0.9: faster, but within TIE
    # (0.893 > 0.99 x 0.9), so the re-checks keep bf however many rounds they add; at 0.85 it
    # is faster beyond the tie, and the re-check that moves its median there switches.
    every = 5
    ctl, ran, lines = _drive(share, _later({"bfw-mem": bfw_mem}), TRIAL_END + 8 * every, every)
    assert sum(ctl.tried[TRIAL_END:]) >= 15 and len(ctl.walls["bfw-mem"]) >= TRIAL_ROUNDS + 5  # re-checks ran
    kept = [h for h, t in zip(ran[TRIAL_END:], ctl.tried[TRIAL_END:]) if not t]  # steps between rounds
    if switches:
        # Its median passes 0.99 x 0.9 once it has more re-check steps than trial steps.
        assert ctl.chosen == "bfw-mem" and kept[0] == "bf" and kept[-1] == "bfw-mem"
        said = [ln for ln in lines if ln.startswith("hint auto: the re-check after step")]
        assert len(said) == 1 and "measured bfw-mem faster than bf by more than 1.0%" in said[0]
    else:
        assert ctl.chosen == "bf" and set(kept) == {"bf"}
        assert [ln for ln in lines if "chose" in ln] == [lines[2]] and "chose bf" in lines[2]


def test_recheck_off_keeps_the_first_choice(share) -> None:
    # bfw-mem becomes twice as fast after the trial: with re-checks off it never runs again.
    ctl, ran, lines = _drive(share, _later({"bfw-mem": 0.45}), TRIAL_END + 60, 0)
    assert ctl.chosen == "bf" and ran[TRIAL_END:] == ["bf"] * 60
    assert len([ln for ln in lines if "chose" in ln]) == 1
    # The same through the front doors' option, and a bad value refused in one line.
    assert plan(RuntimeConfig(auto_recheck=0), 2, 1, M).auto
    with pytest.raises(ValueError, match=r"auto_recheck=-1: expected steps between auto's re-checks"):
        plan(RuntimeConfig(auto_recheck=-1), 2, 1, M)


def test_adopting_a_recorded_choice_skips_measuring_and_the_trial(share) -> None:
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=3)
    assert ctl.adopt("bf", "checkpoint step-00000040")
    ctl.run_length(5)  # too short to choose, but nothing is left to choose
    ctl, ran, more = _drive(share, lambda k, h: {"bf": 1.0}.get(h, 0.1), 12, 3, ctl)
    assert ran == ["bf"] * 12 and ctl.chosen == "bf" and ctl.adopted and not ctl.too_short
    assert ctl.samples == {} and ctl.walls == {} and ctl.ranking is None  # nothing measured, no trial
    assert lines == ["hint auto: keeps bf, the choice of checkpoint step-00000040 (no measuring, no trial, "
                     "no re-check; --hint bf pins it)"]
    with pytest.raises(RuntimeError, match="before the first step"):
        ctl.adopt("bf")


def test_a_recorded_choice_that_is_no_candidate_here_is_measured_anew(share) -> None:
    pipe, lines = _pipe(), []
    ctl = AutoHint(pipe, share, say=lines.append, recheck_every=0)
    assert not ctl.adopt("strict-zb-v", "checkpoint step-00000040")  # another placement's
    assert lines == ["hint auto: checkpoint step-00000040 kept 'strict-zb-v', not a candidate of this pipeline "
                     "(strict-1f1b, bf, bfw-mem); measuring anew"]
    ctl, ran, _ = _drive(share, lambda k, h: {"strict-1f1b": 1.0, "bf": 0.9, "bfw-mem": 1.2}[h], TRIAL_END + 1, 0, ctl)
    assert ran[:3] == ["strict-1f1b", "strict-1f1b", "bfw-mem"] and ctl.chosen == "bf"


def test_tied_candidates_resolve_to_the_fixed_preference(share) -> None:
    # bfw-mem measured 0.4% faster than bf, within TIE: bf comes first in the order of
    # preference (all_candidates()'), so noise of that size cannot flip the choice.
    ctl, ran, lines = _drive(share, lambda k, h: {"strict-1f1b": 1.0, "bf": 0.9, "bfw-mem": 0.8964}[h],
                             TRIAL_END + 1, 0)
    assert sorted(ctl.trial) == ["bf", "bfw-mem", "strict-1f1b"]
    assert ctl.chosen == "bf" and ran[-1] == "bf"


@pytest.fixture
def no_launch(no_launch, monkeypatch):
    """conftest's (nothing may start a process), without reading the training samples."""
    monkeypatch.setattr("rrfp.train.cli._check_samples", lambda args: None)


@pytest.mark.parametrize("flags, said", [
    (["--auto-recheck", "-3"], "--auto-recheck='-3': expected steps between re-checks (an integer >= 0) or off"),
    (["--auto-recheck", "often"], "--auto-recheck='often': expected steps between re-checks (an integer >= 0) or off"),
    (["--auto-recheck", "off", "--hint", "bf"], "--auto-recheck='off' applies to --hint auto only; this run has --hint bf"),
])
def test_bad_auto_recheck_flags_are_refused_in_one_line(flags, said, capsys, no_launch) -> None:
    from rrfp.cli import main

    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rrfp train: error: {said}"]


@pytest.mark.parametrize("text, every", [(None, 50), ("off", 0), ("OFF", 0), ("0", 0), ("7", 7), (25, 25)])
def test_auto_recheck_values(text, every) -> None:
    from rrfp.runtime.features.auto import RECHECK_EVERY, recheck_steps

    assert RECHECK_EVERY == 50 and recheck_steps(text) == every


def test_the_front_doors_pass_auto_recheck_to_the_controller() -> None:
    import torch.nn.functional as F
    from torch import nn

    from rrfp import LocalPipeline

    mods = [nn.Linear(4, 4) for _ in range(2)]
    with LocalPipeline(mods, M, F.mse_loss) as pipe:
        assert pipe.auto.recheck_every == 50
    with LocalPipeline(mods, M, F.mse_loss, auto_recheck=0) as pipe:
        assert pipe.auto.recheck_every == 0
    with pytest.raises(ValueError, match="auto_recheck=True: expected"):
        LocalPipeline(mods, M, F.mse_loss, auto_recheck=True)
