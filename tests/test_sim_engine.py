"""The simulator against closed forms: classic bubble fractions, BF = 1F1B, memory, steps.

RRFP "Bounds": with balanced stages and no communication, GPipe and 1F1B take
``(m + p - 1)(t_f + t_b)`` and every rank idles ``(p - 1) / (m + p - 1)`` of it; BF with
1F1B's in-flight limits reproduces 1F1B (RRFP §4).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.hints import Hint
from rrfp.scheduler.tasks import PipelineSpec, Task
from rrfp.scheduler.schedules import one_f_one_b_limits
from rrfp.sim.engine import DeadlockError, TaskRecord, simulate

CASES = [(p, m, tf, tb) for p in (1, 2, 4, 7) for m in (1, 3, 8, 13) for tf, tb in ((1.0, 1.0), (1.0, 2.0), (3.0, 1.0))]


def _run(hint: str, p: int, m: int, tf: float, tb: float, **kw):
    spec, h, strict = resolve_hint(hint, Placement(p), m)
    return simulate(spec, h, lambda s, r, t: tf if t.kind == "F" else tb, strict=strict, **kw)


def _orders(res, p):
    return [[x.task for x in res.records if x.rank == r] for r in range(p)]


@pytest.mark.parametrize("hint", ["strict-gpipe", "strict-1f1b"])
@pytest.mark.parametrize("p,m,tf,tb", CASES)
def test_classic_bubble_fraction(hint: str, p: int, m: int, tf: float, tb: float) -> None:
    res = _run(hint, p, m, tf, tb)
    assert res.makespan == pytest.approx((m + p - 1) * (tf + tb), rel=1e-12)
    for b in res.bubble_fraction():
        assert b == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p,m,tf,tb", CASES)
def test_bf_with_1f1b_limits_is_1f1b(p: int, m: int, tf: float, tb: float) -> None:
    ref = _run("strict-1f1b", p, m, tf, tb)
    bf = _run("bf", p, m, tf, tb, inflight_limit=one_f_one_b_limits(p))
    assert bf.makespan == ref.makespan
    assert _orders(bf, p) == _orders(ref, p)
    assert bf.peak_inflight == ref.peak_inflight
    unlimited = _run("bf", p, m, tf, tb, inflight_limit=10**6)
    assert unlimited.makespan == ref.makespan


def test_peak_inflight_per_stage_matches_1f1b_memory() -> None:
    p, m = 5, 12
    res = _run("strict-1f1b", p, m, 1.0, 2.0)
    assert res.peak_inflight_stage == [p - s for s in range(p)]
    gpipe = _run("strict-gpipe", p, m, 1.0, 2.0)
    assert gpipe.peak_inflight_stage == [m] * p


def test_records_are_complete_and_consistent() -> None:
    spec, h, strict = resolve_hint("bfw", Placement(3, 2), 6)
    res = simulate(spec, h, lambda s, r, t: 1.0 + 0.1 * t.stage, steps=2)
    assert len(res.records) == 2 * len(spec.all_tasks())
    assert all(isinstance(x, TaskRecord) and x.end > x.start for x in res.records)
    assert max(x.end for x in res.records) == res.makespan
    busy = [sum(x.end - x.start for x in res.records if x.rank == r) for r in range(3)]
    assert busy == pytest.approx(res.busy)
    assert res.step_end[0] < res.step_end[1] == res.makespan


def test_step_overhead_delays_each_rank_between_steps() -> None:
    one = _run("strict-1f1b", 3, 4, 1.0, 1.0, steps=2)
    slow = _run("strict-1f1b", 3, 4, 1.0, 1.0, steps=2, step_overhead=5.0)
    assert slow.makespan >= one.makespan + 5.0 - 1e-9
    for r in range(3):
        recs = sorted((x for x in slow.records if x.rank == r), key=lambda x: x.start)
        end0 = max(x.end for x in recs if x.step == 0)
        start1 = min(x.start for x in recs if x.step == 1)
        assert start1 >= end0 + 5.0 - 1e-9


def test_deterministic_and_record_flag_does_not_change_the_run() -> None:
    spec, h, _ = resolve_hint("bf", Placement(4, 2), 8)

    def dur(s, r, t):
        return 1.0 + ((t.stage * 7 + t.mb * 3) % 5) * 0.25

    a = simulate(spec, h, dur, delay=lambda k, s, d, t: 0.5)
    b = simulate(spec, h, dur, delay=lambda k, s, d, t: 0.5)
    c = simulate(spec, h, dur, delay=lambda k, s, d, t: 0.5, record=False)
    assert [(x.rank, x.task, x.start) for x in a.records] == [(x.rank, x.task, x.start) for x in b.records]
    assert a.makespan == c.makespan and a.busy == c.busy and c.records == []


def test_message_delay_applies_only_across_ranks() -> None:
    # Two virtual stages on one rank: no message crosses ranks, so the delay is never paid.
    spec, h, _ = resolve_hint("bf", Placement(1, 2), 2)
    calls = []
    res = simulate(spec, h, lambda s, r, t: 1.0, delay=lambda *a: calls.append(a) or 10.0)
    assert calls == [] and res.makespan == 8.0


def test_limit_list_length_is_checked() -> None:
    spec, h, _ = resolve_hint("bf", Placement(3), 4)
    with pytest.raises(ValueError, match="3 ranks"):
        simulate(spec, h, lambda s, r, t: 1.0, inflight_limit=[1, 2])


def test_deadlock_names_the_waiting_rank() -> None:
    # Rank 1's strict order puts B(1, 0) before the F(1, 0) it needs (resolve_hint would
    # refuse it; the engine must still fail in words rather than hang).
    spec = PipelineSpec(Placement(2), 1)
    bad = Hint("bad", order=[[Task(0, "F", 0), Task(0, "B", 0)], [Task(1, "B", 0), Task(1, "F", 0)]])
    with pytest.raises(DeadlockError, match="rank 1"):
        simulate(spec, bad, lambda s, r, t: 1.0, strict=True)


@settings(max_examples=int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "100")), deadline=None, derandomize=True,
          database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(2, 4),
    v=st.integers(1, 2),
    m=st.integers(2, 8),
    name=st.sampled_from(["bf", "fb", "bfw", "bfw-df", "b-priority", "f-priority", "bfw-alt", "1f1b", "gpipe",
                          "interleaved-1f1b", "zb-v", "split"]),
    strict=st.booleans(),
    limit=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_inlined_decision_runs_what_arbiter_next_runs(p, v, m, name, strict, limit, seed):
    """The run loop's inlined decision (engine.INLINE_DECISIONS: the policy's next_taken, the
    running task set by the loop) against Arbiter.next itself: the same records, peaks and
    makespan under random task times and message delays."""
    import random

    from rrfp.sim import engine

    try:
        spec, hint, _ = resolve_hint(("strict-" if strict else "") + name, Placement(p, v, "v" if name == "zb-v" else "loop"), m)
    except ValueError:
        assume(False)

    def draw(*key) -> float:
        return random.Random(hash((seed, *key))).uniform(0.5, 2.0)

    def run():
        res = simulate(spec, hint, lambda k, r, t: draw(k, r, *t), strict=strict, inflight_limit=limit, steps=2,
                       delay=lambda k, a, b, t: draw("d", k, a, b, *t) - 0.5)
        return [(x.rank, x.step, tuple(x.task), x.start, x.end) for x in res.records], res.peak_inflight, res.makespan

    inlined = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "INLINE_DECISIONS", False)
        assert run() == inlined
