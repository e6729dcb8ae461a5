"""The makespan lower bound (rrfp.sim.metrics.lower_bound) is never beaten, and is tight where
theory says so.

Random cost models (per-stage costs, injected jitter, lognormal noise, sequence lengths,
images, a straggler, message latency/bandwidth/noise, several steps with an optimizer gap),
every hint resolve_hint knows in both modes, random in-flight limits.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import SCHEDULES, Placement, resolve_hint
from rrfp.scheduler.registry import names
from rrfp.sim.costs import CostModel, StageCost
from rrfp.sim.duration import CommModel, Dist, DurationModel
from rrfp.sim.engine import simulate
from rrfp.sim.jitter import LEVELS
from rrfp.sim.metrics import lower_bound, memory_bound

HINT_NAMES = names(order=False) + tuple(SCHEDULES)  # the policies and the named schedules
EXAMPLES = int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
ALL_HINTS = list(HINT_NAMES) + [f"strict-{h}" for h in HINT_NAMES]
cost = st.floats(min_value=0.001, max_value=0.05)


def _shape(draw, ranks: tuple[int, int], mbs: tuple[int, int], hints: list[str]):
    """A random placement, microbatch count and hint: ``(p, v, spec, hint, strict)``, spec
    None when the hint does not fit."""
    p = draw(st.integers(*ranks))
    v = draw(st.sampled_from([1, 1, 2]))
    kind = draw(st.sampled_from(["loop", "v"])) if v == 2 else "loop"
    m = draw(st.integers(*mbs))
    try:
        return (p, v, *resolve_hint(draw(st.sampled_from(hints)), Placement(p, v, kind), m))
    except ValueError:
        return p, v, None, None, None


@st.composite
def scenario(draw):
    p, v, spec, h, strict = _shape(draw, (1, 4), (1, 7), ALL_HINTS)
    stages = tuple(
        StageCost.from_mapping({"F": draw(cost), "B": draw(cost), "act_bytes": draw(st.integers(0, 10**6))})
        for _ in range(p * v)
    )
    costs = CostModel(stages)
    seed = draw(st.integers(0, 2**31))
    dur = DurationModel(
        costs, seed=seed, jitter=LEVELS[draw(st.sampled_from(list(LEVELS)))],
        noise=draw(st.sampled_from([0.0, 0.3])),
        seqlen=draw(st.sampled_from([None, Dist.parse("uniform:0.5,1.5")])),
        images=draw(st.sampled_from([None, Dist.parse("poisson:2")])),
        encoder_scale=draw(st.sampled_from([1.0, 3.0])),
        stragglers=draw(st.sampled_from([{}, {0: 2.0}])),
    )
    comm = CommModel(costs, latency=draw(st.sampled_from([0.0, 0.002])),
                     bandwidth=draw(st.sampled_from([float("inf"), 1e8])),
                     noise=draw(st.sampled_from([0.0, 0.5])), seed=seed)
    limit = draw(st.sampled_from([1, 2, 3, 32]))
    steps = draw(st.integers(1, 2))
    overhead = draw(st.sampled_from([0.0, 0.01]))
    return spec, (h if spec else None), (strict if spec else None), dur, comm, limit, steps, overhead


@SETTINGS
@given(scenario())
def test_no_schedule_beats_the_lower_bound(sc) -> None:
    spec, h, strict, dur, comm, limit, steps, overhead = sc
    if spec is None:
        return  # hint does not fit this placement
    res = simulate(spec, h, dur, strict=strict, inflight_limit=limit, delay=comm, steps=steps, step_overhead=overhead)
    lb = lower_bound(spec, res.records, delay=comm, steps=steps, step_overhead=overhead)
    assert lb >= 0  # zero when every task is free (an encoder-only pipeline with no images)
    assert res.makespan >= lb * (1 - 1e-12) - 1e-12, (res.makespan, lb)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 8), (6, 3)])
def test_bound_is_tight_for_balanced_gpipe_and_1f1b(p: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    for hint in ("strict-gpipe", "strict-1f1b"):
        spec, h, strict = resolve_hint(hint, Placement(p), m)
        res = simulate(spec, h, lambda s, r, t: tf if t.kind == "F" else tb, strict=strict)
        lb = lower_bound(spec, res.records)
        assert lb == pytest.approx((m + p - 1) * (tf + tb))
        assert res.makespan == pytest.approx(lb)


def test_bound_counts_message_time_on_the_fill_and_drain() -> None:
    p, m, tf, tb, lat = 4, 6, 1.0, 2.0, 0.25
    spec, h, strict = resolve_hint("strict-1f1b", Placement(p), m)
    delay = lambda k, s, d, t: lat  # noqa: E731
    res = simulate(spec, h, lambda s, r, t: tf if t.kind == "F" else tb, strict=strict, delay=delay)
    lb = lower_bound(spec, res.records, delay=delay)
    # The last rank: fill (p-1)(tf + lat), its work m(tf + tb), drain (p-1)(tb + lat).
    assert lb == pytest.approx((m + p - 1) * (tf + tb) + 2 * (p - 1) * lat)
    assert res.makespan >= lb


def test_bound_needs_every_record() -> None:
    spec, h, strict = resolve_hint("bf", Placement(2), 2)
    res = simulate(spec, h, lambda s, r, t: 1.0)
    with pytest.raises(ValueError, match="task records"):
        lower_bound(spec, res.records[:-1])


@st.composite
def budgeted(draw):
    """A one-step run under a random per-rank byte budget (1 to 4 microbatches' worth)."""
    p, v, spec, h, strict = _shape(draw, (2, 4), (2, 8),
                                   ["bf", "bfw", "bfw-mem", "bfw-alt-df", "fb", "strict-1f1b", "strict-gpipe", "zb-h1"])
    if spec is None:
        return None
    act = 1000
    stages = tuple(StageCost.from_mapping({"F": draw(cost), "B": draw(cost), "act_bytes": act}) for _ in range(p * v))
    costs = CostModel(stages)
    seed = draw(st.integers(0, 2**31))
    dur = DurationModel(costs, seed=seed, jitter=LEVELS[draw(st.sampled_from(list(LEVELS)))],
                        seqlen=draw(st.sampled_from([None, Dist.parse("uniform:0.5,1.5")])))
    comm = CommModel(costs, latency=draw(st.sampled_from([0.0, 0.002])), noise=draw(st.sampled_from([0.0, 0.5])),
                     seed=seed)
    budgets = [draw(st.integers(act * v, 4 * act * v)) for _ in range(p)]
    return spec, h, strict, dur, comm, budgets


@SETTINGS
@given(budgeted())
def test_no_schedule_within_its_budget_beats_the_memory_bound(sc) -> None:
    if sc is None:
        return  # hint does not fit this placement
    spec, h, strict, dur, comm, budgets = sc
    # A strict order ignores the budget; give it the bytes it holds instead.
    res = simulate(spec, h, dur, strict=strict, inflight_limit=spec.n_microbatches, delay=comm,
                   memory_budget=None if strict else budgets, act_bytes=dur.act_bytes)
    held = [max(b, 1) for b in res.peak_bytes] if strict else budgets
    mb = memory_bound(spec, res.records, held, dur.act_bytes, delay=comm)
    assert res.makespan >= mb * (1 - 1e-12) - 1e-12, (res.makespan, mb)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_bound_at_1f1b_memory_with_one_stage_per_rank(p: int) -> None:
    """Hand-computed: the last rank holds one microbatch, so its F, I, W (or F, B) run back to
    back: (p-1) F fill, (M-1)(F+I+W) + F + I on the last rank, (p-1) I down, W on stage 0."""
    m, tf, ti, tw = 4 * p, 1.0, 1.0, 1.5
    sizes = lambda k, s, mb: 10  # noqa: E731
    dur = lambda k, r, t: {"F": tf, "B": ti + tw, "I": ti, "W": tw}[t.kind]  # noqa: E731
    budgets = [10 * (p - r) for r in range(p)]  # what 1F1B holds: p - r microbatches on rank r
    for hint, want in (("strict-1f1b", (m + p - 1) * (tf + ti + tw)),
                       ("bfw-mem", (p - 1) * tf + (m - 1) * (tf + ti + tw) + tf + ti + (p - 1) * ti + tw)):
        spec, h, strict = resolve_hint(hint, Placement(p), m)
        res = simulate(spec, h, dur, strict=strict, inflight_limit=m, memory_budget=None if strict else budgets,
                       act_bytes=sizes)
        assert memory_bound(spec, res.records, budgets, sizes) == pytest.approx(want)
        assert res.makespan >= want - 1e-9
    # The memory-blind bound of the split run is lower by the last microbatch's drain.
    spec, h, _ = resolve_hint("bfw-mem", Placement(p), m)
    res = simulate(spec, h, dur, inflight_limit=m, memory_budget=budgets, act_bytes=sizes)
    assert lower_bound(spec, res.records) == pytest.approx((p - 1) * tf + m * (tf + ti + tw))
    # No budget, no memory bound.
    assert memory_bound(spec, res.records, [None] * p, sizes) == 0.0
