"""``auto`` at the user's memory: a candidate that cannot run at the given in-flight limits is
dropped from the ranking (never a crash of the whole ranking), and the processes of one
pipeline rank on every rank's own limit and budget, shared while measuring, so that processes
given different values still try the same candidates in the same order (on main each ranked
on its own values for every rank, chose differently and hung in a trial step)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from rrfp.runtime.doors.config import RuntimeConfig
from rrfp.runtime.doors.front import FrontDoor
from rrfp.runtime.engine.rank import RankRuntime
from rrfp.runtime.features.auto import AutoHint
from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.tasks import TaskRecord
from rrfp.sim import auto as sim_auto
from rrfp.sim.auto import PROFILE_SEED, Profile, rank
from rrfp.sim.calibration import Calibration
from rrfp.sim.compare import SimConfig, run_one
from rrfp.sim.costs import CostModel, StageCost
from rrfp.sim.engine import DeadlockError

STAGES = tuple(StageCost(0.010, 0.020, 0.011, 0.011, 1000, 1) for _ in range(4))
PROFILE = Profile(STAGES, (0.0, 0.0, 0.0))


def _reference(hints, limit, budget=None, stages=STAGES, n_microbatches=8, calibration=None, links=()):
    # Link seconds travel as message bytes at 1 byte/ns, as rrfp.sim.auto.rank sends them.
    cfg = SimConfig(n_ranks=len(stages), n_microbatches=n_microbatches, limit=limit, costs=CostModel(stages),
                    seed=PROFILE_SEED, memory_budget=budget, calibration=calibration,
                    bandwidth=1e9 if any(links) else float("inf"))
    return {h: run_one(cfg, h, record=False)[0].makespan for h in hints}


def test_a_candidate_refused_at_the_users_limits_is_dropped_and_logged(caplog):
    # wfloat keeps 1F1B's order, which holds [4, 3, 2, 1]; at 2 per rank it is refused (on
    # main its simulation deadlocked and the whole ranking raised DeadlockError).
    with caplog.at_level(logging.INFO, logger="rrfp.auto"):
        r = rank(PROFILE, n_ranks=4, n_microbatches=8, limit=[2, 2, 2, 2])
    names = [h for h, _ in r.order]
    assert "wfloat" not in names and "wfloat" in dict(r.skipped)
    assert "below its order's own 4" in dict(r.skipped)["wfloat"]
    assert "auto: candidate wfloat dropped (hint 'wfloat': in-flight limit 2 on rank 0" in caplog.text
    # The others are ranked on their own simulations at those limits.
    assert dict(r.order) == pytest.approx(_reference(names, [2, 2, 2, 2]))
    assert r.strict == "strict-1f1b" and "strict-split" in names


def test_a_candidate_whose_simulation_deadlocks_is_dropped(monkeypatch, caplog):
    real = sim_auto.run_one

    def run(cfg, hint, **kw):
        if hint == "bf":
            raise DeadlockError("simulation cannot finish: rank 1 step 0: waits for gradient for 1B0")
        return real(cfg, hint, **kw)

    monkeypatch.setattr(sim_auto, "run_one", run)
    with caplog.at_level(logging.INFO, logger="rrfp.auto"):
        r = rank(PROFILE, n_ranks=4, n_microbatches=8, limit=8, candidates=("strict", "bf", "bfw-mem"))
    assert [h for h, _ in r.order] and "bf" not in dict(r.order)
    assert dict(r.skipped)["bf"].startswith("simulation cannot finish")
    assert "auto: candidate bf dropped" in caplog.text
    assert dict(r.order) == pytest.approx(_reference(("strict-1f1b", "bfw-mem"), 8))


def test_no_candidate_that_can_run_is_an_error(monkeypatch):
    monkeypatch.setattr(sim_auto, "run_one", lambda *a, **k: (_ for _ in ()).throw(DeadlockError("stuck")))
    with pytest.raises(ValueError, match="auto: no candidate can run here: strict-1f1b: stuck"):
        rank(PROFILE, n_ranks=4, n_microbatches=8, limit=8, candidates=("strict", "bf"))


# ------------------------------------------------------------------ two processes, one pipeline

M = 4
ACT = 1000  # bytes per microbatch on every stage (the stand-in sizer's)
GAP = 1 / 1024  # seconds between a rank's tasks: the calibrated model's time per task


class Pair:
    """Two processes' shares, in one event loop: each call waits for the other's part."""

    def __init__(self) -> None:
        self.parts: dict[int, dict[int, object]] = {}
        self.ready: dict[int, asyncio.Event] = {}

    def member(self, r: int) -> "Member":
        return Member(self, r)


class Member:
    def __init__(self, pair: Pair, r: int) -> None:
        self.pair, self.r, self.seq = pair, r, 0

    async def _exchange(self, item):
        self.seq += 1
        got = self.pair.parts.setdefault(self.seq, {})
        got[self.r] = item
        ev = self.pair.ready.setdefault(self.seq, asyncio.Event())
        if len(got) == 2:
            ev.set()
        await ev.wait()
        return [got[0], got[1]]

    async def max(self, x):
        return max(await self._exchange(x))

    async def sum(self, x):
        return sum(await self._exchange(x))

    async def gather(self, items):
        return [x for part in await self._exchange(list(items)) for x in part]


def _process(r: int, limit: int, budget: int | None):
    """Process ``r`` of a 2-rank pipeline, given ``limit`` and ``budget`` (its config's: the
    plan holds them for every rank, its runtime runs rank ``r`` at them)."""
    spec, hint, strict = resolve_hint("strict-1f1b", Placement(2), M)
    # A stage whose module defers its own weight gradients: a split hint changes nothing on it.
    rt = SimpleNamespace(rank=r, stages={r: SimpleNamespace(dw_builder=object())}, hooks=SimpleNamespace(final_kind="B"),
                         loop=SimpleNamespace(record=False), sizer=(lambda s, m: ACT) if budget else None,
                         spec=spec, hint=hint, strict=strict, inflight_limit=limit, memory_budget=budget)
    rt.set_hint = lambda *a: RankRuntime.set_hint(rt, *a)
    pipe = SimpleNamespace(spec=spec, hint=hint, strict=strict, n_microbatches=M, runtime=rt, runtimes=[rt],
                           plan=SimpleNamespace(limits=[limit, limit], budget=budget), config=RuntimeConfig())
    pipe.set_hint = lambda text: FrontDoor.set_hint(pipe, text)
    return pipe


def _stats(pipe, r: int):
    """Rank ``r``'s records of a step: its tasks ``GAP`` apart, F 10, B 24, I and W 12 units of
    1/1024 s (binary fractions: every duration is exact, so the measured spread is 0)."""
    t, recs = 0.0, []
    for task in pipe.spec.all_tasks():
        if task.stage != r:
            continue
        d = {"F": 10, "B": 24, "I": 12, "W": 12}[task.kind] / 1024
        recs.append(TaskRecord(r, 0, task, t + GAP, t + GAP + d))
        t += GAP + d
    return SimpleNamespace(wall=t, records=recs)


def _measure(limits, budgets):
    """Both processes through their measuring steps (3: warm-up, strict, a split candidate)."""
    pair = Pair()
    pipes = [_process(r, limits[r], budgets[r]) for r in range(2)]
    ctls = [AutoHint(p, pair.member(r), recheck_every=0) for r, p in enumerate(pipes)]

    async def both(k):
        await asyncio.gather(*(c.after_step(k, [_stats(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))))

    mixed = len({b is None for b in budgets}) == 2
    for k in range(3):
        for c in ctls:
            c.before_step(k)
        # Under a budget auto measures with hints the budget gates (bf, then bfw-mem); a process
        # given none learns after the first step that another was given one, and runs them too.
        if k or not mixed:
            assert ctls[0].current == ctls[1].current
        else:
            assert [c.current for c in ctls] == ["strict-1f1b" if b is None else "bf" for b in budgets]
        asyncio.run(both(k))
    return ctls


@pytest.mark.parametrize("limits, budgets", [
    ([1, 2], [None, None]),  # process 0 was given limit 1, process 1 limit 2
    ([2, 2], [ACT, None]),  # only process 0 was given a budget (one microbatch's bytes)
    ([2, 1], [None, 3 * ACT]),
])
def test_processes_given_different_limits_or_budgets_rank_alike_on_every_ranks_own(limits, budgets):
    ctls = _measure(limits, budgets)
    assert all(c.ranking is not None for c in ctls)
    assert [c.gated for c in ctls] == [budgets != [None, None]] * 2
    assert ctls[0].profile.compute_cv == 0 and ctls[0]._fit().calibration.task == GAP
    # Every rank's own figures, the same on both processes.
    assert ctls[0].memory() == ctls[1].memory() == (limits, None if budgets == [None, None] else budgets)
    assert ctls[0].ranking.order == ctls[1].ranking.order and ctls[0].trial == ctls[1].trial
    # The ranking is the simulator's at those per-rank values (an independent run per hint).
    profile = ctls[0].profile
    hints = [h for h, _ in ctls[0].ranking.order]
    stages = tuple(StageCost(c.F, c.B, c.I, c.W, c.act_bytes, c.msg_bytes) for c in profile.costs().stages)
    ref = _reference(hints, limits, None if budgets == [None, None] else budgets, stages=stages, n_microbatches=M,
                     calibration=Calibration(task=GAP), links=profile.links)
    assert dict(ctls[0].ranking.order) == pytest.approx(ref)


def test_auto_links_fly_what_a_waiting_consumer_waited_less_its_receiving(monkeypatch):
    """auto's ranking models messages as rrfp bench's predictions do (Calibration.recv_in_hop):
    a link's recorded wait holds the receiving task's ``recv``, so the message flies the rest;
    reference: the bench model's own flight for the same figures, and the arithmetic by hand."""
    from rrfp.runtime.features import auto as rt_auto
    from rrfp.sim.calibration import Fit

    ctls = _measure([2, 2], [None, None])
    got = iter([Fit(Calibration(task=0.001, recv=0.0003), {0: 0.002}, {}),
                Fit(Calibration(task=0.003, recv=0.0005), {0: 0.004}, {})])
    monkeypatch.setattr(rt_auto, "fit", lambda steps, spec: next(got))
    fitted = ctls[0]._fit()
    assert fitted.calibration.task == pytest.approx(0.002) and fitted.calibration.recv == pytest.approx(0.0004)
    assert fitted.links == pytest.approx({0: 0.003 - 0.0004})  # the median wait less the mean receiving
    bench = Calibration(task=0.002, recv=0.0004, hop=0.003, recv_in_hop=True)
    assert fitted.links[0] == pytest.approx(bench.flight()) and fitted.calibration.on_rank() == pytest.approx(bench.on_rank())
