"""validate_schedule: each failure class is reported with its first offending action, and the
verdict agrees with running the orders strictly in the simulator."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.scheduler import (
    Hint,
    Placement,
    PipelineSpec,
    ScheduleError,
    Task,
    one_f_one_b,
    parse_orders,
    validate_schedule,
)
from rrfp.sim.engine import DeadlockError, simulate


def check(spec: PipelineSpec, text: str, strict: bool = True) -> ScheduleError:
    with pytest.raises(ScheduleError) as e:
        validate_schedule(spec, parse_orders(text), strict=strict)
    assert "\n" not in str(e.value)
    return e.value


SPEC2 = PipelineSpec(Placement(2), 2)


def test_valid_schedules_pass():
    validate_schedule(SPEC2, one_f_one_b(SPEC2))
    validate_schedule(SPEC2, parse_orders("0F0 0F1 0B0 0B1 | 1F0 1F1 1B1 1B0"))


def test_rank_count():
    e = check(SPEC2, "0F0 0F1 0B0 0B1")
    assert str(e) == "schedule has 1 rank orders, the placement has 2 ranks"


@pytest.mark.parametrize(
    "spec,text,message",
    [
        (SPEC2, "0F0 0F1 0B0 0B1 | 1F0 0F1 1B0 1F1 1B1",
         "rank 1, position 1: action 0F1 is not a task of rank 1: stage 0 is on rank 0"),
        (SPEC2, "0F0 0F1 0B0 0B1 0F2 | 1F0 1B0 1F1 1B1",
         "rank 0, position 4: action 0F2 is not a task of rank 0: microbatch 2 does not exist"),
        (SPEC2, "0F0 0F1 0B0 0B1 | 1F0 1B0 1F1 1B1 2F0",
         "rank 1, position 4: action 2F0 is not a task of rank 1: stage 2 does not exist"),
        (SPEC2, "0F0 0F1 0I0 0W0 0B1 | 1F0 1B0 1F1 1B1",
         "rank 0, position 2: action 0I0 is not a task of rank 0: the backward is not split"),
        (PipelineSpec(Placement(1), 1, True), "0F0 0B0",
         "rank 0, position 1: action 0B0 is not a task of rank 0: the backward is split"),
    ],
)
def test_foreign_action(spec, text, message):
    e = check(spec, text)
    assert str(e).startswith(message)
    assert e.action is not None and str(e.action) in message


def test_repeated_action():
    e = check(SPEC2, "0F0 0F1 0B0 0F1 0B1 | 1F0 1B0 1F1 1B1")
    assert str(e) == "rank 0, position 3: action 0F1 repeats position 1"
    assert (e.rank, e.position, e.action) == (0, 3, Task(0, "F", 1))


def test_missing_action():
    e = check(SPEC2, "0F0 0F1 0B0 0B1 | 1F0 1F1 1B1")
    assert str(e) == "rank 1: action 1B0 is missing (1 of the rank's 4 tasks are absent)"
    assert (e.rank, e.position, e.action) == (1, None, Task(1, "B", 0))


@pytest.mark.parametrize(
    "spec,text,message",
    [
        (SPEC2, "0F0 0B0 0F1 0B1 | 1F0 1B1 1B0 1F1",
         "rank 1, position 1: action 1B1 comes before its dependency 1F1 (position 3) on the same rank"),
        (PipelineSpec(Placement(1), 1, True), "0F0 0W0 0I0",
         "rank 0, position 1: action 0W0 comes before its dependency 0I0 (position 2) on the same rank"),
        # one rank holding two virtual stages: stage 1's forward needs stage 0's, and stage 0's
        # backward needs stage 1's
        (PipelineSpec(Placement(1, 2), 1), "1F0 0F0 1B0 0B0",
         "rank 0, position 0: action 1F0 comes before its dependency 0F0 (position 1) on the same rank"),
        (PipelineSpec(Placement(1, 2), 1), "0F0 1F0 0B0 1B0",
         "rank 0, position 2: action 0B0 comes before its dependency 1B0 (position 3) on the same rank"),
    ],
)
def test_same_rank_dependency(spec, text, message):
    assert str(check(spec, text)) == message


def test_same_rank_order_is_fine_for_a_readiness_hint():
    validate_schedule(SPEC2, parse_orders("0B0 0F0 0B1 0F1 | 1B1 1B0 1F1 1F0"), strict=False)


def test_two_rank_cycle():
    e = check(SPEC2, "0F0 0B0 0F1 0B1 | 1F1 1B1 1F0 1B0")
    assert str(e) == (
        "rank 0, position 1: action 0B0 is in a cross-rank wait cycle (rank 0 -> rank 1 -> rank 0): "
        "rank 0 blocks at position 1 on 0B0, which needs 1B0 (rank 1, position 3); "
        "rank 1 blocks at position 0 on 1F1, which needs 0F1 (rank 0, position 2)"
    )
    assert (e.rank, e.position, e.action) == (0, 1, Task(0, "B", 0))


def test_three_rank_cycle_through_virtual_stages():
    # Loop placement, 3 ranks x 2 virtual stages: rank 0 wants 3F0 (needs 2F0 from rank 2)
    # before 0F1; rank 2 wants 2F0 (needs 1F0 from rank 1) first; rank 1 wants 1F1 (needs 0F1
    # from rank 0) before 1F0.
    spec = PipelineSpec(Placement(3, 2), 2)
    text = (
        "0F0 3F0 0F1 3F1 3B0 0B0 3B1 0B1 | "
        "1F1 1F0 4F0 4F1 4B0 1B0 4B1 1B1 | "
        "2F0 2F1 5F0 5B0 5F1 5B1 2B0 2B1"
    )
    assert str(check(spec, text)) == (
        "rank 0, position 1: action 3F0 is in a cross-rank wait cycle "
        "(rank 0 -> rank 2 -> rank 1 -> rank 0): "
        "rank 0 blocks at position 1 on 3F0, which needs 2F0 (rank 2, position 0); "
        "rank 2 blocks at position 0 on 2F0, which needs 1F0 (rank 1, position 1); "
        "rank 1 blocks at position 0 on 1F1, which needs 0F1 (rank 0, position 2)"
    )


def test_cycle_found_after_progress():
    # the ranks run a few tasks before jamming; the positions are where they stop
    spec = PipelineSpec(Placement(2), 3)
    e = check(spec, "0F0 0F1 0B0 0B1 0F2 0B2 | 1F0 1B0 1F2 1B2 1F1 1B1")
    assert str(e) == (
        "rank 0, position 3: action 0B1 is in a cross-rank wait cycle (rank 0 -> rank 1 -> rank 0): "
        "rank 0 blocks at position 3 on 0B1, which needs 1B1 (rank 1, position 5); "
        "rank 1 blocks at position 2 on 1F2, which needs 0F2 (rank 0, position 4)"
    )


# --------------------------------------------------------------- agreement with the simulator
@st.composite
def local_orders(draw):
    """Per-rank orders that respect same-rank dependencies but interleave each rank's work at
    random: some run, some jam across ranks."""
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["loop", "v"]))
    m = draw(st.integers(1, 4))
    split = draw(st.booleans())
    spec = PipelineSpec(Placement(p, v, kind), m, split)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    orders = []
    for r in range(p):
        todo = spec.tasks_of(r)
        mine = set(todo)
        placed: set[Task] = set()
        order = []
        while todo:
            ok = [t for t in todo if all(d in placed or d not in mine for d in spec.dependencies(t))]
            t = rng.choice(ok)
            todo.remove(t)
            placed.add(t)
            order.append(t)
        orders.append(order)
    return spec, orders


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(local_orders())
def test_validator_agrees_with_a_strict_simulation(case):
    spec, orders = case
    try:
        validate_schedule(spec, orders)
        verdict = None
    except ScheduleError as e:
        verdict = e
    try:
        simulate(spec, Hint("user", order=orders), lambda s, r, t: 1.0, strict=True)
        ran = True
    except DeadlockError:
        ran = False
    assert ran == (verdict is None), verdict
    if verdict is not None:
        assert "cross-rank wait cycle" in str(verdict)
