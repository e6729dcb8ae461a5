"""benchmarks/auto_misses.py: which step of ``auto`` lost the best candidate, and how many points
one kept candidate per point can have within 2% at most."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import auto_misses as am  # noqa: E402
from rrfp.sim import auto, suite  # noqa: E402
from rrfp.sim.trial import keep as keep_rule  # noqa: E402


def point(ms: dict[str, float], order: list[tuple[str, float]], walls: dict[str, list[float]], chosen: str,
          seed: int = 0) -> am.Point:
    rk = auto.Ranking(order, "strict-1f1b", [])
    run = auto.AutoRun(rk, {h: [(t, 0.0) for t in w] for h, w in walls.items()}, chosen)
    return am.Point("J2", 4, 1, "loop", "1f1b", seed, run, ms)


ORDER = [("strict-split", 0.70), ("backfill", 0.70), ("bfw-mem", 0.70), ("strict-1f1b", 0.80)]


def test_a_best_candidate_outside_the_trial_is_the_rankings_loss():
    # bfw-mem simulated as fast as the two tried (a tie), never tried, fastest here.
    p = point({"strict-split": 0.75, "backfill": 0.75, "bfw-mem": 0.70, "strict-1f1b": 0.80}, ORDER,
              {"strict-1f1b": [0.8] * 3, "strict-split": [0.7] * 3, "backfill": [0.71] * 3}, "strict-split")
    assert p.best == "bfw-mem" and abs(p.ratio() - 0.75 / 0.70) < 1e-12
    assert p.missed and p.cause() == "ranking (tie)"
    slower = [("strict-split", 0.70), ("backfill", 0.70), ("bfw-mem", 0.71), ("strict-1f1b", 0.80)]
    q = point(p.makespan, slower, {h: [t for t, _ in w] for h, w in p.run.walls.items()}, "strict-split")
    assert q.cause() == "ranking"


def test_the_trial_and_the_keep_rule_are_told_apart():
    ms = {"strict-1f1b": 0.80, "strict-split": 0.75, "backfill": 0.70}
    # backfill was tried and measured slower than strict-split: the trial's steps misled.
    trial = point(ms, ORDER, {"strict-1f1b": [0.8] * 3, "strict-split": [0.70] * 3, "backfill": [0.72] * 3},
                  "strict-split")
    assert trial.cause() == "trial"
    # backfill measured fastest, by 0.5% (< the 1% tie): the order of preference kept strict-split.
    walls = {"strict-1f1b": [0.8] * 3, "strict-split": [0.70] * 3, "backfill": [0.6965] * 3}
    assert keep_rule({h: [(t, 0.0) for t in w] for h, w in walls.items()}, "strict-1f1b") == "strict-split"
    keep = point(ms, ORDER, walls, "strict-split")
    assert keep.cause() == "keep" and keep.missed
    # Within 2%: not a miss, whatever the cause.
    near = point({**ms, "strict-split": 0.71}, ORDER, walls, "strict-split")
    assert not near.missed and am.cells([near])[1] == []


def test_the_ceiling_keeps_one_candidate_per_point():
    walls = {"strict-1f1b": [0.8] * 3}
    order = [("a", 1.0), ("b", 1.0), ("strict-1f1b", 1.2)]
    # Seed 0: a best, b within 2%; seed 1: b best, a 5% slower; seed 2: a best, b 5% slower.
    pts = [point({"a": 1.00, "b": 1.015, "strict-1f1b": 1.2}, order, walls, "a", 0),
           point({"a": 1.05, "b": 1.00, "strict-1f1b": 1.2}, order, walls, "a", 1),
           point({"a": 1.00, "b": 1.05, "strict-1f1b": 1.2}, order, walls, "a", 2)]
    assert am.ceiling(pts) == 2  # a at seeds 0 and 2, or b at 0 and 1; none at all three
    assert am.summary(pts)["within"] == 2


def test_the_points_agree_with_the_suites_own_count():
    kw = dict(scenarios=["J2", "seqlen"], ranks=[4], layouts=[(1, "loop")], memories=["1f1b"], seeds=[0, 1, 2])
    pts = am.run_points(**kw)
    rows = suite.run_suite([auto.AUTO], **kw)
    assert [(p.scenario, p.seed, p.run.chosen) for p in pts] == [(r.scenario, r.seed, r.auto_choice) for r in rows]
    hits, n = suite.auto_within(rows)
    assert (am.summary(pts)["within"], len(pts)) == (hits, n)
    for p, r in zip(pts, rows):
        assert {h: round(t, 9) for h, t in p.makespan.items()} == {h: round(r.makespan[h], 9) for h in p.makespan}
