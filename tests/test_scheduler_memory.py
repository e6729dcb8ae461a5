"""The memory budget in bytes (rrfp.scheduler.memory): bound and deadlock freedom.

Property tests drive the real arbiter through the simulator with random activation sizes per
(stage, microbatch), random durations and random message delays, for 1 and 2 virtual stages
(loop and v placements), and check from the task records alone (an independent replay, not
the arbiter's own counters) that every step completes and that no rank ever holds more than
``max(budget, the largest single microbatch's bytes on the rank)``.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import Arbiter, Placement, PipelineSpec, resolve_hint
from rrfp.scheduler.memory import MemoryLedger, order_peak_bytes, parse_size
from rrfp.scheduler.tasks import B, F, I, Task, W
from rrfp.sim.engine import simulate

EXAMPLES = int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _keyed(seed: int, *key) -> random.Random:
    return random.Random(zlib.crc32(repr((seed,) + key).encode()))


def _peak(records, size, rank: int) -> int:
    """Bytes held on ``rank`` replayed from its records in dispatch order (a rank's memory
    depends only on its own order)."""
    cur = peak = 0
    for r in records:
        if r.rank != rank:
            continue
        s, k, m = r.task
        if k == F:
            cur += size(r.step, s, m)
            peak = max(peak, cur)
        elif k in (B, W):  # a split backward frees at W (W reads what F saved)
            cur -= size(r.step, s, m)
    return peak


def _budgets_and_timing(placement, size, m, steps, budget_frac, seed, delays):
    """Per-rank budgets (a fraction of what the rank would hold with every microbatch in
    flight), keyed random durations and message delays."""
    budgets = []
    for r in range(placement.n_ranks):
        total = max(sum(size(k, s, mb) for s in placement.stages_of(r) for mb in range(m)) for k in range(steps))
        budgets.append(max(1, int(total * budget_frac)))

    def dur(step, rank, t):
        return _keyed(seed, "dur", step, t).uniform(0.1, 3.0)

    def delay(step, src, dst, t):
        return _keyed(seed, "msg", step, t).choice([0.0, 0.0, 0.5, 2.0]) if delays else 0.0

    return budgets, dur, delay


@SETTINGS
@given(
    hint=st.sampled_from(["bf", "bfw", "fb", "b-priority", "f-priority", "bf-df", "bfw-df", "bfw-alt", "bfw-alt-df",
                          "bfw-mem",
                          "1f1b", "gpipe", "interleaved-1f1b"]),
    p=st.integers(1, 5),
    v=st.sampled_from([1, 2]),
    vplace=st.booleans(),
    m=st.integers(1, 12),
    limit=st.integers(1, 12),
    budget_frac=st.floats(0.0, 1.5),
    steps=st.integers(1, 2),
    seed=st.integers(0, 10_000),
    delays=st.booleans(),
)
def test_byte_budget_bound_and_completion(hint, p, v, vplace, m, limit, budget_frac, steps, seed, delays):
    if hint in ("1f1b",) and v > 1:
        hint = "interleaved-1f1b"
    if hint == "interleaved-1f1b" and (v == 1 or vplace):
        hint = "bf"
    placement = Placement(p, v, "v" if vplace and v == 2 else "loop")
    try:
        spec, h, strict = resolve_hint(hint, placement, m)
    except ValueError:  # a named schedule that does not fit this shape
        spec, h, strict = resolve_hint("bf", placement, m)

    def size(step, s, mb):
        return _keyed(seed, "size", step, s, mb).randint(0, 1000)

    budgets, dur, delay = _budgets_and_timing(placement, size, m, steps, budget_frac, seed, delays)
    res = simulate(spec, h, dur, strict=strict, inflight_limit=limit, delay=delay, steps=steps,
                   memory_budget=budgets, act_bytes=size)
    assert len(res.records) == steps * len(spec.all_tasks())  # every step completed
    for r in range(p):
        single = max(sum(size(k, s, mb) for s in placement.stages_of(r)) for k in range(steps) for mb in range(m))
        replayed = _peak(res.records, size, r)
        assert replayed == res.peak_bytes[r]
        if not strict:
            assert replayed <= max(budgets[r], single), (r, replayed, budgets[r], single)


@SETTINGS
@given(
    hint=st.sampled_from(["bf", "bfw-df", "bfw-alt-df", "bfw-mem", "interleaved-1f1b"]),
    p=st.integers(1, 4),
    v=st.sampled_from([1, 2]),
    m=st.integers(1, 10),
    budget=st.integers(1, 3000),
    seed=st.integers(0, 10_000),
)
def test_byte_budget_completes_with_unknown_sizes(hint, p, v, m, budget, seed):
    """The runtime knows no size before it measured a stage once (act_bytes returns None):
    such a microbatch is admitted, or moves on, only when the rule's exceptions allow it
    (nothing in flight; the oldest in flight), and every step still completes."""
    placement = Placement(p, v)
    if hint == "interleaved-1f1b" and (v == 1 or m % p):
        hint = "bf"
    spec, h, strict = resolve_hint(hint, placement, m)

    def size(step, s, mb):
        return None if (mb + s) % 3 == 1 else _keyed(seed, "size", step, s, mb).randint(0, 1000)

    def dur(step, rank, t):
        return _keyed(seed, "dur", step, t).uniform(0.1, 3.0)

    def delay(step, src, dst, t):
        return _keyed(seed, "msg", step, t).choice([0.0, 0.5, 2.0])

    res = simulate(spec, h, dur, strict=strict, delay=delay, memory_budget=budget, act_bytes=size)
    assert len(res.records) == len(spec.all_tasks())


def test_ledger_admits_alone_and_within_budget_only():
    sizes = {(0, 0): 60, (0, 1): 50, (0, 2): 30}
    led = MemoryLedger([0], lambda s, m: sizes[(s, m)], 100)
    assert led.admits(0)  # nothing reserved: always admitted, whatever its size
    led.forward_done(0, 0)
    assert not led.admits(1)  # 60 + 50 > 100
    assert led.admits(2)  # 60 + 30 <= 100
    led.forward_done(0, 2)
    assert (led.held, led.reserved, led.peak_held) == (90, 90, 90)
    led.backward_done(0, 0)
    assert led.admits(1) and led.held == 30
    # A measured size replaces its estimate in the reservation.
    led.forward_done(0, 1, nbytes=70)
    assert (led.held, led.reserved) == (100, 100)


def test_ledger_banker_check_hand_computed():
    # Stages 0 and 4 on the rank, 10 and 25 bytes, budget 70 (overcommit bound 105).
    led = MemoryLedger([0, 4], lambda s, m: 10 if s == 0 else 25, 70)
    assert led.admits(0)  # nothing in flight
    led.forward_done(0, 0)
    assert (led.held, led.reserved) == (10, 35)
    assert not led.admits(2)  # with virtual stages, admissions go in microbatch order
    assert led.admits(1)  # held 20, free 50: mb 0 takes 25 of 50, then mb 1 25 of 60
    led.forward_done(0, 1)
    # Reserving both stages at admission would refuse mb 2 (70 + 35 > 70); the banker's
    # check finds an order (0, 1, 2 each take 25 of 40, 50, 60) and 20 + 50 + 35 <= 105.
    assert led.admits(2)
    led.forward_done(0, 2)
    assert not led.admits(3)  # 30 + 75 + 35 = 140 > 105
    # A younger microbatch's later stage waits while the oldest could not finish after it
    # (free 15 < 25); the oldest's own is always granted.
    assert not led.grants(4, 1)
    assert led.grants(4, 0)
    led.forward_done(4, 0)
    assert led.held == 55 and not led.grants(4, 1)  # 80 > 70
    led.backward_done(4, 0)
    assert led.grants(4, 1)  # held 55: mb 0 needs nothing, then mb 1 nothing, mb 2 25 of 60
    assert led.held <= 70 and led.peak_held == 55
    assert list(led.in_flight()) == [0, 1, 2]
    led.backward_done(0, 0)
    assert list(led.in_flight()) == [1, 2]


def test_budget_orders_forwards_by_bytes_hand_computed():
    # One rank, sizes 6, 6, 1, 1, budget 7, forwards first: F0 (6); not F1 (12 > 7), so B0;
    # F1 alone (6); F2 fits (7); F3 does not (8), so B1; F3 (2); B2, B3.
    spec, h, _ = resolve_hint("f-priority", Placement(1, 1), 4)
    sizes = [6, 6, 1, 1]
    a = Arbiter(spec, 0, h, memory_budget=7, act_bytes=lambda s, m: sizes[m])
    order = []
    while not a.finished:
        t = a.next()
        order.append(str(t))
        a.complete(t)
    assert order == ["0F0", "0B0", "0F1", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert a.peak_bytes == 7


@pytest.mark.parametrize("text,expected", [("64MiB", 64 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
                                           ("2kib", 2048), (4096, 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-3MiB", "0", "5 parsecs", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_order_peak_bytes_of_1f1b_hand_computed():
    spec, h, _ = resolve_hint("1f1b", Placement(2, 1), 4)
    sizes = [5, 1, 1, 7]
    # rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3: holds 5+1, then 1+1, then 1+7 = 8 at most.
    assert order_peak_bytes(h.order[0], lambda s, m: sizes[m]) == 8
    assert order_peak_bytes([Task(0, F, 0), Task(0, B, 0)], lambda s, m: 3) == 3


def test_budget_without_sizes_is_refused():
    spec, h, _ = resolve_hint("bf", Placement(2, 1), 4)
    with pytest.raises(ValueError, match="act_bytes"):
        Arbiter(spec, 0, h, memory_budget=100)


# ------------------------------------------------------- split-backward ledger (W's bytes)
def _peak_split(records, size, wsize, rank: int) -> int:
    """Bytes held on ``rank`` replayed from its records: F adds its size, B frees it, I frees
    all but what W reads (``wsize``; None: all kept), W frees the rest."""
    cur = peak = 0
    kept = {}
    for r in records:
        if r.rank != rank:
            continue
        s, k, m = r.task
        n = size(r.step, s, m)
        if k == F:
            cur += n
            peak = max(peak, cur)
        elif k == B:
            cur -= n
        elif k == I:
            w = wsize(r.step, s, m)
            keep = n if w is None else min(w, n)
            kept[(r.step, s, m)] = keep
            cur -= n - keep
        else:
            cur -= kept.pop((r.step, s, m))
    assert not kept
    return peak


@SETTINGS
@given(
    hint=st.sampled_from(["bfw", "bfw-alt", "bfw-alt-df", "bfw-mem", "bfw-df", "zb-h1", "zb-v", "bf", "split"]),
    p=st.integers(1, 5),
    v=st.sampled_from([1, 2]),
    vplace=st.booleans(),
    m=st.integers(1, 12),
    limit=st.integers(1, 12),
    budget_frac=st.floats(0.0, 1.5),
    steps=st.integers(1, 2),
    seed=st.integers(0, 10_000),
    delays=st.booleans(),
    w_known=st.sampled_from(["all", "some", "none"]),
)
def test_split_ledger_bound_and_completion(hint, p, v, vplace, m, limit, budget_frac, steps, seed, delays, w_known):
    """With W's bytes known (all, some or no stages), I frees the rest: every step completes
    (deadlock freedom) and readiness mode never holds more than max(budget, one microbatch's
    bytes on the rank), replayed from the records with the same rule."""
    placement = Placement(p, v, "v" if vplace and v == 2 else "loop")
    try:
        spec, h, strict = resolve_hint(hint, placement, m, True)
    except ValueError:
        spec, h, strict = resolve_hint("bfw", placement, m)

    def size(step, s, mb):
        return _keyed(seed, "size", step, s, mb).randint(0, 1000)

    def wsize(step, s, mb):
        if w_known == "none" or (w_known == "some" and (s + mb) % 2):
            return None
        return int(size(step, s, mb) * _keyed(seed, "w", s).uniform(0.0, 1.0))

    budgets, dur, delay = _budgets_and_timing(placement, size, m, steps, budget_frac, seed, delays)
    res = simulate(spec, h, dur, strict=strict, inflight_limit=limit, delay=delay, steps=steps,
                   memory_budget=budgets, act_bytes=size, w_bytes=wsize)
    assert len(res.records) == steps * len(spec.all_tasks())
    for r in range(p):
        single = max(sum(size(k, s, mb) for s in placement.stages_of(r)) for k in range(steps) for mb in range(m))
        replayed = _peak_split(res.records, size, wsize, r)
        assert replayed == res.peak_bytes[r]
        if not strict:
            assert replayed <= max(budgets[r], single), (r, replayed, budgets[r], single)


def test_split_ledger_hand_computed():
    """F holds 100 bytes; I leaves the 30 W reads; W frees them. Unknown W bytes: all 100 stay
    until W; a figure above what F holds is capped (I never raises the bytes held)."""
    led = MemoryLedger([0], lambda s, m: 100, 1000)
    led.forward_done(0, 0)
    led.forward_done(0, 1)
    assert led.held == 200
    led.input_backward_done(0, 0, 30)
    assert (led.held, led.reserved) == (130, 130)
    led.input_backward_done(0, 1, None)
    assert led.held == 130
    led.backward_done(0, 0)
    assert led.held == 100
    led.input_backward_done(0, 1, 10**6)
    assert led.held == 100
    led.backward_done(0, 1)
    assert (led.held, led.reserved, led.peak_held) == (0, 0, 200)


def test_split_ledger_lets_a_forward_in_after_i():
    """Budget 150, F holds 100 and W reads 40: after I the next forward fits (40 + 100), with
    the conservative rule (W bytes unknown) it waits for W."""
    spec = PipelineSpec(Placement(1), 2, split_backward=True)
    hint = resolve_hint("bfw", Placement(1), 2)[1]
    for w, want in ((lambda s, m: 40, "0F0 0I0 0F1 0I1 0W0 0W1"), (None, "0F0 0I0 0W0 0F1 0I1 0W1")):
        arb = Arbiter(spec, 0, hint, memory_budget=150, act_bytes=lambda s, m: 100, w_bytes=w, inflight_limit=2)
        seen = []
        while not arb.finished:
            t = arb.next()
            seen.append(str(t))
            arb.complete(t)
        assert " ".join(seen) == want


def test_order_peak_bytes_with_w_bytes_hand_computed():
    order = [Task(0, F, 0), Task(0, F, 1), Task(0, I, 0), Task(0, F, 2), Task(0, W, 0), Task(0, I, 1),
             Task(0, W, 1), Task(0, I, 2), Task(0, W, 2)]
    # Without w_size I frees everything: 100, 200, 100, 200 -> peak 200. With W reading 30:
    # 100, 200, 130, 230, 200, 130, 100, 30, 0 -> peak 230. Unknown: kept until W: 300.
    assert order_peak_bytes(order, lambda s, m: 100) == 200
    assert order_peak_bytes(order, lambda s, m: 100, lambda s, m: 30) == 230
    assert order_peak_bytes(order, lambda s, m: 100, lambda s, m: None) == 300


TORCH_SCHEDULES = {  # PyTorch's schedules as rrfp plans them: (virtual stages per rank, placement)
    "GPipe": (1, "loop"), "1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"), "LoopedBFS": (2, "loop"),
    "InterleavedZeroBubble": (1, "loop"), "ZBVZeroBubble": (2, "v"), "DualPipeV": (2, "v"),
}


@SETTINGS
@given(
    name=st.sampled_from(sorted(TORCH_SCHEDULES)),
    p=st.integers(2, 5),
    m_per_rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    delays=st.booleans(),
)
def test_a_torch_schedule_as_hint_holds_at_most_its_orders_bytes_whatever_each_stage_holds(name, p, m_per_rank, seed,
                                                                                            delays):
    """The front doors' plan for a schedule used as a hint (no limit, no budget) against the
    same order run strictly, which is PyTorch's run of it (tests/test_scheduler_schedules.py
    compares the orders): every step completes and no rank holds more bytes, with each virtual
    stage its own size (the count limits alone held up to 1.7x the order's bytes here), a
    split backward's bytes held until W as PyTorch does. The same against torch's processes:
    tests/test_hint_memory.py."""
    from rrfp.runtime.doors.config import RuntimeConfig, plan

    v, kind = TORCH_SCHEDULES[name]
    m = p * m_per_rank
    try:
        pl = plan(RuntimeConfig(hint=name, placement=kind), p, v, m)
    except ValueError:  # a shape the schedule does not take
        return
    sizes = [_keyed(seed, "size", s).randint(1, 1000) for s in range(p * v)]

    def size(step, s, mb):
        return sizes[s]

    _, dur, delay = _budgets_and_timing(pl.placement, size, m, 1, 1.0, seed, delays)
    res = simulate(pl.spec, pl.hint, dur, inflight_limit=pl.limits, delay=delay, act_bytes=size)
    assert len(res.records) == len(pl.spec.all_tasks())
    for r in range(p):
        own = order_peak_bytes(pl.hint.order[r], lambda s, mb: sizes[s], lambda s, mb: sizes[s])
        assert _peak(res.records, size, r) <= own, (r, sizes)
