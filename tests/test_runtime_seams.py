"""The seams step features join a rank through (rrfp.runtime.engine.observer, Inbox.on_control,
SchedulerLoop.set_decider) and the one way to switch a running pipeline's hint
(FrontDoor.set_hint), over the fake transport: what an observer sees in a hand-computed run on
simulated time, what a control handler receives and refuses, a decider that asks again."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.runtime.engine.loop import AGAIN
from rrfp.runtime.engine.observer import StepObserver
from rrfp.scheduler.tasks import B, F

from reference import assert_stage_grads
from virtual_time import VirtualTimeLoop


class Recorder(StepObserver):
    """Every event with the simulated time it fired at."""

    def __init__(self, clock, watch: bool = True) -> None:
        self.clock, self.watch = clock, watch
        self.events: list[tuple] = []

    def step_begins(self, step, arb):
        self.events.append(("begin", step, self.clock()))
        return self.watch

    def before_decision(self):
        self.events.append(("decide", self.clock()))

    def task_started(self, step, task):
        self.events.append(("start", str(task), self.clock()))

    def task_finished(self, step, task, start, end):
        assert end >= start
        self.events.append(("finish", str(task), self.clock()))

    def idle(self):
        self.events.append(("idle", self.clock()))

    def step_ends(self, step, stats):
        self.events.append(("end", step, stats.n_tasks, self.clock()))


def _toy_pipe(hint: str, loop=None, **options):
    cfg = ToyConfig()
    model = ToyModel(cfg, seed=0)
    ref = copy.deepcopy(model)
    mods = split_toy(model, 2)
    x, y = toy_batch(cfg, 8, seed=1)
    if loop is None:
        return LocalPipeline(mods, 2, toy_loss, hint=hint, watchdog=60, **options), (ref, mods, x, y)
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop):
        return LocalPipeline(mods, 2, toy_loss, hint=hint, watchdog=60, **options), (ref, mods, x, y)


def test_an_observer_sees_a_hand_computed_step_in_order():
    """2 ranks, 2 microbatches, strict 1F1B, every task 1 s, messages instant (simulated time).
    By hand: rank 0 runs 0F0 [0, 1], 0F1 [1, 2], waits for 1B0's gradient (t = 3), 0B0 [3, 4],
    waits for 1B1's (t = 5), 0B1 [5, 6]; rank 1 waits for 0F0's output (t = 1), then 1F0
    [1, 2], 1B0 [2, 3], 1F1 [3, 4] (0F1's output came at 2), 1B1 [4, 5]. A decision comes
    before each task and before each wait; an observer that sits the step out sees only its
    beginning and end."""
    loop = VirtualTimeLoop()
    pipe, (_, _, x, y) = _toy_pipe("strict-1f1b", loop, task_delay=lambda step, rank, t: 1.0)
    rec = [Recorder(loop.time) for _ in range(2)]
    quiet = Recorder(loop.time, watch=False)
    for rt, r in zip(pipe.runtimes, rec):
        rt.loop.add_observer(r)
    pipe.runtimes[0].loop.add_observer(quiet)
    with pipe:
        pipe.step(*x, target=y)

    def task(name, t0):
        return [("decide", t0), ("start", name, t0), ("finish", name, t0 + 1.0)]

    assert rec[0].events == [("begin", 0, 0.0), *task("0F0", 0.0), *task("0F1", 1.0), ("decide", 2.0), ("idle", 2.0),
                             *task("0B0", 3.0), ("decide", 4.0), ("idle", 4.0), *task("0B1", 5.0), ("end", 0, 4, 6.0)]
    assert rec[1].events == [("begin", 0, 0.0), ("decide", 0.0), ("idle", 0.0), *task("1F0", 1.0), *task("1B0", 2.0),
                             *task("1F1", 3.0), *task("1B1", 4.0), ("end", 0, 4, 5.0)]
    assert quiet.events == [("begin", 0, 0.0), ("end", 0, 4, 6.0)]


def test_a_control_handler_receives_its_kind_and_its_refusals_are_counted():
    """Over the fake network's codec: messages of the registered kind reach the handler with
    the step the rank runs next; what it refuses is counted with the inbox's refusals; a kind
    with no handler (or a kind that is not text) stays in the control queue for the rank's
    own reader, as before handlers existed."""
    pipe, (_, _, x, y) = _toy_pipe("1f1b")
    got = []

    def probe(msg, step):
        got.append((msg.src, msg.meta["kind"], msg.meta["n"], step))
        return None if msg.meta["n"] < 2 else f"n={msg.meta['n']}: expected at most 1"

    with pipe:
        rts = pipe.runtimes
        rts[1].inbox.on_control("probe", probe)
        pipe.step(*x, target=y)  # step 0: the ranks receive from their first step on

        async def exchange():
            for meta in ({"kind": "probe", "n": 1}, {"kind": "other"}, {"kind": "probe", "n": 5}, {"kind": ["x"]}):
                rts[0].send_control(1, 0, meta)
            return [(await rts[1].control(timeout=60)).meta for _ in range(2)]

        queued = pipe.run(exchange())
        assert queued == [{"kind": "other"}, {"kind": ["x"]}]
        assert got == [(0, "probe", 1, 1), (0, "probe", 5, 1)]
        assert rts[1].inbox.rejected == 1 and rts[0].inbox.rejected == 0
        with pytest.raises(ValueError, match="control kind 'probe' already has a handler"):
            rts[1].inbox.on_control("probe", probe)
        with pytest.raises(ValueError, match="control kind '': expected a non-empty string"):
            rts[1].inbox.on_control("", probe)
        assert set(rts[1].features) == {"notices"}  # backfilling's, attached by the front door


def test_a_decider_that_asks_again_changes_no_order_and_no_result():
    """A decider answering AGAIN at every other call (as a TP group that disagrees): the loop
    looks at its arrivals and decides again; the strict order and the gradients are those of
    the run without it (and of the single-process model)."""
    runs = []
    for with_decider in (False, True):
        pipe, (ref, mods, x, y) = _toy_pipe("strict-1f1b", record=True)
        calls = []
        if with_decider:
            async def decide(arb, calls=calls):
                calls.append(arb)
                return AGAIN if len(calls) % 2 else arb.next()

            for rt in pipe.runtimes:
                rt.loop.set_decider(decide)
            with pytest.raises(ValueError, match="a decider is already set"):
                pipe.runtimes[0].loop.set_decider(decide)
        with pipe:
            loss = pipe.step(*x, target=y)
            orders = [[str(r.task) for r in st.records] for st in pipe.last_stats]
        runs.append((orders, loss, [p.grad.clone() for m in mods for p in m.parameters()]))
        if with_decider:
            assert len(calls) >= 2 * 8  # every task was asked for twice at least
            ref_loss = toy_loss(ref(x), y)
            ref_loss.backward()
            assert_stage_grads(mods, {n: p.grad for n, p in ref.named_parameters()})
    assert runs[0][0] == runs[1][0] == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert runs[0][1] == runs[1][1]
    for a, b in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_set_hint_switches_every_rank_and_a_bad_hint_changes_nothing():
    """From 1F1B to BFW (a split backward) between steps: every rank's spec, hint and strict
    mode, its stage hooks' final kind (W), its stage modules' split backward; the next step
    runs I and W tasks and its gradients are the single-process model's. A hint that does not
    resolve raises and leaves the pipeline as it was."""
    pipe, (ref, mods, x, y) = _toy_pipe("1f1b", record=True)
    with pipe:
        assert [rt.hooks.final_kind for rt in pipe.runtimes] == [B, B]
        with pytest.raises(ValueError, match="nope"):
            pipe.set_hint("nope")
        assert pipe.hint_name == "1f1b" and not pipe.spec.split_backward
        pipe.set_hint("bfw")
        assert pipe.hint_name == "bfw" and pipe.spec.split_backward and not pipe.strict
        for rt in pipe.runtimes:
            assert (rt.spec, rt.hint, rt.strict) == (pipe.spec, pipe.hint, pipe.strict)
            assert rt.hooks.final_kind == "W"
        pipe.step(*x, target=y)
        kinds = {r.task.kind for st in pipe.last_stats for r in st.records}
    assert kinds == {F, "I", "W"}
    ref_loss = toy_loss(ref(x), y)
    ref_loss.backward()
    assert_stage_grads(mods, {n: p.grad for n, p in ref.named_parameters()})
