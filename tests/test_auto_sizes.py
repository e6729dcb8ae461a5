"""``auto``'s profile carries each measured microbatch's activation bytes, and the ranking
simulates each candidate on them (issue 33 item 5): with one size per stage every microbatch
was alike, so at 1F1B's byte budget the memory-aware ``bfw-mem`` simulated exactly as the strict
split order did and never reached the trial where sizes vary (the suite's ``seqlen``).

References are independent: hand-computed ratios and spreads, and the simulator's engine driven
directly with a hand-written duration and size function."""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as tF
from torch import nn

import rrfp
from rrfp.runtime.doors.config import RuntimeConfig
from rrfp.runtime.doors.front import FrontDoor
from rrfp.runtime.engine.rank import RankRuntime
from rrfp.runtime.features.auto import AutoHint
from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.tasks import TaskRecord
from rrfp.sim import suite
from rrfp.sim.auto import PROFILE_SEED, Profile, profile_from_samples, profile_of_config, rank, simulate_auto
from rrfp.sim.costs import StageCost
from rrfp.sim.engine import simulate
from rrfp.sim.sized import ratios

# ------------------------------------------------------------------ the profile


def test_ratios_are_each_size_over_its_stages_mean_over_every_measured_step():
    sizes = [[[100, 300], [10, 10]], [[200, 200], [30, 30]]]  # 2 steps x 2 stages x 2 microbatches
    # stage 0's mean 200, stage 1's 20 (hand)
    assert ratios(sizes, 2, 2) == [((0.5, 1.5), (0.5, 0.5)), ((1.0, 1.0), (1.5, 1.5))]
    assert ratios([[[7, 7], [3, 3]]], 2, 2) == []  # every microbatch alike: nothing beyond the means
    assert ratios([], 2, 2) == []
    with pytest.raises(ValueError, match=r"measured step 0: expected 2 stages x 2 microbatches, got \[2\]"):
        ratios([[[1, 2]]], 2, 2)


def test_profile_keeps_the_sizes_their_mean_and_the_spread_they_do_not_explain():
    # Seconds exactly proportional to bytes: the sizes explain all of the spread.
    sizes = [[[100, 300]], [[200, 200]]]
    compute = {(0, "F"): [0.01, 0.03, 0.02, 0.02], (0, "B"): [0.02, 0.06, 0.04, 0.04]}
    nbytes = {(0, "F"): [100, 300, 200, 200], (0, "B"): [100, 300, 200, 200]}
    p = profile_from_samples(compute, {}, 1, [0], sizes, nbytes)
    assert p.sizes == ((( 100, 300),), ((200, 200),))
    assert p.stages[0].act_bytes == 200 and p.stages[0].F == pytest.approx(0.02)
    assert p.compute_cv == pytest.approx(0.0, abs=1e-12)
    # Without the bytes beside the samples, the spread is the seconds' own (hand: F and B each
    # 0.01/0.02 off their mean at two of four samples -> sqrt(2 * 0.5**2 / 4) = 0.3536).
    q = profile_from_samples(compute, {}, 1, [0], sizes)
    assert q.compute_cv == pytest.approx(math.sqrt(0.5 ** 2 / 2))


def test_the_suites_profile_measures_two_steps_of_sizes_under_its_own_seed():
    cfg = suite.suite_config("seqlen", 4, 1, "1f1b", 0)
    p = profile_of_config(cfg)
    model = replace(cfg, seed=PROFILE_SEED).duration_model()
    want = tuple(tuple(tuple(model.act_bytes(k, s, m) for m in range(16)) for s in range(4)) for k in range(2))
    assert p.sizes == want and len({b for b in want[0][0]}) > 1
    # Never the judged run's draws (seed 0).
    judged = cfg.duration_model()
    assert p.sizes[0][0] != tuple(judged.act_bytes(0, 0, m) for m in range(16))


# ------------------------------------------------------------------ the ranking


def _by_hand(hint, stages, ratio, budget, M):
    """``hint``'s makespan from the engine, with every duration and size written out here."""
    place = Placement(len(stages))
    spec, h, strict = resolve_hint(hint, place, M, inflight_limit=[M] * len(stages))

    def duration(step, r, task):
        return getattr(stages[task.stage], task.kind) * ratio[task.stage][task.mb]

    def size(step, s, m):
        return round(stages[s].act_bytes * ratio[s][m])

    return simulate(spec, h, duration, strict=strict, inflight_limit=[M] * len(stages), act_bytes=size,
                    memory_budget=budget, record=False).makespan


def test_the_ranking_simulates_each_measured_steps_own_sizes():
    M = 8
    stages = tuple(StageCost(0.010, 0.020, 0.010, 0.010, 1000, 1) for _ in range(4))
    sizes = ([[500, 1500, 500, 1500, 1000, 1000, 500, 1500]] * 4, [[1000] * 4 + [1500, 500] * 2] * 4)
    r = ratios(sizes, 4, M)
    prof = Profile(stages, (0.0, 0.0, 0.0), 0.0, 0.0, sizes)
    budget = [4000, 3000, 2000, 1000]
    got = rank(prof, n_ranks=4, n_microbatches=M, limit=M, memory_budget=budget)
    for hint, t in got.order:
        want = statistics.fmean(_by_hand(hint, stages, r[k], budget, M) for k in range(2))
        assert t == pytest.approx(want), hint


def test_at_seqlen_the_memory_aware_candidate_is_no_longer_simulated_as_the_strict_split():
    # On main the ranking's profile had one size per stage: strict-split, backfill, bfw-mem and
    # wfloat simulated the same makespan to the last digit here, and bfw-mem (4.3% faster at
    # seed 0, the one-stage oracle table's minimum) lost the tie and never ran in the trial.
    run = simulate_auto(suite.suite_config("seqlen", 4, 1, "1f1b", 0))
    sim = dict(run.ranking.order)
    assert sim["bfw-mem"] != sim["strict-split"] and "bfw-mem" in run.walls
    assert run.chosen == "bfw-mem"


def test_steady_sizes_rank_as_before():
    # J2 draws no sizes: the profile's sizes are all alike and the ranking is the means' alone.
    cfg = suite.suite_config("J2", 4, 1, "1f1b", 0)
    p = profile_of_config(cfg)
    assert ratios(p.sizes, 4, 16) == []
    plain = Profile(p.stages, p.links, p.compute_cv, p.message_cv)
    kw = dict(n_ranks=4, n_microbatches=16, limit=cfg.limit, memory_budget="1f1b")
    assert rank(p, **kw).order == rank(plain, **kw).order


# ------------------------------------------------------------------ the runtime's measuring steps

M = 4
ACT = 1000


class _Share:
    """Two processes' shares in one event loop: each call waits for the other's part."""

    def __init__(self, parts: dict, r: int) -> None:
        self.parts, self.r, self.seq = parts, r, 0

    async def gather(self, items):
        self.seq += 1
        got = self.parts.setdefault(self.seq, {})
        got[self.r] = list(items)
        while len(got) < 2:
            await asyncio.sleep(0)  # the other process's coroutine runs (one event loop)
        return got[0] + got[1]

    async def max(self, x):
        return max(await self.gather([x]))

    async def sum(self, x):
        return sum(await self.gather([x]))


def _process(r: int):
    spec, hint, strict = resolve_hint("strict-1f1b", Placement(2), M)
    # Microbatch m holds (m + 1) x ACT bytes on stage 0 and half that on stage 1, in every step.
    sizer = lambda s, m: (m + 1) * ACT // (1 + s)  # noqa: E731
    rt = SimpleNamespace(rank=r, stages={r: SimpleNamespace(dw_builder=object())}, hooks=SimpleNamespace(final_kind="B"),
                         loop=SimpleNamespace(record=False), sizer=sizer, spec=spec, hint=hint, strict=strict,
                         inflight_limit=M, memory_budget=10 * ACT)
    rt.set_hint = lambda *a: RankRuntime.set_hint(rt, *a)
    pipe = SimpleNamespace(spec=spec, hint=hint, strict=strict, n_microbatches=M, runtime=rt, runtimes=[rt],
                           plan=SimpleNamespace(limits=[M, M], budget=10 * ACT), config=RuntimeConfig())
    pipe.set_hint = lambda text: FrontDoor.set_hint(pipe, text)
    return pipe


def _stats(pipe, r: int):
    """Rank ``r``'s records: microbatch m's tasks take (m + 1) units of 1/1024 s per unit of cost."""
    t, recs = 0.0, []
    for task in pipe.spec.all_tasks():
        if task.stage == r:
            d = {"F": 1, "B": 2, "I": 1, "W": 1}[task.kind] * (task.mb + 1) / 1024
            recs.append(TaskRecord(r, 0, task, t, t + d))
            t += d
    return SimpleNamespace(wall=t, records=recs)


def test_every_process_ranks_on_every_microbatchs_measured_bytes():
    parts: dict = {}
    pipes = [_process(r) for r in range(2)]
    ctls = [AutoHint(p, _Share(parts, r), recheck_every=0) for r, p in enumerate(pipes)]

    async def both(k):
        await asyncio.gather(*(c.after_step(k, [_stats(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))))

    for k in range(3):  # warm-up, strict, a split candidate
        for c in ctls:
            c.before_step(k)
        asyncio.run(both(k))
    want = (((1000, 2000, 3000, 4000), (500, 1000, 1500, 2000)),) * 2  # two measuring steps (hand)
    for c in ctls:
        assert c.profile.sizes == want
        assert [s.act_bytes for s in c.profile.stages] == [2500, 1250]
        # Seconds grow as the bytes do: nothing left for the noise.
        assert c.profile.compute_cv == pytest.approx(0.0, abs=1e-12)
    assert ctls[0].ranking.order == ctls[1].ranking.order and ctls[0].trial == ctls[1].trial


def test_a_local_pipeline_with_a_budget_measures_each_microbatchs_bytes():
    # 2 stages of Linear(6, 6) + Tanh; microbatch m has 2 (m + 1) rows. What autograd saves per
    # stage and microbatch (parameters excluded), rows x 6 float32 each: Linear's input and
    # Tanh's output (48 bytes per row), and on the last stage the loss's target too (its input
    # is Tanh's output, one storage counted once): 72.
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)]
    rows = [2 * (m + 1) for m in range(M)]
    with rrfp.LocalPipeline(mods, M, tF.mse_loss, memory_budget="1MiB") as pipe:
        assert pipe.auto is not None
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            xs = [(torch.randn(n, 6, generator=g),) for n in rows]
            ys = [torch.randn(n, 6, generator=g) for n in rows]
            pipe.step(microbatches=xs, targets=ys)
        prof = pipe.auto.profile
        want = (tuple(48 * n for n in rows), tuple(72 * n for n in rows))
        assert prof.sizes == (want, want)  # both measuring steps: under the budget bf's, then bfw-mem's
        assert pipe.auto.ranking is not None and pipe.auto.trial


@pytest.mark.parametrize("bad,what", [
    (lambda x: ("s", x[1], x[2]), "('s', 1, 0)"),                         # cut short
    (lambda x: ("s", x[1], x[2], -x[3]), "('s', 1, 0, -500)"),           # negative bytes
    (lambda x: ("s", x[1], M + x[2], x[3]), f"('s', 1, {M}, 500)"),      # a microbatch this pipeline lacks
    (lambda x: ("s", 7, x[2], x[3]), "('s', 7, 0, 500)"),                # a stage it lacks
    (lambda x: ("s", x[1], x[2], 10 ** 30), "('s', 1, 0, " + str(10 ** 30) + ")"),  # beyond 2**53 bytes
    (lambda x: ("s", x[1], x[2], "500"), "('s', 1, 0, '500')"),          # not an int
])
def test_a_malformed_size_item_is_one_error_naming_it_on_every_process(bad, what):
    """A peer's size items that this code cannot send (a peer running other code): every process
    refuses them with the same PipelineError naming the item (not an IndexError, KeyError or a
    cost model's error later), before any ranking: the ranks stay in step and nobody waits."""
    from rrfp.errors import PipelineError

    parts: dict = {}
    pipes = [_process(r) for r in range(2)]

    class Forged(_Share):
        async def gather(self, items):
            if self.r == 1 and any(type(x) is tuple and x[0] == "s" for x in items):  # rank 1's first size item, forged
                i = next(j for j, x in enumerate(items) if x[0] == "s")
                items = [*items[:i], bad(items[i]), *items[i + 1:]]
            return await _Share.gather(self, items)

    ctls = [AutoHint(p, Forged(parts, r), recheck_every=0) for r, p in enumerate(pipes)]

    async def both(k):
        return await asyncio.gather(*(c.after_step(k, [_stats(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))),
                                    return_exceptions=True)

    for c in ctls:
        c.before_step(0)
    assert asyncio.run(both(0)) == [None, None]  # the warm-up step shares only whether a rank has a budget
    for c in ctls:
        c.before_step(1)
    got = asyncio.run(both(1))
    assert [type(e) for e in got] == [PipelineError, PipelineError], got
    assert str(got[0]) == str(got[1]) == (
        f"auto: a malformed activation size item {what}: expected ('s', stage 0..1, microbatch 0..{M - 1}, "
        "bytes 0..2**53)")
    assert all(c.ranking is None for c in ctls)


def test_under_gradient_accumulation_each_sample_is_paired_with_its_own_microbatchs_bytes():
    """``rrfp train --grad-accum 2`` hands auto one optimizer step's stats: two pipeline steps'
    records (rrfp/train/accum.py), while the sizer holds only the last pipeline step's bytes.
    Here microbatch m holds and takes (M - m) units in the first pipeline step and (m + 1) in
    the second: every task's seconds are exactly proportional to its own bytes, so nothing is
    left for the noise. Pairing the first pipeline step's seconds with the second's bytes
    (microbatch 0: 4 units of time against 1 of bytes) made a spread out of nothing."""
    parts: dict = {}
    pipes = [_process(r) for r in range(2)]
    ctls = [AutoHint(p, _Share(parts, r), recheck_every=0) for r, p in enumerate(pipes)]

    def accumulated(pipe, r):
        t, recs = 0.0, []
        for step, units in ((0, lambda m: M - m), (1, lambda m: m + 1)):  # the sizer: step 1's
            for task in pipe.spec.all_tasks():
                if task.stage == r:
                    d = {"F": 1, "B": 2, "I": 1, "W": 1}[task.kind] * units(task.mb) / 1024
                    recs.append(TaskRecord(r, step, task, t, t + d))
                    t += d
        return SimpleNamespace(wall=t, records=recs)

    async def both(k):
        await asyncio.gather(*(c.after_step(k, [accumulated(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))))

    for k in range(3):
        for c in ctls:
            c.before_step(k)
        asyncio.run(both(k))
    for c in ctls:
        assert c.profile.compute_cv == pytest.approx(0.0, abs=1e-12)
    assert ctls[0].ranking.order == ctls[1].ranking.order
