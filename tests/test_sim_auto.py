"""``auto``'s pure half (rrfp.sim.auto): the profile, the candidates, the ranking."""

from __future__ import annotations

import logging

import pytest

from rrfp.sim.auto import CANDIDATES, PROFILE_SEED, Profile, known_candidates, profile_from_samples, profile_of_config, rank
from rrfp.sim.compare import SimConfig, run_one
from rrfp.sim.costs import CostModel, StageCost
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
    assert CANDIDATES[0] == "strict" and "strict-split" in CANDIDATES and "backfill" in CANDIDATES
