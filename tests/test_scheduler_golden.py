"""Golden dispatch orders: each hint's defining rule, pinned by hand-computed sequences on a
scripted arrival of inputs (no clock, no threads: the arbiter alone).

Script (rank 0 of 2, stage 0, 6 microbatches unless said): three dispatches with nothing
arrived (only forwards can run), then the gradients of microbatches 0 and 1 arrive together,
five dispatches, then the other gradients arrive and the step drains. The moment two
backwards and several forwards are ready at once is where the rules differ.
"""

from __future__ import annotations

import pytest

from rrfp.scheduler.arbiter import Arbiter
from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.tasks import Placement


def stepper(arb: Arbiter, seen: list):
    """``run(k)``: dispatch (and complete) up to ``k`` of ``arb``'s tasks, appending them to
    ``seen`` as text, stopping early when none is ready."""
    def run(k: int) -> None:
        for _ in range(k):
            t = arb.next()
            if t is None:
                return
            seen.append(str(t))
            arb.complete(t)
    return run


def dispatch(hint: str, script, n_ranks: int = 2, M: int = 6, rank: int = 0, limit: int = 32) -> str:
    """Run the arbiter of ``rank`` through ``script``: an int ``k`` dispatches (and completes)
    up to ``k`` tasks, stopping early when none is ready; a list of ``(stage, mb, grad)``
    delivers those inputs. The rest drains once the script ends. Returns the tasks in
    dispatch order, as text."""
    spec, h, strict = resolve_hint(hint, Placement(n_ranks), M)
    arb = Arbiter(spec, rank, h, strict=strict, inflight_limit=limit)
    seen = []

    run = stepper(arb, seen)

    for item in script:
        if isinstance(item, int):
            run(item)
        else:
            for s, m, g in item:
                arb.mark_input(s, m, g)
    run(10 ** 6)
    assert arb.finished, f"{hint}: stuck after {seen}"
    return " ".join(seen)


SCRIPT = [3, [(0, 0, True), (0, 1, True)], 5, [(0, m, True) for m in (2, 3, 4, 5)]]

GOLDEN = {
    # bf: rounds of one ready B, then one ready F (RRFP App. A); with one kind ready it runs that.
    "bf": "0F0 0F1 0F2 0B0 0F3 0B1 0F4 0F5 0B2 0B3 0B4 0B5",
    # fb: rounds of one ready F, then one ready B. The first task of a step is always an F,
    # after which the round asks for a B: the same sequence as bf.
    "fb": "0F0 0F1 0F2 0B0 0F3 0B1 0F4 0F5 0B2 0B3 0B4 0B5",
    # b-priority: any ready B first.
    "b-priority": "0F0 0F1 0F2 0B0 0B1 0F3 0F4 0F5 0B2 0B3 0B4 0B5",
    # f-priority: any ready F first.
    "f-priority": "0F0 0F1 0F2 0F3 0F4 0F5 0B0 0B1 0B2 0B3 0B4 0B5",
    # bfw: split backward, B (here I) > F > W: W only when no I or F is ready.
    "bfw": "0F0 0F1 0F2 0I0 0I1 0F3 0F4 0F5 0I2 0I3 0I4 0I5 0W0 0W1 0W2 0W3 0W4 0W5",
    # bfw-alt: split backward, rounds of one ready I then one ready F (as bf), W only when
    # neither is ready: I0 F3 I1 F4 where bfw runs I0 I1 F3 F4.
    "bfw-alt": "0F0 0F1 0F2 0I0 0F3 0I1 0F4 0F5 0I2 0I3 0I4 0I5 0W0 0W1 0W2 0W3 0W4 0W5",
    # An order used as a hint: the earliest ready task of PyTorch's order. 1F1B's rank 0 order
    # is F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5; B0 is not ready after F1, so F2 goes first.
    "1f1b": "0F0 0F1 0F2 0B0 0B1 0F3 0F4 0F5 0B2 0B3 0B4 0B5",
    # GPipe's order: every F, then every B.
    "gpipe": "0F0 0F1 0F2 0F3 0F4 0F5 0B0 0B1 0B2 0B3 0B4 0B5",
}


@pytest.mark.parametrize("hint", sorted(GOLDEN))
def test_golden_dispatch_order(hint):
    assert dispatch(hint, SCRIPT) == GOLDEN[hint]


def test_bf_golden_fails_for_plain_backward_first():
    """The bf golden order tells bf from its nearest wrong rule: a bf replaced by plain
    backward-first (b-priority) fails it."""
    assert dispatch("b-priority", SCRIPT) != GOLDEN["bf"]
    # And bfw's W-last rule: W as soon as a slot is free would run W0 before F3.
    script = [3, [(0, 0, True)], 2, [(0, m, True) for m in range(1, 6)]]
    assert dispatch("bfw", script).split()[3:5] == ["0I0", "0F3"]


def test_inflight_limit_blocks_forwards_until_a_backward_frees_a_slot():
    # Limit 2: after F0 F1 nothing may start until a gradient comes; then B0 frees a slot.
    got = dispatch("bf", [5, [(0, 0, True)], 5, [(0, m, True) for m in range(1, 6)]], limit=2)
    assert got.startswith("0F0 0F1 0B0 0F2 ")


STRICT_GOLDEN = {
    # PyTorch's orders for 2 ranks and 4 microbatches (rank 0 | rank 1); ZB-H1's rank r
    # defers its first r weight gradients (tests/test_scheduler_schedules.py checks these
    # against torch's own schedule objects for more shapes).
    "strict-gpipe": ("0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"),
    "strict-1f1b": ("0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"),
    "strict-zb-h1": ("0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
                     "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"),
}


@pytest.mark.parametrize("hint", sorted(STRICT_GOLDEN))
def test_strict_schedules_run_pytorchs_order(hint):
    for rank in (0, 1):
        spec, h, strict = resolve_hint(hint, Placement(2), 4)
        assert strict
        assert " ".join(map(str, h.order[rank])) == STRICT_GOLDEN[hint][rank]


def test_depth_first_under_a_budget_runs_the_oldest_first_hand_computed():
    """bfw-alt-df on rank 0 of 2 with 2 virtual stages (stages 0 and 2), 1 byte per forward,
    a budget of 3 bytes: the banker's check of rrfp.scheduler.memory, step by step."""
    spec, h, _ = resolve_hint("bfw-alt-df", Placement(2, 2), 4)
    arb = Arbiter(spec, 0, h, memory_budget=3, act_bytes=lambda s, m: 1)
    seen = []

    run = stepper(arb, seen)

    # mb 0 alone; mb 1 (2 held, 1 free: mb 0 can still take its stage 2, then mb 1 from what
    # mb 0 frees); not mb 2 (3 held, and mb 0 could not take its stage 2).
    run(3)
    assert seen == ["0F0", "0F1"]
    # mb 1's stage 2 is ready but is not the oldest's: after it, nothing is free for mb 0.
    arb.mark_input(2, 1, False)
    run(1)
    assert seen == ["0F0", "0F1"]
    # mb 0's stage 2 is the oldest's: granted, and preferred to an admission (depth-first).
    arb.mark_input(2, 0, False)
    run(1)
    arb.mark_input(2, 0, True)
    # I0 frees nothing (W0 still reads what F0 saved), so mb 1's stage 2 is not granted and
    # W0 runs and frees a byte; then mb 1's stage 2 (mb 0 needs nothing now), not mb 2's
    # admission (2 held + 1 reserved for mb 1 + 2 for mb 2 > 1.5 budgets).
    run(3)
    assert seen == ["0F0", "0F1", "2F0", "2I0", "2W0", "2F1"]
    assert arb.peak_bytes == 3


def _budget_dispatch(hint: str) -> str:
    """Rank 0 of 2, one stage per rank, 4 microbatches of 1 byte, a budget of 2 bytes (a split
    backward frees its byte at W): two dispatches, then the gradients of microbatches 0 and 1,
    four dispatches, then the other gradients, then the step drains."""
    spec, h, _ = resolve_hint(hint, Placement(2), 4)
    arb = Arbiter(spec, 0, h, memory_budget=2, act_bytes=lambda s, m: 1)
    seen: list = []
    run = stepper(arb, seen)
    run(2)
    arb.mark_input(0, 0, True)
    arb.mark_input(0, 1, True)
    run(4)
    for m in (2, 3):
        arb.mark_input(0, m, True)
    run(100)
    assert arb.finished and arb.peak_bytes == 2
    return " ".join(seen)


def test_memory_aware_w_first_when_the_budget_refuses_a_forward_hand_computed():
    # After F0 F1 the budget is full and F2 is refused. bfw-alt-df runs every ready I before
    # the W that frees a byte: I0 I1 W0 F2; after F2 the budget is full again, so I2 (ready
    # since its gradient came) goes before W1, then F3 I3 W2 W3.
    assert _budget_dispatch("bfw-alt-df") == "0F0 0F1 0I0 0I1 0W0 0F2 0I2 0W1 0F3 0I3 0W2 0W3"
    # bfw-mem: F2 is refused and W0 is not ready until I0 ran, so I0; then W0 at once (frees a
    # byte), F2 (the round's F), I1 (F3 refused, no W ready); then W1 before I2, F3, and the
    # rest as bfw-alt-df (I2 I3 rounds with no F left, then W2 W3).
    assert _budget_dispatch("bfw-mem") == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0I3 0W2 0W3"
    # Without a budget bfw-mem is bfw-alt-df (and with one stage per rank, bfw-alt).
    assert dispatch("bfw-mem", SCRIPT) == dispatch("bfw-alt-df", SCRIPT) == GOLDEN["bfw-alt"]


def test_forward_only_arbiter_runs_the_deepest_ready_forward_first():
    """Rank 0 of 2 with 2 virtual stages (stages 0 and 2), 3 microbatches, forwards only:
    stage 0's data is there; stage 2's activations arrive for microbatches 1 then 0. A ready
    stage-2 forward goes before any stage-0 one, lowest microbatch first; propose takes
    nothing, commit takes exactly the task."""
    from rrfp.scheduler.forward import ForwardArbiter
    from rrfp.scheduler.tasks import PipelineSpec, Task

    arb = ForwardArbiter(PipelineSpec(Placement(2, 2), 3), 0)
    seen = []
    for script in ([], [(2, 1)], [(2, 0)], [], [(2, 2)], []):
        for s, m in script:
            arb.mark_input(s, m, False)
        t = arb.propose()
        assert arb.propose() == t
        if t is not None:
            arb.commit(t)
            seen.append(str(t))
            arb.complete(t)
    while not arb.finished:
        t = arb.next()
        seen.append(str(t))
        arb.complete(t)
    assert " ".join(seen) == "0F0 2F1 2F0 0F1 2F2 0F2"
    with pytest.raises(Exception, match="not ready"):
        ForwardArbiter(PipelineSpec(Placement(2, 2), 3), 0).commit(Task(2, "F", 0))
