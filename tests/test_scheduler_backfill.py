"""Strict orders with split backward (``strict-split``) and conservative backfilling
(``backfill``, ``backfill:<order>``; rrfp.scheduler.backfill).

The property test is the module docstring's claim: with exact costs backfilling never ends a
step later than its own strict order, over random placements, microbatch counts, durations and
message delays, and never holds more bytes than it. The reference is the strict run itself
(the same simulator without backfilling), and the bytes are replayed from the records.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.backfill import Backfill, CostAverages, producer
from rrfp.scheduler.schedules import SCHEDULES
from rrfp.scheduler.tasks import B, F, I, PipelineSpec, Task, W, format_order
from rrfp.sim.engine import simulate

EXAMPLES = int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NOMINAL = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


def _keyed(seed: int, *key) -> random.Random:
    return random.Random(zlib.crc32(repr((seed,) + key).encode()))


def _peak(records, size, rank: int) -> int:
    cur = peak = 0
    for r in records:
        if r.rank == rank:
            s, k, m = r.task
            if k == F:
                cur += size(r.step, s, m)
                peak = max(peak, cur)
            elif k in (B, W):
                cur -= size(r.step, s, m)
    return peak


@st.composite
def workloads(draw):
    base = draw(st.sampled_from(["split", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "gpipe"]))
    p = draw(st.integers(1, 5))
    if base in ("1f1b", "zb-h1"):
        place = Placement(p)
    elif base == "zb-v":
        place = Placement(p, 2, "v")
    else:
        v = draw(st.integers(1, 3))
        place = Placement(p, v, draw(st.sampled_from(["loop", "v"])) if v == 2 and base == "split" else "loop")
    m = draw(st.integers(1, 10))
    split = None if base in ("split", "zb-h1", "zb-v") else draw(st.sampled_from([None, True]))
    return dict(base=base, place=place, m=m, split=split, seed=draw(st.integers(0, 10**6)),
                spread=draw(st.sampled_from([0.0, 0.5, 2.0])), delays=draw(st.sampled_from([0.0, 0.2, 1.5])),
                steps=draw(st.integers(1, 2)), sizes=draw(st.booleans()))


@SETTINGS
@given(workloads())
def test_backfill_with_exact_costs_is_never_slower_than_its_strict_order(w):
    try:
        spec, strict_hint, _ = resolve_hint("strict-" + w["base"], w["place"], w["m"], w["split"])
    except ValueError:  # the order does not fit this shape (e.g. interleaved 1F1B's rounds)
        return
    spec2, bf_hint, bf_strict = resolve_hint("backfill:" + w["base"], w["place"], w["m"], w["split"])
    assert bf_strict and bf_hint.backfill and spec2 == spec and bf_hint.order == strict_hint.order
    seed, spread, dmax = w["seed"], w["spread"], w["delays"]

    def dur(step, rank, t):  # stateless: the exact cost the backfilling rank is given
        return NOMINAL[t.kind] * (1.0 + spread * _keyed(seed, "d", step, t).random())

    def delay(step, src, dst, t):
        return dmax * _keyed(seed, "m", step, t).random()

    kw = {}
    if w["sizes"]:
        kw["act_bytes"] = lambda step, s, m: _keyed(seed, "b", step, s, m).randint(1, 1000)
    ref = simulate(spec, strict_hint, dur, strict=True, delay=delay, steps=w["steps"], **kw)
    got = simulate(spec, bf_hint, dur, strict=True, delay=delay, steps=w["steps"], cost_estimate=dur, **kw)
    assert len(got.records) == len(ref.records)
    assert got.makespan <= ref.makespan * (1 + 1e-12) + 1e-12, (got.makespan, ref.makespan)
    if w["sizes"]:
        size = kw["act_bytes"]
        for r in range(spec.placement.n_ranks):
            assert _peak(got.records, size, r) <= _peak(ref.records, size, r)


def test_backfill_runs_a_later_task_in_a_wait_hand_computed():
    """ZB-H1, 2 ranks, 3 microbatches; rank 0's forwards take 3 s, every other task 1 s.
    Rank 1's order is F0 I0 F1 I1 W0 F2 I2 W1 W2. Strict, it waits for F1's activation from 5
    to 6 and for F2's from 9 to 11. Backfilled: at 5 the planned F1's producer 0F1 started at
    3 with estimated end 6, so W0 (1 s) fits and runs 5..6; at 8 the planned F2's producer 0F2
    has just started (rank 0 decides first at an instant) and ends at 11, so W1 runs 8..9.
    Rank 1 finishes at 14 instead of 15; rank 0, the critical rank, is unchanged."""
    place = Placement(2)
    spec, h, _ = resolve_hint("backfill:zb-h1", place, 3)
    assert format_order(h.order[1]) == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"

    def dur(step, rank, t):
        return 3.0 if rank == 0 and t.kind == F else 1.0

    ref = simulate(spec, resolve_hint("strict-zb-h1", place, 3)[1], dur, strict=True)
    got = simulate(spec, h, dur, strict=True, cost_estimate=dur)

    def timeline(res, rank):
        return " ".join(f"{r.task}@{r.start:g}" for r in res.records if r.rank == rank)

    assert timeline(ref, 1) == "1F0@3 1I0@4 1F1@6 1I1@7 1W0@8 1F2@11 1I2@12 1W1@13 1W2@14"
    assert timeline(got, 1) == "1F0@3 1I0@4 1W0@5 1F1@6 1I1@7 1W1@8 1F2@11 1I2@12 1W2@13"
    assert timeline(got, 0) == timeline(ref, 0)
    assert got.makespan == ref.makespan == 15.0


def test_strict_split_is_the_placement_order_with_i_then_w():
    for place, name in ((Placement(3), "1f1b"), (Placement(2, 2), "interleaved-1f1b"), (Placement(2, 2, "v"), "zb-v")):
        spec, h, strict = resolve_hint("strict-split", place, 4)
        assert strict and spec.split_backward and h.name == "split"
        want = SCHEDULES[name](PipelineSpec(place, 4, True))
        assert h.order == want
    spec, h, _ = resolve_hint("strict-split", Placement(2), 2)
    assert format_order(h.order[0]) == "0F0 0F1 0I0 0W0 0I1 0W1"
    assert format_order(h.order[1]) == "1F0 1I0 1W0 1F1 1I1 1W1"


@pytest.mark.parametrize("text", ["backfill:", "backfill:backfill", "backfill:nope", "backfill:strict-"])
def test_bad_backfill_hints_are_refused(text):
    with pytest.raises(ValueError, match="hint|expected"):
        resolve_hint(text, Placement(2), 4)


def test_split_needs_a_placement_with_a_fixed_order():
    with pytest.raises(ValueError, match="no fixed order"):
        resolve_hint("strict-split", Placement(2, 3, "v"), 4)


def test_arrival_bound_from_notices_and_estimates():
    spec = PipelineSpec(Placement(2), 2, split_backward=True)
    notices = {}
    est = {Task(1, I, 0): 3.0, Task(0, F, 1): 1.0}
    bf = Backfill(spec, 0, est.get, notices, complete_notices=True, min_delay=0.5)
    bf.now = 10.0
    assert producer(spec, Task(0, I, 0)) == Task(1, I, 0)
    assert bf.arrival_bound(Task(0, I, 0)) == 13.5  # not started: now + its cost + delay
    notices[Task(1, I, 0)] = 11.0
    assert bf.arrival_bound(Task(0, I, 0)) == 11.5  # started: its estimated end + delay
    notices[Task(1, I, 0)] = 9.0
    assert bf.arrival_bound(Task(0, I, 0)) == 10.0  # ended: in transit, no later bound known
    assert bf.arrival_bound(Task(0, F, 1)) == 10.0  # stage 0's input is local
    silent = Backfill(spec, 0, est.get, {}, complete_notices=False)
    silent.now = 10.0
    assert silent.arrival_bound(Task(0, I, 0)) == 10.0  # a notice may be in transit: nothing known
    avg = CostAverages()
    assert avg(Task(0, F, 0)) is None
    avg.observe(Task(0, F, 0), 1.0)
    avg.observe(Task(0, F, 3), 2.0)
    assert avg(Task(0, F, 7)) == 1.5
