"""``auto``'s real-step half (rrfp.runtime.features.auto.AutoHint, driven by both front doors and
``rrfp train``), on a stand-in pipeline whose step times the test sets: which hint runs each
step, and what is kept. Shares through a one-rank process group (``rrfp train``'s way) and
in-process (``LocalPipeline``'s)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from rrfp.runtime.features.auto import TRIAL_ROUNDS, AutoHint, DistShare, LocalShare
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
                         sizer=None, spec=spec, hint=hint, strict=strict)
    rt.set_hint = lambda *a: RankRuntime.set_hint(rt, *a)
    pipe = SimpleNamespace(spec=spec, hint=hint, strict=strict, n_microbatches=M, runtime=rt, runtimes=[rt],
                           plan=SimpleNamespace(limits=[M, M], budget=None), config=RuntimeConfig())
    pipe.set_hint = lambda text: FrontDoor.set_hint(pipe, text)
    return pipe


def _after(ctl, k, stats):
    asyncio.run(ctl.after_step(k, [stats]))


def _stats(pipe, wall: float):
    """A step's records: every task of the current spec, F 10 ms, B 20 ms, I and W 10 ms, run
    back to back on one clock (the messages take 1 ms)."""
    t, recs = 0.0, []
    for task in pipe.spec.all_tasks():
        d = {"F": 0.010, "B": 0.020, "I": 0.010, "W": 0.010}[task.kind]
        recs.append(TaskRecord(0, 0, task, t + 0.001, t + 0.001 + d))
        t += 0.001 + d
    return SimpleNamespace(wall=wall, records=recs)


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
    assert ran == ["strict-1f1b"] * (need - 1) and ctl.chosen == "strict-1f1b"
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
    assert len(ctl.trial) == 3 and ctl.chosen == "strict-1f1b"
    assert ran[:3] == ["strict-1f1b", "strict-1f1b", "bfw-mem"] and ran[3:] == ["strict-1f1b"] * 7
    assert lines[-1] == (f"hint auto: a run of 10 steps is too short to try {', '.join(ctl.trial)} "
                         f"({3 * TRIAL_ROUNDS} trial steps after 3 measuring); it runs strict-1f1b")
