"""Forward-only steps in a row (``Pipeline.eval()``, ``rrfp train --eval-every``) keep every
rank within one step of the ranks it sends to (rrfp/runtime/engine/pace.py).

A rank needs nothing back in a forward-only step, so without pacing the first stage's rank
can finish two of them and send the next step's activations while the last stage's rank has
not begun the first: the inbox refuses a message more than one step ahead, and both ranks
wait until the watchdog fires (the ``rrfp train --stages 2 --dp 2 --grad-accum 2
--eval-every 1`` hang). Here the order is forced on simulated time.
"""

from __future__ import annotations

import asyncio
import copy
from unittest import mock

import pytest
import torch

from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
from rrfp.runtime.doors.local import LocalPipeline

M = 4  # microbatches
LATE = 5.0  # simulated seconds rank 1 begins after rank 0
WATCHDOG = 60.0


def _pipe(mods, loop) -> LocalPipeline:
    """Two ranks on ``loop``; every message takes 10 ms (simulated)."""
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop):
        return LocalPipeline(mods, M, toy_loss, delay=(0.01, 0.01), watchdog=WATCHDOG, hint="strict-1f1b")


def _microbatches(x, y) -> tuple[list[tuple], list]:
    parts = [t.tensor_split(M) for t in x]  # the toy model's inputs are a tuple of tensors
    return [tuple(p[m] for p in parts) for m in range(M)], list(y.tensor_split(M))


async def _rank(rt, r: int, late: float, plan, inputs, targets, losses: list) -> None:
    """Run ``plan`` (``[(step, forward_only)]``) on rank ``r`` of two, ``late`` s after the start."""
    if late:
        await asyncio.sleep(late)  # simulated time: forces rank 1 to begin after rank 0 ran ahead
    for step, forward_only in plan:
        st = await rt.run_step(step, inputs if r == 0 else None, targets if r == 1 else None,
                               forward_only=forward_only)
        losses.append(st.loss)


@pytest.mark.parametrize("evals", [2, 3])
def test_eval_steps_in_a_row_while_the_last_stage_rank_is_held_back_complete(evals):
    """Rank 0 (stage 0) runs ``evals`` forward-only steps, then a training step; rank 1 (the
    last stage) begins ``LATE`` s later. Every step completes (on main the training step's
    activations were refused, step ``evals`` while in step 0, and the watchdog fired), rank 0's
    forward-only steps end only after rank 1 began each, and the losses and gradients equal
    those of the same steps run in lockstep by ``LocalPipeline``."""
    from virtual_time import VirtualTimeLoop

    torch.manual_seed(0)
    cfg = ToyConfig()
    mods = split_toy(ToyModel(cfg), 2)
    ref_mods = copy.deepcopy(mods)
    x, y = toy_batch(cfg, 8, seed=1)
    inputs, targets = _microbatches(x, y)
    plan = [(k, True) for k in range(evals)] + [(evals, False)]

    loop = VirtualTimeLoop()
    pipe = _pipe(mods, loop)
    losses: list = []
    ends: list = []
    with pipe:
        rt0, rt1 = pipe.runtimes
        orig = rt0.run_step

        async def timed(*a, **k):
            st = await orig(*a, **k)
            ends.append(loop.time())
            return st

        rt0.run_step = timed

        async def both():
            await asyncio.gather(_rank(rt0, 0, 0.0, plan, inputs, targets, []),
                                 _rank(rt1, 1, LATE, plan, inputs, targets, losses))

        t0 = loop.time()
        pipe.run(both())
        assert rt0.inbox.rejected == rt1.inbox.rejected == 0
    assert ends[0] - t0 >= LATE, "rank 0's first forward-only step ends once rank 1 began it"

    with LocalPipeline(ref_mods, M, toy_loss, watchdog=WATCHDOG, hint="strict-1f1b") as ref:
        ref_losses = []
        for _ in range(evals):
            ref.eval(microbatches=inputs, targets=targets)
            ref_losses.append(ref.last_loss)
        ref.step(microbatches=inputs, targets=targets, return_outputs=False)
        ref_losses.append(ref.last_loss)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for a, b in zip(mods, ref_mods):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_receiver_that_never_begins_fails_the_step_at_the_watchdog_naming_it():
    """Rank 1 never begins the forward-only step: rank 0 sends its activations and fails one
    watchdog period later (simulated), naming rank 1, instead of returning and running ahead."""
    from rrfp.errors import WatchdogTimeout

    from virtual_time import VirtualTimeLoop

    torch.manual_seed(0)
    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)
    inputs, _ = _microbatches(x, y)
    loop = VirtualTimeLoop()
    pipe = _pipe(split_toy(ToyModel(cfg), 2), loop)
    with pipe:
        t0 = loop.time()
        with pytest.raises(WatchdogTimeout, match=r"rank 0 made no progress for 60 s at the end of forward-only "
                                                  r"step 0: waiting for rank\(s\) \[1\]"):
            pipe.run(pipe.runtimes[0].run_step(0, inputs, forward_only=True))
        assert loop.time() - t0 == pytest.approx(WATCHDOG, abs=0.1)


def test_begun_notices_a_correct_pipeline_cannot_send_are_refused():
    """Refused and counted, never taken: from a rank that receives no activations from this
    one, with more than its kind, for a step not after the sender's last notice or beyond the
    next step."""
    from rrfp.transport.base import Message
    from rrfp.transport.keys import Direction, MsgKey

    cfg = ToyConfig()
    with LocalPipeline(split_toy(ToyModel(cfg), 2), M, toy_loss, watchdog=WATCHDOG) as pipe:
        rt0, rt1 = pipe.runtimes
        job = rt0.job

        def notice(rt, src, step, **extra):
            before = rt.inbox.rejected
            rt.inbox.on_message(Message(src, MsgKey(job, step, 0, 0, Direction.CTL), [], {"kind": "begun", **extra}))
            return rt.inbox.rejected == before

        assert (rt0.pace.upstream, rt0.pace.downstream, rt1.pace.upstream, rt1.pace.downstream) == ([], [1], [0], [])
        assert not notice(rt1, 0, 0)  # rank 1 sends rank 0 no activations
        assert not notice(rt0, 1, 2)  # rank 0 is about to run step 0: step 2 is beyond the next
        assert not notice(rt0, 1, 0, extra=1)
        assert notice(rt0, 1, 0) and rt0.pace.begun == {1: 0}
        assert not notice(rt0, 1, 0)  # a second one for the step
        assert notice(rt0, 1, 1) and rt0.pace.begun == {1: 1}
        assert rt0.inbox.rejected == 3 and rt1.inbox.rejected == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rrfp_train_dp2_grad_accum_with_an_evaluation_every_step_follows_the_dp1_curve(tmp_path):
    """``rrfp train --stages 2 --dp 2 --grad-accum 2 --eval-every 1`` (4 processes; on main it
    hung in most runs: a first-stage rank ran its two evaluation steps and sent the next
    training step's activations to a last-stage rank still held in the DP all-reduces, which
    refused them) completes, and its training and validation losses equal those of ``--dp 1``
    with the same flags (the layout changes no loss), as tests/test_parallel_layouts.py
    compares DP with PP alone. (The reference evaluates too: ``--eval-every`` holds samples
    out of the training pool, so it changes the training batches.)"""
    import re

    from runs import losses, train

    common = ("--stages", "2", "--steps", "4", "--grad-accum", "2", "--eval-every", "1")
    ref_out = train(*common, "--loss-file", str(tmp_path / "ref"))
    out = train(*common, "--dp", "2", "--dp-shard", "none", "--loss-file", str(tmp_path / "got"))
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "got")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4] and ref[4] != ref[1]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=0), (step, got[step], ref[step])
    evals = lambda text: re.findall(r"eval after step +(\d+)/4 +validation loss +(\S+)", text)  # noqa: E731
    assert evals(out) == evals(ref_out) and [s for s, _ in evals(ref_out)] == ["1", "2", "3", "4"]
