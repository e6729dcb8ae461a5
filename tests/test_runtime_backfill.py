"""Conservative backfilling in the runtime (rrfp.runtime.features.notices, rrfp.scheduler.backfill):
started notices on the control plane, the dispatch order they allow, and refusals.

The pipelines run on simulated time (tests/virtual_time.py) with forced task seconds
(``task_delay``), so every order and step time below is computed by hand from the durations,
never measured. Two ranks, one stage each, two microbatches, the strict order

    rank 0: 0F0 0F1 0B0 0B1        rank 1: 1F0 1F1 1B0 1B1

with F on stage 0 taking 1.0 s, B on stage 0 0.5 s, F on stage 1 0.1 s and B on stage 1
``b1`` s; messages are instant. Step 0 measures the costs (no estimate yet: no notice); in
step 1, rank 0 starts 0F1 at 1.0 s and tells rank 1 it ends 1.0 s later. Rank 1 finishes 1F0 at
1.1 s; its planned 1F1 waits for 0F1's output (due at 2.0 s), so the window is 0.9 s:

- ``b1 = 0.3`` fits: rank 1 runs 1B0 at 1.1-1.4 s, then 1F1 2.0-2.1, 1B1 2.1-2.4; rank 0 runs
  0B0 at 2.0-2.5 (its gradient came at 1.4), 0B1 2.5-3.0: the step takes 3.0 s. The strict
  order takes 3.4 s (rank 1: 1F1 2.0-2.1, 1B0 2.1-2.4, 1B1 2.4-2.7; rank 0: 0B0 2.4-2.9,
  0B1 2.9-3.4).
- ``b1 = 1.0`` does not fit in 0.9 s: the strict order.
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch

from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.runtime.features.notices import MAX_SECONDS, STARTED, StartedNotices
from rrfp.scheduler.tasks import B, F, I, PipelineSpec, Placement, Task, W
from rrfp.transport.base import Message
from rrfp.transport.keys import Direction, MsgKey

from reference import assert_stage_grads
from virtual_time import VirtualTimeLoop

ORDER = "order:rank0: 0F0 0F1 0B0 0B1 | rank1: 1F0 1F1 1B0 1B1"
STRICT = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]


def _run(hint: str, durations: dict, *, steps: int = 2, mute_rank: int | None = None, budget=None, order=ORDER):
    """Run ``steps`` steps of the toy pipeline on simulated time; returns (per step: seconds,
    per-rank dispatch orders, n_backfilled, peak_bytes), the started notices sent
    ``(src, dst, step, task, seconds)``, the losses, the stage modules and the pipeline."""
    loop = VirtualTimeLoop()
    torch.manual_seed(0)
    cfg = ToyConfig()
    model = ToyModel(cfg, seed=0)
    ref = copy.deepcopy(model)
    mods = split_toy(model, 2)
    x, y = toy_batch(cfg, 8, seed=1)
    extra = {} if budget is None else {"memory_budget": budget}
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop):
        pipe = LocalPipeline(mods, 2, toy_loss, hint=f"{hint}{order}", record=True, watchdog=60,
                             task_delay=lambda step, rank, t: durations[(t.stage, t.kind)], **extra)
    sent = []
    for r, rt in enumerate(pipe.runtimes):
        rt.features["notices"].clock = loop.time  # the simulated clock: the costs are the forced seconds
        send = rt.features["notices"]._send

        def logged(dst, step, meta, r=r, send=send):
            sent.append((r, dst, step, Task(*meta["task"]), meta["s"]))
            if r != mute_rank:
                send(dst, step, meta)
        rt.features["notices"]._send = logged
    steps_out, losses = [], []
    with pipe:
        for _ in range(steps):
            t0 = loop.now
            losses.append(pipe.step(*x, target=y))
            stats = pipe.last_stats
            steps_out.append((loop.now - t0, [[str(rec.task) for rec in st.records] for st in stats],
                              [st.n_backfilled for st in stats], [st.peak_bytes for st in stats]))
    return steps_out, sent, losses, (ref, x, y, mods), pipe


FITS = {(0, F): 1.0, (0, B): 0.5, (1, F): 0.1, (1, B): 0.3}
TOO_LONG = {**FITS, (1, B): 1.0}


def test_notices_go_to_the_consumer_rank_for_its_inputs_only_under_backfill_hints():
    """Rank 0's forwards feed rank 1 and rank 1's backwards feed rank 0; rank 0's backwards
    (stage 0) and rank 1's forwards (the last stage) feed nobody. A notice needs an estimate,
    so step 0 announces only what runs after the first task of its kind was measured."""
    _, sent, _, _, _ = _run("backfill:", FITS)
    got = sorted((src, dst, step, str(t)) for src, dst, step, t, _ in sent)
    assert got == [(0, 1, 0, "0F1"), (0, 1, 1, "0F0"), (0, 1, 1, "0F1"),
                   (1, 0, 0, "1B1"), (1, 0, 1, "1B0"), (1, 0, 1, "1B1")]
    secs = {(src, str(t)[1]): s for src, _, _, t, s in sent}
    assert secs[(0, F)] == pytest.approx(1.0) and secs[(1, B)] == pytest.approx(0.3)
    _, sent, _, _, _ = _run("strict-", FITS)
    assert sent == []


def test_a_notice_lets_the_waiting_rank_run_a_later_task_that_fits():
    steps, _, _, _, pipe = _run("backfill:", FITS)
    assert steps[0][1] == STRICT and steps[0][2] == [0, 0]  # no estimates yet
    seconds, orders, backfilled, _ = steps[1]
    assert orders == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert backfilled == [0, 1]
    assert seconds == pytest.approx(3.0)
    assert [rt.inbox.rejected for rt in pipe.runtimes] == [0, 0]
    strict, _, _, _, _ = _run("strict-", FITS)
    assert [s[0] for s in strict] == pytest.approx([3.4, 3.4])


def test_no_backfill_when_the_later_task_does_not_fit():
    steps, _, _, _, _ = _run("backfill:", TOO_LONG)
    assert [s[1] for s in steps] == [STRICT, STRICT]
    assert steps[1][2] == [0, 0]
    assert steps[1][0] == pytest.approx(4.6)  # 1B0 2.1-3.1, 1B1 3.1-4.1, 0B0 3.1-3.6, 0B1 4.1-4.6


def test_no_backfill_without_a_notice():
    """Rank 0's notices are lost: rank 1 knows its own costs but not when 0F1's output can
    arrive, so it keeps the strict order."""
    steps, sent, _, _, _ = _run("backfill:", FITS, mute_rank=0)
    assert any(src == 0 for src, *_ in sent)
    assert [s[1] for s in steps] == [STRICT, STRICT]
    assert steps[1][0] == pytest.approx(3.4)


def test_gradients_and_losses_equal_the_strict_order_and_the_single_process_model():
    steps, _, losses, (ref, x, y, mods), _ = _run("backfill:", FITS)
    assert steps[1][2] == [0, 1]  # the order really changed
    _, _, strict_losses, (_, _, _, strict_mods), _ = _run("strict-", FITS)
    for a, b in zip(mods, strict_mods):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    ref_loss = toy_loss(ref(x), y)
    ref_loss.backward()
    assert_stage_grads(mods, {n: p.grad for n, p in ref.named_parameters()}, scale=2.0)  # two steps
    for got, want in zip(losses, strict_losses):
        assert got == want
    assert float(losses[0]) == pytest.approx(ref_loss.detach().item(), rel=1e-5)


def test_peak_bytes_never_above_the_strict_orders():
    """Measured bytes (a budget too large to bind turns the measuring on): backfilling 1B0
    ahead of 1F1 frees rank 1's first activation before the second comes."""
    big = 1 << 40
    steps, _, _, _, _ = _run("backfill:", FITS, budget=big)
    strict, _, _, _, _ = _run("strict-", FITS, budget=big)
    assert steps[1][2] == [0, 1]
    for (_, _, _, got), (_, _, _, want) in zip(steps, strict):
        assert all(0 < g <= w for g, w in zip(got, want))
    assert steps[1][3][1] < strict[1][3][1]


def test_a_forward_that_fits_in_time_is_not_run_ahead_past_the_orders_bytes():
    """One microbatch in flight: rank 0's planned 0B0 waits for rank 1's 1B0 (announced for
    1.0 s); 0F1 (0.1 s) fits in the window but would hold a second activation the order never
    holds, so rank 0 keeps the order."""
    order = "order:rank0: 0F0 0B0 0F1 0B1 | rank1: 1F0 1B0 1F1 1B1"
    durations = {(0, F): 0.1, (0, B): 0.1, (1, F): 1.0, (1, B): 1.0}
    steps, sent, _, _, pipe = _run("backfill:", durations, budget=1 << 40, order=order)
    assert any(src == 1 and step == 1 and str(t) == "1B0" for src, _, step, t, _ in sent)
    assert pipe.runtimes[0].features["notices"].averages(Task(0, F, 1)) == pytest.approx(0.1)
    want = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert [s[1] for s in steps] == [want, want]
    assert steps[1][2] == [0, 0]


# ------------------------------------------------------------------ refusals
def _notice(step, task, s, src, job="j"):
    return Message(src, MsgKey(job, step, 0, 0, Direction.CTL), [],
                   {"kind": STARTED, "task": list(task), "s": s})


@pytest.mark.parametrize("task,s,src,step,why", [
    ((0, F, 0), 0.5, 0, 0, None),                       # rank 0's forward feeds rank 1
    ((2, I, 1), 0.5, 2, 1, None),                       # rank 2's input backward feeds rank 1 (next step)
    ((1, F, 0), 0.5, 1, 0, "does not receive"),         # rank 1's own task
    ((2, F, 0), 0.5, 2, 0, "does not receive"),         # feeds rank 3... none: stage 2 is the last
    ((0, W, 0), 0.5, 0, 0, "does not receive"),         # W feeds nobody
    ((2, B, 0), 0.5, 2, 0, "does not receive"),         # not a kind of this split pipeline
    ((0, F, 4), 0.5, 0, 0, "no task"),                  # microbatch out of range
    ((0, F, 0), 0.5, 2, 0, "belongs to rank 0"),        # not the producer
    ((2, I, 0), 0.5, 0, 0, "belongs to rank 2"),
    ((0, F, 0), -0.1, 0, 0, "seconds"),
    ((0, F, 0), math.nan, 0, 0, "seconds"),
    ((0, F, 0), math.inf, 0, 0, "seconds"),
    ((0, F, 0), MAX_SECONDS * 2, 0, 0, "seconds"),
    ((0, F, 0), "1.0", 0, 0, "seconds"),
    ((0, F, 0), True, 0, 0, "seconds"),
    ((0, F, 0), 0.5, 0, 2, "step 2 while in step 0"),   # neither this step nor the next
    ((0, F, 0), 0.5, 0, -1, "step -1"),
])
def test_started_notice_admission(task, s, src, step, why):
    spec = PipelineSpec(Placement(3), 4, True)
    n = StartedNotices(spec, 1, send=lambda *a: None)
    n.clock = lambda: 10.0
    problem = n.receive(_notice(step, task, s, src), current=0)
    if why is None:
        assert problem is None and n._boards[step] == {Task(*task): 10.0 + s}
    else:
        assert why in problem and n.n_received == 0


@pytest.mark.parametrize("meta", [
    {"kind": STARTED, "task": [0, F, 0]},
    {"kind": STARTED, "task": [0, F, 0], "s": 0.1, "x": 1},
    {"kind": STARTED, "task": [0, F], "s": 0.1},
    {"kind": STARTED, "task": [True, F, 0], "s": 0.1},
    {"kind": STARTED, "task": "0F0", "s": 0.1},
    {"kind": STARTED, "task": [0, "X", 0], "s": 0.1},
])
def test_malformed_started_notices_are_refused(meta):
    spec = PipelineSpec(Placement(3), 4, True)
    n = StartedNotices(spec, 1, send=lambda *a: None)
    assert n.receive(Message(0, MsgKey("j", 0, 0, 0, Direction.CTL), [], meta), current=0) is not None


def test_a_second_notice_for_one_task_is_refused():
    n = StartedNotices(PipelineSpec(Placement(2), 2, False), 1, send=lambda *a: None)
    assert n.receive(_notice(0, (0, F, 0), 0.5, 0), 0) is None
    assert "second" in n.receive(_notice(0, (0, F, 0), 0.1, 0), 0)


def test_notices_are_sent_to_the_rank_holding_the_consumer_with_virtual_stages():
    """Two ranks, two virtual stages each (loop: rank 0 holds stages 0 and 2): every F and I
    whose consumer stage is on the other rank is announced there, once estimated; W, stage 0's
    I and the last stage's F are not."""
    got = []
    n = StartedNotices(PipelineSpec(Placement(2, 2), 2, True), 0, send=lambda *a: got.append(a))
    t = [0.0]
    n.clock = lambda: t[0]
    for task in [Task(0, F, 0), Task(2, F, 0), Task(2, I, 0), Task(2, W, 0), Task(0, I, 0), Task(0, W, 0)]:
        n.started(0, task)
        t[0] += 0.25
        n.finished(task)
    assert got == []  # nothing estimated yet
    for task in [Task(0, F, 1), Task(2, F, 1), Task(2, I, 1), Task(2, W, 1), Task(0, I, 1), Task(0, W, 1)]:
        n.started(0, task)
        n.finished(task)
    assert [(dst, step, m["task"], m["s"]) for dst, step, m in got] == [
        (1, 0, [0, F, 1], 0.25), (1, 0, [2, F, 1], 0.25), (1, 0, [2, I, 1], 0.25)]


def test_forged_notices_over_the_network_are_counted_and_the_step_still_matches():
    """Hostile started notices sent to rank 1 between its steps are refused and counted with
    its other refusals; the next step's order and gradients are those of the run without them."""
    clean, _, _, (_, _, _, clean_mods), _ = _run("backfill:", FITS)
    forged = [
        {"kind": STARTED, "task": [1, F, 0], "s": 0.5},           # rank 1's own task
        {"kind": STARTED, "task": [0, F, 0], "s": -1.0},
        {"kind": STARTED, "task": [0, F, 0], "s": math.nan},
        {"kind": STARTED, "task": [0, F, 0], "s": 1e12},
        {"kind": STARTED, "task": [0, F, 9], "s": 0.5},
        {"kind": STARTED, "task": [0, F, 0]},
    ]
    loop = VirtualTimeLoop()
    torch.manual_seed(0)
    cfg = ToyConfig()
    mods = split_toy(ToyModel(cfg, seed=0), 2)
    x, y = toy_batch(cfg, 8, seed=1)
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop):
        pipe = LocalPipeline(mods, 2, toy_loss, hint="backfill:" + ORDER, record=True, watchdog=60,
                             task_delay=lambda step, rank, t: FITS[(t.stage, t.kind)])
    for rt in pipe.runtimes:
        rt.features["notices"].clock = loop.time
    with pipe:
        pipe.step(*x, target=y)
        job = pipe.runtimes[0].job

        async def forge():
            for meta in forged:
                pipe.transports[0].send(1, MsgKey(job, 1, 0, 0, Direction.CTL), [], meta)
            pipe.transports[0].send(1, MsgKey(job, 7, 0, 0, Direction.CTL), [],
                                    {"kind": STARTED, "task": [0, F, 0], "s": 0.5})
        pipe.run(forge())
        pipe.step(*x, target=y)
        orders = [[str(r.task) for r in st.records] for st in pipe.last_stats]
    assert pipe.runtimes[1].inbox.rejected == len(forged) + 1
    assert orders == clean[1][1]
    for a, b in zip(mods, clean_mods):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_forward_only_step_between_backfilling_steps():
    """``eval`` (forwards only, no backfilling) between two training steps: its outputs are the
    single-process model's, and the step after it backfills as before."""
    loop = VirtualTimeLoop()
    cfg = ToyConfig()
    model = ToyModel(cfg, seed=0)
    ref = copy.deepcopy(model)
    x, y = toy_batch(cfg, 8, seed=1)
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop):
        pipe = LocalPipeline(split_toy(model, 2), 2, toy_loss, hint="backfill:" + ORDER, record=True, watchdog=60,
                             task_delay=lambda step, rank, t: FITS[(t.stage, t.kind)])
    for rt in pipe.runtimes:
        rt.features["notices"].clock = loop.time
    with pipe:
        pipe.step(*x, target=y)
        with torch.no_grad():
            want = ref(x)
        torch.testing.assert_close(pipe.eval(*x, target=y), want, rtol=1e-5, atol=1e-6)
        pipe.step(*x, target=y)
        assert [st.n_backfilled for st in pipe.last_stats] == [0, 1]


@pytest.mark.parametrize("hint", ["backfill", "backfill:1f1b", "strict-split", "split"])
def test_rrfp_train_takes_backfilling_hints(hint):
    from rrfp.train.early import hint_problem

    assert hint_problem(hint, "auto") is None
    assert "unknown hint" in hint_problem("backfil", "auto")


def test_notices_announce_the_fastest_seconds_and_backfill_takes_the_slowest():
    """Costs vary: the window must be a lower bound on the input's arrival and a backfilled
    task must surely end in it, so a notice carries the fewest seconds its kind took here and
    the rank's estimate of its own tasks is the most."""
    got = []
    spec = PipelineSpec(Placement(2), 4, False)
    n = StartedNotices(spec, 0, send=lambda *a: got.append(a))
    t = [0.0]
    n.clock = lambda: t[0]
    for m, secs in enumerate([0.3, 0.1, 0.2]):
        n.started(0, Task(0, F, m))
        t[0] += secs
        n.finished(Task(0, F, m))
    n.started(0, Task(0, F, 3))
    assert got[-1][2]["s"] == pytest.approx(0.1)
    assert n.averages(Task(0, F, 0)) == pytest.approx(0.2)
    assert n.backfill(0, spec).estimate(Task(0, F, 3)) == pytest.approx(0.3)


def test_a_control_message_whose_meta_is_not_a_map_is_refused_and_counted():
    """The wire codec refuses it; a transport that hands it over anyway must not fail the rank."""
    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)
    losses = []
    for forge in (False, True):
        with LocalPipeline(split_toy(ToyModel(cfg, seed=0), 2), 2, toy_loss, hint="bf") as pipe:
            inbox = pipe.runtimes[1].inbox
            if forge:
                inbox.on_message(Message(0, MsgKey(pipe.runtimes[1].job, 0, 0, 0, Direction.CTL), [],
                                         ["not", "a", "map"]))
                assert inbox.rejected == 1
            losses.append(pipe.step(*x, target=y))
    assert losses[0] == losses[1]
