"""Policies and guards (rrfp.scheduler.policy, rrfp.scheduler.guards): the hint table, a policy
added from outside, choose() without side effects, the policy told of every task taken, and the
guards' verdicts, each against a hand-computed order."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import Arbiter, Placement, PipelineSpec, Task, resolve_hint
from rrfp.scheduler.guards import LATER, REFUSED, Admission, ByteBudget, RankState
from rrfp.scheduler.memory import MemoryLedger
from rrfp.scheduler.policy import Hint, KindPolicy, Policy
from rrfp.scheduler.readyset import KINDS, ReadySet, finalising_kind
from rrfp.scheduler.registry import HINTS, HintEntry, names, register
from rrfp.scheduler.tasks import B, F, W
from rrfp.sim.engine import DeadlockError, simulate

POLICIES = names(order=False)


def drain(arb: Arbiter, inputs=()) -> list[str]:
    """Dispatch and complete until nothing is ready, delivering ``inputs`` first."""
    for s, m, g in inputs:
        arb.mark_input(s, m, g)
    seen = []
    while (t := arb.next()) is not None:
        seen.append(str(t))
        arb.complete(t)
    return seen


def test_every_hint_policy_is_registered_with_its_backward_form():
    assert set(POLICIES) == {"bf", "fb", "bfw", "b-priority", "f-priority", "bfw-alt", "bf-df", "bfw-df", "bfw-alt-df",
                             "bfw-mem"}
    for name in POLICIES:
        spec, hint, strict = resolve_hint(name, Placement(2), 4)
        assert hint.policy == name and not strict
        assert spec.split_backward == ("bfw" in name)  # the name says it
        arb = Arbiter(spec, 0, hint)
        assert isinstance(arb.policy, KindPolicy) and arb.policy.name == name
        assert arb.ready.queues and (arb.ready.fsign < 0) == name.endswith(("-df", "-mem"))
    with pytest.raises(ValueError, match="already registered"):
        register("bf", lambda **_: None)


def test_choose_has_no_side_effects():
    # Rank 0 of 2, two virtual stages: propose any number of times, the ready set and the
    # counters are unchanged, and next() takes exactly the proposal.
    cases = [(n, "admission") for n in list(POLICIES) + ["interleaved-1f1b", "split", "strict-interleaved-1f1b"]]
    cases += [("bf", "completion-order"), ("interleaved-1f1b", "completion-order")]
    for name, bp in cases:
        spec, hint, strict = resolve_hint(name, Placement(2, 2), 4, inflight_limit=2, backpressure=bp)
        arb = Arbiter(spec, 0, hint, strict=strict, inflight_limit=1)
        for _ in range(3):
            before = ([bytes(x) for x in arb.ready.ready], list(arb.ready.f), getattr(arb.policy, "phase", None),
                      arb.inflight)
            t = arb.propose()
            if t is None:
                break
            assert arb.propose() == t
            assert ([bytes(x) for x in arb.ready.ready], list(arb.ready.f), getattr(arb.policy, "phase", None),
                    arb.inflight) == before
            assert arb.next() == t
            arb.complete(t)


class LatestMicrobatchFirst(Policy):
    """A policy from outside: a ready forward before a backward, each the highest microbatch
    (the guard filters the forwards); no W (the spec has none). It counts what it was told."""

    name = "latest-mb"

    def __init__(self):
        self.told = []

    def taken(self, task, state):
        self.told.append(str(task))

    def choose(self, ready, state):
        best = None
        M = state.n_mb
        for c, kind in ((0, F), (1, state.backward_kind)):
            for i, r in enumerate(ready.ready[c]):
                if r and (c != 0 or state.guard.permits(ready, state, i)):
                    key = (-c, i % M)
                    if best is None or key > best[0]:
                        best = (key, Task(ready.stages[i // M], kind, i % M))
        return None if best is None else best[1]


@pytest.fixture
def table():
    """The hint table as it was, restored after the test (its registrations are its own)."""
    saved = dict(HINTS)
    yield
    HINTS.clear()
    HINTS.update(saved)


def test_a_registered_policy_runs_through_the_arbiter_and_its_guard(table):
    register("latest-mb", HintEntry(factory=lambda **_: LatestMicrobatchFirst()))
    spec, hint, strict = resolve_hint("latest-mb", Placement(1), 4, inflight_limit=2)
    assert hint == Hint("latest-mb", "latest-mb") and not strict and not spec.split_backward
    # One stage per rank, limit 2: F3 F2 (limit), B3 frees one, F1 (limit), B2, F0, B1, B0.
    arb = Arbiter(spec, 0, hint, inflight_limit=2)
    order = "0F3 0F2 0B3 0F1 0B2 0F0 0B1 0B0"
    assert " ".join(drain(arb)) == order and " ".join(arb.policy.told) == order
    # The arbiter tells it a committed task too (a TP group's agreed one), chosen or not.
    arb = Arbiter(spec, 0, hint, inflight_limit=2)
    arb.commit(Task(0, F, 0))
    assert arb.policy.told == ["0F0"]


def test_a_factory_that_builds_no_policy_is_refused(table):
    register("not-a-policy", lambda **_: object())
    spec, hint, _ = resolve_hint("not-a-policy", Placement(1), 2)
    with pytest.raises(TypeError, match="its factory built object, expected a rrfp.scheduler.policy.Policy"):
        Arbiter(spec, 0, hint)


def test_bf_keeps_its_round_and_the_completion_order_holds_it():
    # Rank 1 of 2 (the last stage, its own loss), bf: F0, then its B0 (round flips to B after
    # an F, to F after a B), with forwards always ready: F B F B...
    spec, hint, _ = resolve_hint("bf", Placement(2), 3)
    arb = Arbiter(spec, 1, hint, inflight_limit=8)
    assert drain(arb, [(1, m, False) for m in range(3)]) == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]
    # fb starts with the forwards' round: F0 then, with F1 ready too, B0 (rounds alternate).
    spec, hint, _ = resolve_hint("fb", Placement(2), 3)
    arb = Arbiter(spec, 1, hint, inflight_limit=8)
    assert drain(arb, [(1, m, False) for m in range(3)]) == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]
    assert arb.policy.phase == F  # after a B, the next round is a forward's
    # Completion order binding (2 virtual stages, limit 1): the round does not move while the
    # guard decides, so bf's phase after 0F0 (taken below the limit) is B and stays B.
    spec, hint, _ = resolve_hint("bf", Placement(1, 2), 2, backpressure="completion-order")
    arb = Arbiter(spec, 0, hint, inflight_limit=1)
    t = arb.next()
    assert str(t) == "0F0" and arb.policy.phase == B
    arb.complete(t)  # D = 1: the limit binds, the completion order dictates 1F0
    arb.mark_input(1, 0, False)
    t = arb.next()
    assert str(t) == "1F0" and arb.policy.phase == B


def test_admission_guard_admits_nothing_new_at_the_limit():
    # Rank 0 of 2 with 2 virtual stages (stages 0, 2), limit 1: after 0F0, only later-stage
    # forwards (none ready yet) and backwards may run; 2F0, once its input arrives, runs.
    spec, hint, _ = resolve_hint("bf", Placement(2, 2), 3)
    arb = Arbiter(spec, 0, hint, inflight_limit=1)
    assert drain(arb) == ["0F0"]
    assert isinstance(arb.state.guard, Admission) and arb.state.guard.forward(arb.ready, arb.state) is LATER
    assert drain(arb, [(2, 0, False)]) == ["2F0"]


def test_byte_budget_refusal_lets_bfw_mem_free_bytes_first():
    # One stage per rank, 2 bytes per forward, budget 3: after 0F0 the next admission
    # (2 + 2 > 3) is refused; once 0I0 ran (its W still holds the bytes: w_bytes unknown),
    # bfw-mem runs 0W0, which frees them, and then admits microbatch 1.
    spec, hint, _ = resolve_hint("bfw-mem", Placement(2), 3)
    arb = Arbiter(spec, 0, hint, memory_budget=3, act_bytes=lambda s, m: 2)
    assert drain(arb) == ["0F0"]  # 0F1 refused: 4 bytes > 3
    assert arb.state.guard.forward(arb.ready, arb.state) is REFUSED
    assert drain(arb, [(0, 0, True)]) == ["0I0", "0W0", "0F1"]


def test_guard_verdicts_from_a_hand_built_ready_set():
    ready = ReadySet([0], 2, queues=True)
    ready.add(Task(0, F, 0))
    ready.add(Task(0, F, 1))
    st = RankState([0], 2, 5, B)
    ledger = MemoryLedger([0], lambda s, m: 4, 6)
    budget = ByteBudget(ledger)
    assert budget.forward(ready, st) == (0, 0, 0)  # nothing in flight: the first admission
    ledger.forward_done(0, 0)
    st.mb_inflight = st.inflight = 1
    ready.take(Task(0, F, 0))
    assert budget.forward(ready, st) is REFUSED  # 4 + 4 > 6


def test_kind_table():
    assert finalising_kind(False) == B and finalising_kind(True) == W
    assert [k.name for k in KINDS.values() if k.needs_agreement] == ["F", "B", "I"]
    assert [k.name for k in KINDS.values() if k.frees_input] == ["B", "W"]


def test_backfill_over_an_unknown_order_names_what_was_typed():
    with pytest.raises(ValueError) as e:
        resolve_hint("backfill:nosuch", Placement(2), 4)
    assert str(e.value).startswith("hint 'backfill:nosuch': its strict order 'nosuch' does not resolve: ")


@settings(max_examples=int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "150")), deadline=None, derandomize=True,
          database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(2, 4),
    v=st.integers(1, 3),
    m=st.integers(3, 10),
    name=st.sampled_from(sorted(POLICIES)),
    limit=st.integers(1, 5),
    backpressure=st.sampled_from(["admission", "completion-order"]),
    budget=st.sampled_from([None, 2, 3, 5]),
    seed=st.integers(0, 2**32 - 1),
)
def test_kind_policies_fused_next_dispatches_what_choose_take_and_taken_do(p, v, m, name, limit, backpressure,
                                                                          budget, seed):
    """KindPolicy.next_taken (choose, ready.take and taken fused for speed) against the plain
    Policy.next_taken: whole simulated runs under random task times and message delays, with the
    in-flight limit and byte budgets binding, dispatch the same tasks at the same times, and
    every rank's ready set and round end alike."""
    try:
        spec, hint, _ = resolve_hint(name, Placement(p, v), m, backpressure=backpressure)
    except ValueError:
        assume(False)
    if budget is not None and (hint.backpressure != "admission" and v > 1):
        budget = None  # a budget needs admission backpressure with virtual stages

    def draw(*key) -> float:
        return random.Random(hash((seed, *key))).uniform(0.5, 2.0)

    def run() -> list:
        try:
            res = simulate(spec, hint, lambda k, r, t: draw(k, r, *t), inflight_limit=limit, steps=2,
                           delay=lambda k, a, b, t: draw("d", k, a, b, *t) - 0.5,
                           memory_budget=budget, act_bytes=(lambda k, s, mb: 1 + (s + mb) % 2) if budget else None)
        except DeadlockError as e:  # a budget below one microbatch: both paths must say so alike
            return [str(e)]
        return [(r.rank, r.step, tuple(r.task), r.start, r.end) for r in res.records] + [res.peak_inflight,
                                                                                        res.peak_bytes]

    fused = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KindPolicy, "next_taken", Policy.next_taken)
        plain = run()
    assert plain == fused
