"""``auto``'s pure half (rrfp.sim.auto): the profile, the candidates, the ranking, the trial and
the rule that keeps a hint from trial step times."""

from __future__ import annotations

import logging

import pytest

from rrfp.sim.auto import (PROFILE_SEED, TRIAL_SEED, Profile, all_candidates, batch_work, known_candidates,
                           profile_from_samples, profile_of_config, rank, simulate_auto)
from rrfp.sim.trial import (EXTRA_ROUNDS, SPREAD_MAD, TIE, TRIAL_ROUNDS, keep, margin, medians, preference, scaled, spread,
                            trial_candidates, trial_order, undecided)
from rrfp.sim.compare import SimConfig, run_one
from rrfp.sim.costs import CostModel, StageCost
from rrfp.scheduler.tasks import F, Task
from rrfp.sim.suite import SLOW_LINK, suite_config


def test_unknown_candidates_are_skipped_and_logged(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="rrfp.auto"):
        known, skipped = known_candidates(4, 1, "loop", 8, ("strict", "no-such-policy", "bf"))
    assert known == ["strict-1f1b", "bf"]
    assert [n for n, _ in skipped] == ["no-such-policy"]
    assert "no-such-policy skipped" in caplog.text
    # The placement's strict schedule stands for "strict".
    assert known_candidates(4, 2, "v", 8, ("strict",))[0] == ["strict-zb-v"]
    assert known_candidates(4, 2, "loop", 8, ("strict",))[0] == ["strict-interleaved-1f1b"]


def test_ranking_orders_the_candidates_by_their_own_simulations() -> None:
    st = tuple(StageCost(0.010, 0.020, 0.013, 0.013, 1000, 1) for _ in range(4))
    prof = Profile(st, (0.0, 0.0, 0.0))
    r = rank(prof, n_ranks=4, n_microbatches=8, limit=8, candidates=("strict", "bf", "bfw-mem"))
    ref = {h: run_one(SimConfig(n_ranks=4, n_microbatches=8, limit=8, costs=CostModel(st), seed=PROFILE_SEED),
                      h, record=False)[0].makespan for h in ("strict-1f1b", "bf", "bfw-mem")}
    assert dict(r.order) == pytest.approx(ref)
    assert [h for h, _ in r.order] == sorted(ref, key=lambda h: (round(ref[h], 12), h != "strict-1f1b"))
    # bf equals strict 1F1B with steady costs at one stage per rank: the tie goes to strict.
    assert ref["bf"] == pytest.approx(ref["strict-1f1b"])
    assert [h for h, _ in r.order].index("strict-1f1b") < [h for h, _ in r.order].index("bf")


def test_a_costly_split_backward_loses_to_the_strict_schedule() -> None:
    # I + W = 2 B: what bubble filling gains, the split's extra work loses.
    costly = Profile(tuple(StageCost(0.010, 0.020, 0.020, 0.020, 1000, 1) for _ in range(4)), (0.0, 0.0, 0.0))
    assert rank(costly, n_ranks=4, n_microbatches=8, limit=8, candidates=("strict", "bf", "bfw-mem")).best == "strict-1f1b"
    cheap = Profile(tuple(StageCost(0.010, 0.020, 0.010, 0.010, 1000, 1) for _ in range(4)), (0.0, 0.0, 0.0))
    assert rank(cheap, n_ranks=4, n_microbatches=8, limit=8, candidates=("strict", "bf", "bfw-mem")).best == "bfw-mem"


def test_the_reason_puts_the_speedup_beside_the_best_hint_not_the_last_listed() -> None:
    # A user read "strict-split 80.3 ms (1.005x over strict-1f1b)" as strict-split's speedup,
    # while the figure is the best's (71.9 vs 72.3 ms).
    from rrfp.sim.auto import Ranking
    r = Ranking([("bf", 0.0719), ("strict-1f1b", 0.0723), ("strict-split", 0.0803)], "strict-1f1b", [])
    assert r.reason() == ("simulated step: bf 71.9 ms (1.006x over strict-1f1b), strict-1f1b 72.3 ms, "
                          "strict-split 80.3 ms")
    assert Ranking([("strict-1f1b", 0.07), ("bf", 0.08)], "strict-1f1b", []).reason() == \
        "simulated step: strict-1f1b 70.0 ms, bf 80.0 ms"


def test_describe_names_the_task_spreads_apart_from_the_trial_steps_spread() -> None:
    # The chose-line says "faster counts beyond 5.7% (the tie 1% or the steps' spread)" and then
    # described the profile as "spread 66% / 0%": two spreads, the second unnamed.
    prof = Profile((StageCost(0.002, 0.004, 0.003, 0.001, 0, 1), StageCost(0.004, 0.006, 0.005, 0.001, 0, 1)),
                   (0.0005,), compute_cv=0.66, message_cv=0.0)
    assert prof.describe() == ("F 3.00 B 5.00 I 4.00 W 1.00 ms/stage, messages 0.50 ms, "
                               "task time std/mean: compute 66%, messages 0%")


def test_profile_of_a_steady_scenario_is_its_cost_model() -> None:
    prof = profile_of_config(suite_config("J0", 4, 1, "1f1b"))
    assert all((c.F, c.B, c.I, c.W) == (0.010, 0.020, 0.010, 0.010) for c in prof.stages)
    assert prof.compute_cv == 0 and prof.links == (0.0, 0.0, 0.0)
    slow = profile_of_config(suite_config("slow-link", 4, 1, "1f1b"))
    assert slow.links == pytest.approx((0.002, 0.002 * SLOW_LINK, 0.002))
    noisy = profile_of_config(suite_config("J2", 4, 1, "1f1b"))
    assert noisy.compute_cv > 0.1 and all(c.F > 0.010 for c in noisy.stages)  # J2 adds delay on average


def test_profile_from_samples_means_spread_and_errors() -> None:
    prof = profile_from_samples({(0, "F"): [1.0, 3.0], (0, "B"): [4.0, 4.0], (1, "F"): [2.0], (1, "I"): [1.0],
                                 (1, "W"): [2.0]}, {0: [0.5]}, 2, [10, 20])
    assert (prof.stages[0].F, prof.stages[0].B, prof.stages[1].B) == (2.0, 4.0, 3.0)
    assert prof.links == (0.5,)
    # Pooled over the groups of two or more: F deviates by -1/2 and +1/2 of its mean, B by 0.
    assert prof.compute_cv == pytest.approx((0.5 / 4) ** 0.5)
    with pytest.raises(ValueError, match="stage 1 lacks"):
        profile_from_samples({(0, "F"): [1.0], (0, "B"): [1.0], (1, "F"): [1.0]}, {}, 2, [0, 0])


def test_candidates_are_data() -> None:
    # The built-in entries that allow auto, in their tie order (the order before the hint table).
    assert all_candidates() == ("strict", "strict-split", "backfill", "bf", "bfw-mem", "wfloat")


@pytest.mark.parametrize("layout", [(1, "loop"), (2, "loop"), (2, "v")])
def test_every_candidate_resolves_on_the_suites_placements(layout) -> None:
    known, skipped = known_candidates(4, layout[0], layout[1], 16)
    assert skipped == [] and "wfloat" in known and len(known) == len(all_candidates())


def _steps(*times: float, work: float = 0.0) -> list[tuple[float, float]]:
    return [(t, work) for t in times]


def test_keep_takes_the_smallest_median_and_never_a_policy_slower_than_strict() -> None:
    # Medians: strict 1.0, bf 0.9 (its 5.0 is one outlier step), bfw-mem 0.98 (no forward
    # figures: the times are compared as measured).
    walls = {"strict-1f1b": _steps(1.0, 1.01, 0.99), "bf": _steps(0.9, 5.0, 0.89), "bfw-mem": _steps(0.98, 0.98, 0.98)}
    assert medians(walls) == {"strict-1f1b": 1.0, "bf": 0.9, "bfw-mem": 0.98}
    # The spread: deviations 0.01, 0.01 (strict), 4.56, 0.011 (bf), 0, 0; median 0.01 x 1.4826
    # (the outlier does not widen it).
    assert spread(walls) == pytest.approx(0.01 * 1.4826, rel=1e-6)
    assert keep(walls, "strict-1f1b") == "bf"
    # Faster than strict by less than TIE: strict stays; slower: strict stays.
    assert keep({"strict-1f1b": _steps(1.0), "bf": _steps(1.0 - TIE / 2)}, "strict-1f1b") == "strict-1f1b"
    assert keep({"strict-1f1b": _steps(1.0), "bf": _steps(1.0 - 2 * TIE)}, "strict-1f1b") == "bf"
    assert keep({"strict-1f1b": _steps(1.0), "bf": _steps(1.2)}, "strict-1f1b") == "strict-1f1b"
    # Without a strict schedule the smallest median wins, beyond the tie.
    assert keep({"bf": _steps(1.0), "bfw-mem": _steps(1.0 - 2 * TIE)}, None) == "bfw-mem"
    with pytest.raises(ValueError, match="no trial step"):
        keep({"bf": []}, "strict-1f1b")


def test_among_tied_hints_keep_takes_the_fixed_order_of_preference() -> None:
    # bf, bfw-mem and wfloat are within TIE of the fastest (bfw-mem, 0.895: 0.895 > 0.99 x 0.9
    # and > 0.99 x 0.897); strict (1.0) is not. all_candidates()' order puts bf first, whichever of
    # the three the noise made fastest.
    assert preference(["wfloat", "bfw-mem", "zz", "bf", "strict-1f1b"], "strict-1f1b") == [
        "strict-1f1b", "bf", "bfw-mem", "wfloat", "zz"]
    for times in [(0.900, 0.895, 0.897), (0.895, 0.900, 0.897), (0.897, 0.899, 0.895)]:
        walls = {"strict-1f1b": _steps(1.0), **{h: _steps(t) for h, t in zip(("bf", "bfw-mem", "wfloat"), times)}}
        assert keep(walls, "strict-1f1b") == "bf", times
    # A gain beyond the tie wins over the order: bfw-mem 0.88 < 0.99 x 0.9.
    assert keep({"strict-1f1b": _steps(1.0), "bf": _steps(0.9), "bfw-mem": _steps(0.88)}, "strict-1f1b") == "bfw-mem"
    # The order given (auto passes its known candidates) replaces all_candidates()'.
    assert keep({"bf": _steps(0.9), "bfw-mem": _steps(0.895)}, None, prefer=["bfw-mem", "bf"]) == "bfw-mem"
    # Without a strict schedule, within the tie: the preferred one, whichever is faster.
    assert keep({"bf": _steps(1.0), "bfw-mem": _steps(0.999)}, None) == "bf"


def test_an_incumbent_is_kept_unless_beaten_beyond_the_tie() -> None:
    walls = {"strict-1f1b": _steps(1.0), "bf": _steps(0.9), "bfw-mem": _steps(0.895)}
    # bf leads the preference, but the kept hint (a re-check's incumbent) stays within the tie.
    assert keep(walls, "strict-1f1b") == "bf"
    assert keep(walls, "strict-1f1b", incumbent="bfw-mem") == "bfw-mem"
    assert keep(walls, "strict-1f1b", incumbent="strict-1f1b") == "bf"  # beaten by 10%: a switch
    # Measured faster than the incumbent by more than the tie: 0.9 < 0.99 x 0.92.
    assert keep({**walls, "bfw-mem": _steps(0.92)}, "strict-1f1b", incumbent="bfw-mem") == "bf"
    # Exactly at the tie's edge the faster one counts as beyond it (as for strict before).
    assert keep({"strict-1f1b": _steps(1.0), "bf": _steps(1.0 - TIE)}, "strict-1f1b") == "bf"


def test_a_difference_within_the_steps_own_spread_is_a_tie() -> None:
    # strict and bf are the same hint to the noise: each step 10% off its median now and then.
    # bf's median is 5% lower, less than the measured spread (about 10%): strict stays.
    noisy = {"strict-1f1b": _steps(1.0, 1.1, 0.9), "bf": _steps(0.95, 1.045, 0.855)}
    assert spread(noisy) == pytest.approx(0.1 * 1.4826, rel=1e-6)
    assert margin(noisy) == spread(noisy) and margin({"bf": _steps(1.0)}) == TIE
    assert keep(noisy, "strict-1f1b") == "strict-1f1b"
    # The same 5% gain on steady steps is beyond the tie and kept.
    assert keep({"strict-1f1b": _steps(1.0, 1.0, 1.0), "bf": _steps(0.95, 0.95, 0.95)}, "strict-1f1b") == "bf"
    # A gain beyond the spread is kept on noisy steps too.
    assert keep({**noisy, "bf": _steps(0.8, 0.88, 0.72)}, "strict-1f1b") == "bf"


def test_keep_compares_steps_at_equal_batch_work() -> None:
    # Hand-made steps: strict takes 0.2 s + 1 s per unit of work, bf 0.25 s + 1 s per unit, but
    # bf drew the short batches (work 0.8-1.0 against strict's 1.0-1.2), so its raw median is
    # the smaller (1.15 s against 1.3 s).
    trial = {"strict-1f1b": [(1.4, 1.2), (1.3, 1.1), (1.2, 1.0)], "bf": [(1.05, 0.8), (1.15, 0.9), (1.25, 1.0)]}
    # Every pair of steps of one hint gives 1 s per unit; the trial's median work is 1.0:
    # strict 1.4 - (1.2 - 1.0) = 1.2, ...; bf 1.05 - (0.8 - 1.0) = 1.25, ...
    assert scaled(trial) == {"strict-1f1b": pytest.approx([1.2] * 3), "bf": pytest.approx([1.25] * 3)}
    assert keep(trial, "strict-1f1b") == "strict-1f1b"
    assert medians({h: [(t, 0.0) for t, _ in s] for h, s in trial.items()}) == {"strict-1f1b": 1.3, "bf": 1.15}
    # A slope, not a proportion: a rescaling by work (t * 1.0 / work) would make strict's steps
    # 1.17-1.2 and bf's 1.25-1.31, reading bf's fixed 0.25 s as work.
    # Steps of one hint at one work give no slope: nothing is adjusted.
    same = {"strict-1f1b": [(1.2, 1.2)] * 3, "bf": [(0.9, 0.8)] * 3}
    assert scaled(same) == {"strict-1f1b": [1.2] * 3, "bf": [0.9] * 3}
    # A hint's own speed is not read as work's: strict's steps, all at work 1.0, and bf's, all at
    # 2.0, give no slope either (pairs across hints are not taken).
    assert scaled({"strict-1f1b": [(1.0, 1.0)] * 3, "bf": [(3.0, 2.0)] * 3})["bf"] == [3.0] * 3
    # One odd step does not set the slope (strict's pairs 1, 1, 1; bf's 50, -48, 1: median 1).
    odd = {"strict-1f1b": [(1.4, 1.2), (1.3, 1.1), (1.2, 1.0)], "bf": [(1.05, 0.8), (6.05, 0.9), (1.25, 1.0)]}
    assert scaled(odd)["strict-1f1b"] == pytest.approx([1.2] * 3)


def test_a_slope_from_nearly_equal_works_does_not_swing_the_adjustment() -> None:
    """Both hints run 0.1 ms per element (bf drew batches of 1500 elements, 0.15 s each;
    strict 1000, 0.1 s, one step of 1001 elements 3 ms slower by noise). The one pair of
    strict's steps that differ in work (by one element) gives 3 ms per element, 30 times the
    real rate: adjusted by it, bf's steps would be -0.6 s and bf kept as the fastest. A step's
    time grows at most in proportion to its work, so the slope is at most the smallest step's
    seconds per element (0.1 ms): every step adjusted to 1250.5 elements is 0.125 s, bar the
    noisy one."""
    trial = {"strict-1f1b": [(0.100, 1000.0), (0.103, 1001.0), (0.100, 1000.0)], "bf": [(0.150, 1500.0)] * 3}
    got = scaled(trial)
    assert got["strict-1f1b"] == pytest.approx([0.125, 0.103 + 0.02495, 0.125], rel=1e-3)
    assert got["bf"] == pytest.approx([0.125] * 3, rel=1e-3)
    assert keep(trial, "strict-1f1b") == "strict-1f1b"
    assert undecided(trial, "strict-1f1b") == []


def test_batch_work_follows_the_inputs_sizes_not_the_forwards_seconds() -> None:
    """The simulated trial's work figure is what a real step's input elements follow: each
    microbatch's sequence-length ratio (times its image count over the mean where stage 0
    encodes images); the jitter and noise drawn on the forwards are not in it."""
    for scenario in ("seqlen", "multimodal", "J3"):
        cfg = suite_config(scenario, 4, 1, "1f1b", seed=5)
        model = cfg.duration_model()
        # Independent reference: a noiseless, jitterless copy of the point's durations, whose
        # stage-0 forward is the stage's cost times exactly that ratio.
        plain = type(model)(model.costs, seed=model.seed, seqlen=model.seqlen, images=model.images,
                            samples_per_microbatch=model.samples_per_microbatch,
                            encoder_stages=model.encoder_stages, encoder_scale=model.encoder_scale)
        f0 = model.costs.stages[0].F * (model.encoder_scale if model.encoder_stages else 1.0)
        ref = sum(plain(0, 0, Task(0, F, m)) / f0 for m in range(cfg.n_microbatches))
        assert batch_work(cfg) == pytest.approx(ref)
        fwd = sum(model(0, 0, Task(0, F, m)) for m in range(cfg.n_microbatches))
        if scenario == "J3":
            assert batch_work(cfg) == cfg.n_microbatches and fwd != pytest.approx(f0 * cfg.n_microbatches)
        else:
            assert batch_work(cfg) != pytest.approx(cfg.n_microbatches, rel=1e-3)


def test_trial_candidates_and_rotation() -> None:
    assert trial_candidates(["bf", "strict-1f1b", "bfw-mem"], "strict-1f1b") == ["strict-1f1b", "bf"]
    assert trial_candidates(["bf", "bfw-mem", "strict-1f1b"], "strict-1f1b") == ["strict-1f1b", "bf", "bfw-mem"]
    t = ["a", "b", "c"]
    rounds = [trial_order(t, r) for r in range(TRIAL_ROUNDS)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    # Three rounds of three: every candidate once in every position.
    assert all(sorted(r[i] for r in rounds[:3]) == t for i in range(3))


@pytest.mark.parametrize("point, extended", [(("J1", 4, 1, "1f1b"), False), (("J2", 4, 2, "1f1b"), True)])
def test_simulate_auto_runs_the_trial_on_draws_of_its_own(point, extended) -> None:
    cfg = suite_config(*point, seed=0)
    run = simulate_auto(cfg)
    trial = trial_candidates([h for h, _ in run.ranking.order], run.ranking.strict)
    assert set(run.walls) == set(trial)
    # Independent reference: step j of the trial is the point's workload under TRIAL_SEED + j,
    # at 1F1B's memory for that step's own sizes, with its batch work (fixed-length sequences:
    # 16 microbatches of size 1 whatever the jitter drew); then, where the fastest by median
    # beat the kept hint by more than the tie, EXTRA_ROUNDS rounds of those two decide.
    j, ref = 0, {h: [] for h in trial}

    def step(h):
        nonlocal j
        cfg_j = suite_config(*point, seed=TRIAL_SEED + j)
        assert batch_work(cfg_j) == 16.0
        ref[h].append((run_one(cfg_j, h, record=False)[0].makespan, 16.0))
        j += 1

    for r in range(TRIAL_ROUNDS):
        for h in trial_order(trial, r):
            step(h)
    med = {h: sorted(t for t, _ in v)[1] for h, v in ref.items()}  # three steps each: the middle one
    fastest, kept = min(med, key=med.get), keep(ref, run.ranking.strict)
    assert (kept != fastest and med[fastest] < (1 - TIE) * med[kept]) == extended
    assert run.extension == ([kept, fastest] if extended else [])
    if extended:
        for r in range(EXTRA_ROUNDS):
            for h in trial_order([kept, fastest], r):
                step(h)
        assert run.chosen == keep({h: ref[h] for h in (kept, fastest)}, run.ranking.strict)
    else:
        assert run.chosen == kept
    assert run.walls == ref
    # The judged seed's draws are not among the trial's: another seed gives the same choice.
    assert simulate_auto(suite_config(*point, seed=7)).walls == run.walls
    assert cfg.seed not in range(TRIAL_SEED, TRIAL_SEED + j) and cfg.seed != PROFILE_SEED


def test_the_margin_narrows_as_the_hints_steps_grow() -> None:
    # Spread by hand: deviations from each hint's median 0.04, 0.04 (odd count: the median's own
    # step left out), median 0.04 x 1.4826 = 5.93%.
    three = {"strict-1f1b": _steps(1.0, 0.96, 1.04), "bf": _steps(0.9, 0.864, 0.936)}
    assert margin(three) == pytest.approx(0.04 * SPREAD_MAD)
    # Six steps each (the same deviations): sqrt(3 / 6) of it; more steps do not narrow it further.
    six = {h: v + v for h, v in three.items()}
    assert spread(six) == pytest.approx(0.04 * SPREAD_MAD)
    assert margin(six) == pytest.approx(0.04 * SPREAD_MAD * (3 / 6) ** 0.5)
    assert margin({h: v * 4 for h, v in three.items()}) == margin(six)
    # The fewest steps count: one hint at three keeps the whole spread.
    assert margin({"strict-1f1b": three["strict-1f1b"], "bf": six["bf"]}) == pytest.approx(0.04 * SPREAD_MAD)
    assert margin({h: _steps(1.0, 1.0, 1.0) for h in three}) == TIE


def test_a_trial_left_to_its_noise_is_undecided_between_the_kept_and_the_fastest() -> None:
    # bf's median is 4% below strict's: beyond the 1% tie, within the 5.9% spread: strict is
    # kept and the two run EXTRA_ROUNDS more rounds.
    noisy = {"strict-1f1b": _steps(1.0, 0.96, 1.04), "bf": _steps(0.96, 0.9216, 0.9984),
             "wfloat": _steps(1.1, 1.056, 1.144)}
    assert keep(noisy, "strict-1f1b") == "strict-1f1b"
    assert undecided(noisy, "strict-1f1b") == ["strict-1f1b", "bf"]
    # Within the tie, or beyond the spread, the trial decided.
    assert undecided({**noisy, "bf": _steps(0.995, 0.9552, 1.0348)}, "strict-1f1b") == []
    beyond = {**noisy, "bf": _steps(0.9, 0.864, 0.936)}
    assert keep(beyond, "strict-1f1b") == "bf" and undecided(beyond, "strict-1f1b") == []
