"""The runtime against a single-process, unpipelined reference (in-process, fake transport)."""

from __future__ import annotations

import copy

import pytest
import torch

from rrfp.data.batches import make_microbatches, pad_batch
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
from rrfp.runtime.doors.local import LocalPipeline

from reference import ATOL, RTOL, assert_stage_grads, gpt_reference
CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)


def _samples(n: int, seed: int = 0) -> list[bytes]:
    # Real text of very different lengths, like the training job's samples.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    text = (b"def f(x):\n    return x * 2 + 1\n" * 8)
    return [text[i : i + n_] for i, n_ in enumerate(lengths)]


@pytest.mark.parametrize("hint", ["bf", "strict-1f1b", "strict-gpipe"])
@pytest.mark.parametrize("n_microbatches", [1, pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_gpt_gradients_equal_single_process_reference(n_stages, n_microbatches, hint):
    model = GPT(CFG, seed=1)
    samples = _samples(8, seed=n_stages * 10 + n_microbatches)
    ref_loss, ref_grads = gpt_reference(model, samples)
    stages = split_gpt(model, n_stages)
    mbs = make_microbatches(samples, n_microbatches)
    assert len({mb.tokens.shape[1] for mb in mbs}) > 1 or n_microbatches == 1  # unequal lengths
    with LocalPipeline(
        stages, n_microbatches, lm_loss, hint=hint, loss_weight_fn=count_tokens, delay=(0.0, 0.002), seed=3
    ) as pipe:
        loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def test_losses_list_gets_each_microbatch_loss():
    model = GPT(CFG, seed=2)
    samples = _samples(6)
    mbs = make_microbatches(samples, 3)
    losses: list = []
    with LocalPipeline(split_gpt(model, 2), 3, lm_loss, loss_weight_fn=count_tokens) as pipe:
        total = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs], losses=losses)
    expect = [lm_loss(model(mb.tokens), mb.targets) for mb in mbs]
    assert len(losses) == 3
    for got, want in zip(losses, expect):
        torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
    counts = [count_tokens(mb.targets) for mb in mbs]
    want_total = sum(c * l for c, l in zip(counts, expect)) / sum(counts)
    torch.testing.assert_close(total, want_total.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("hint", ["bf", "strict-1f1b"])
def test_mixed_dtype_tuple_io_passes_unchanged(hint):
    cfg = ToyConfig(d=8, n_layer=4)
    model = ToyModel(cfg, seed=0)
    (x, ids, mask, scale), target = toy_batch(cfg, 8, seed=1)
    ref = copy.deepcopy(model)
    ref_loss = toy_loss(ref((x, ids, mask, scale)), target)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    stages = split_toy(model, 4)
    with LocalPipeline(stages, 4, toy_loss, hint=hint, delay=(0.0, 0.001), seed=5) as pipe:
        loss = pipe.step(x, ids, mask, scale, target=target)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def test_two_steps_accumulate_like_reference():
    # Gradients accumulate across steps exactly as in single-process training.
    model = GPT(CFG, seed=4)
    a, b = _samples(4, 1), _samples(4, 2)
    ref = copy.deepcopy(model)
    for s in (a, b):
        t, y = pad_batch(s)
        lm_loss(ref(t), y).backward()
    stages = split_gpt(model, 2)
    with LocalPipeline(stages, 2, lm_loss, loss_weight_fn=count_tokens, delay=(0, 0.001)) as pipe:
        for s in (a, b):
            mbs = make_microbatches(s, 2)
            pipe.step(microbatches=[(m.tokens,) for m in mbs], targets=[m.targets for m in mbs])
    assert_stage_grads(stages, {n: p.grad for n, p in ref.named_parameters()})


def test_too_many_microbatches_is_a_clear_error():
    model = GPT(CFG, seed=0)
    with LocalPipeline(split_gpt(model, 2), 8, lm_loss) as pipe:
        with pytest.raises(ValueError, match="n_microbatches=8 exceeds the input batch size 4"):
            pipe.step(torch.zeros(4, 5, dtype=torch.long), target=torch.zeros(4, 5, dtype=torch.long))


def test_unknown_hint_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown hint 'nope'") as err:
        LocalPipeline(split_gpt(GPT(CFG), 2), 2, lm_loss, hint="nope")
    # auto, the front doors' default, is among the names the line offers (the scheduler's list lacks it).
    assert str(err.value).endswith(", or auto (the default)") and "\n" not in str(err.value)


def test_forged_messages_are_rejected_and_the_step_still_matches():
    from rrfp.transport.base import Message
    from rrfp.transport.keys import Direction, MsgKey

    model = GPT(CFG, seed=6)
    samples = _samples(4, 3)
    ref_loss, ref_grads = gpt_reference(model, samples)
    stages = split_gpt(model, 2)
    mbs = make_microbatches(samples, 2)
    with LocalPipeline(stages, 2, lm_loss, loss_weight_fn=count_tokens, delay=(0.0, 0.002)) as pipe:
        rt1, job = pipe.runtimes[1], pipe.runtimes[1].job
        junk = [torch.zeros(1, 3, CFG.d_model)]
        forged = [
            MsgKey("other-job", 0, 0, 1, Direction.ACT),  # wrong job
            MsgKey(job, 5, 0, 1, Direction.ACT),  # a step no peer can be in yet
        ]
        for key in forged:
            rt1.inbox.on_message(Message(0, key, junk, {}))
        assert rt1.inbox.rejected == 2
        loss = pipe.step(microbatches=[(m.tokens,) for m in mbs], targets=[m.targets for m in mbs])
        rt1.inbox.step = 1  # as during step 1: routing errors are refused, not fatal
        rt1.inbox.arb = __import__("rrfp.scheduler.arbiter", fromlist=["Arbiter"]).Arbiter(
            pipe.spec, 1, pipe.hint, inflight_limit=32)
        for key in [
            MsgKey(job, 1, 7, 1, Direction.ACT),  # microbatch out of range
            MsgKey(job, 1, 0, 0, Direction.ACT),  # a stage rank 1 does not hold
            MsgKey(job, 1, 0, 1, Direction.GRAD),  # a gradient for the last stage
            MsgKey(job, 0, 0, 1, Direction.ACT),  # a stale step
        ]:
            rt1.inbox.on_message(Message(0, key, junk, {}))
        rt1.inbox.on_message(Message(0, MsgKey(job, 1, 0, 1, Direction.ACT), junk, {}))
        rt1.inbox.on_message(Message(0, MsgKey(job, 1, 0, 1, Direction.ACT), junk, {}))  # duplicate
        assert rt1.inbox.rejected == 2 + 5
        rt1.inbox.step = None
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def _toy_pipe(delay, watchdog: float, n_microbatches: int = 4, inflight_limit: int = 32,
              loop=None) -> tuple[LocalPipeline, list, tuple, torch.Tensor]:
    """A 2-rank toy pipeline; with ``loop`` (a VirtualTimeLoop) its ranks run on simulated time."""
    import contextlib
    from unittest import mock

    torch.manual_seed(0)
    cfg = ToyConfig()
    mods = split_toy(ToyModel(cfg), 2)
    x, y = toy_batch(cfg, 8, seed=1)
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", lambda: loop) if loop is not None else contextlib.nullcontext():
        pipe = LocalPipeline(mods, n_microbatches, toy_loss, delay=delay, watchdog=watchdog,
                             inflight_limit=inflight_limit, hint="bf")  # the timelines below are bf's
    return pipe, mods, x, y


def _held(extra: float, stage: int = 1, microbatch: int = 0, base: float = 0.1):
    """Every message takes ``base`` s; the activation of ``microbatch`` for ``stage`` takes
    ``extra`` s more. Not for ever: the closing BYE queues behind it, as on a FIFO link."""
    from rrfp.transport.keys import Direction

    def delay(src, dst, key, rng):
        held = key is not None and key.stage == stage and key.microbatch == microbatch and key.direction == Direction.ACT
        return base + (extra if held else 0.0)

    return delay


def test_watchdog_names_the_missing_message():
    """A message that does not come within the watchdog period fails the step with a
    WatchdogTimeout that names what the waiting rank waits for, instead of hanging. Simulated
    time, every message 0.1 s: rank 1 runs microbatches 1-3 at 0.1 s, then gives up one period
    later (the held activation is due at 10.1 s, which closing the pipeline waits for)."""
    from rrfp.errors import WatchdogTimeout

    from virtual_time import VirtualTimeLoop

    loop = VirtualTimeLoop()
    pipe, _, x, y = _toy_pipe(_held(10.0), watchdog=0.5, loop=loop)
    with pipe:
        t0 = loop.now
        with pytest.raises(WatchdogTimeout, match=r"rank 1 .*no progress for 0.5 s.*activation for .*stage 0"):
            pipe.step(*x, target=y)
        assert loop.now - t0 == pytest.approx(0.1 + 0.5)


def _round_trips(loop, extra: float, microbatch: int = 4):
    """Simulated time: 2 ranks, in-flight limit 1, 8 microbatches, every message 0.1 s and
    compute free, so rank 1 (the last stage) makes progress at 0.1 + 0.2 k s (F and B of
    microbatch k) and the step lasts 1.6 s; the activation of ``microbatch`` comes ``extra``
    s late, so rank 1 goes 0.2 + ``extra`` s without progress once."""
    pipe, mods, x, y = _toy_pipe(_held(extra, microbatch=microbatch), watchdog=0.5, n_microbatches=8,
                                 inflight_limit=1, loop=loop)
    return pipe, mods, x, y


@pytest.mark.parametrize("extra", [0.0, 0.25], ids=["gaps-0.2s", "one-gap-0.45s"])
def test_watchdog_counts_from_the_last_progress_not_the_step_start(extra):
    """A step longer than the watchdog period (1.6 s and more, simulated), whose every wait
    is shorter than it (0.45 s at most), completes: the watchdog re-arms on progress. The
    gradients still match a run without delays."""
    from virtual_time import VirtualTimeLoop

    loop = VirtualTimeLoop()
    pipe, mods, x, y = _round_trips(loop, extra)
    with pipe:
        t0 = loop.now
        pipe.step(*x, target=y)
        assert loop.now - t0 >= 1.6 + extra > 3 * 0.5, "the step must outlast the watchdog period"
    ref, ref_mods, x2, y2 = _toy_pipe((0.0, 0.0), watchdog=60, n_microbatches=8)  # the reference: no watchdog in play
    with ref:
        ref.step(*x2, target=y2)
    for a, b in zip(mods, ref_mods):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_watchdog_fires_one_period_after_the_last_progress():
    """The same step with one gap of 0.55 s (> 0.5 s) after rank 1's progress at 0.7 s (F and
    B of microbatch 3): rank 1 gives up at 0.7 + 0.5 s, waiting for microbatch 4's activation,
    not at 0.5 s (the step's start) nor when the late activation comes (1.25 s)."""
    from rrfp.errors import WatchdogTimeout

    from virtual_time import VirtualTimeLoop

    loop = VirtualTimeLoop()
    pipe, _, x, y = _round_trips(loop, 0.35)
    with pipe:
        t0 = loop.now
        with pytest.raises(WatchdogTimeout, match=r"rank 1 .*no progress for 0.5 s in step 0: waiting for "
                                                  r"activation for 1F4 from stage 0"):
            pipe.step(*x, target=y)
        assert loop.now - t0 == pytest.approx(0.7 + 0.5)


def _forge_sends(pipe: LocalPipeline, rank: int, direction, change) -> None:
    """Rewrite the payload of every ``direction`` message that ``rank`` sends."""
    t = pipe.transports[rank]
    send = t.send

    def forged(dst, key, tensors, meta=None):
        if key.direction == direction:
            tensors = [None if x is None else change(x) for x in tensors]
        return send(dst, key, tensors, meta)

    t.send = forged


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda g: torch.zeros(g.shape[0] + 1, *g.shape[1:]), r"shape \(3, 8\) for an output of shape \(2, 8\)"),
        (lambda g: g.to(torch.complex64), "dtype torch.complex64 for an output of dtype torch.float32"),
        (lambda g: g.to(torch.int64), "dtype torch.int64 for an output of dtype torch.float32"),
        (lambda g: g.double(), "dtype torch.float64 for an output of dtype torch.float32"),
    ],
    ids=["shape", "complex", "int64", "float64"],
)
def test_a_forged_gradient_fails_the_step_naming_rank_stage_and_microbatch(change, what):
    """A correct pipeline sends each output's gradient in that output's shape and dtype:
    anything else is a clear PipelineError, not a torch error from inside the engine nor a
    silent cast."""
    from rrfp.errors import PipelineError
    from rrfp.transport.keys import Direction

    pipe, _, x, y = _toy_pipe((0.0, 0.0), watchdog=10)
    _forge_sends(pipe, 1, Direction.GRAD, change)
    with pipe:
        with pytest.raises(PipelineError, match=r"rank 0 stage 0 microbatch \d+: gradient of " + what):
            pipe.step(*x, target=y)


def test_closing_a_rank_during_its_step_fails_that_step_at_once():
    """close() while run_step waits: the step raises instead of waiting for the watchdog
    (nothing is received after close), and so does any later step."""
    import asyncio

    from rrfp.runtime.doors.compat import split_microbatches
    from rrfp.errors import PipelineError

    from virtual_time import VirtualTimeLoop

    # Simulated time: the 5 s bounds below expire only if the rank really waits (for nothing).
    pipe, _, _, y = _toy_pipe((0.0, 0.0), watchdog=60, loop=VirtualTimeLoop())
    tgs = [t[0] for t in split_microbatches([y], 4, "target")]
    rt1 = pipe.runtimes[1]

    async def main():
        # Rank 1 alone: it waits for activations that never come.
        step = asyncio.ensure_future(rt1.run_step(0, None, tgs))
        await asyncio.sleep(0)
        await rt1.close()
        with pytest.raises(PipelineError, match="rank 1: closed"):
            await asyncio.wait_for(step, 5)
        with pytest.raises(PipelineError, match="rank 1: closed"):
            await asyncio.wait_for(rt1.run_step(1, None, tgs), 5)

    with pipe:
        pipe._loop.run_until_complete(main())


def test_an_error_in_the_delivery_callback_fails_the_step_with_that_error():
    """Arrivals are handled inside the transport's delivery callback: an exception there
    (here the stage's to_device) must reach the step, not vanish in the callback."""
    pipe, _, x, y = _toy_pipe((0.0, 0.0), watchdog=60)
    stage = pipe.runtimes[1].stages[1]
    calls = []

    def to_device(tensors):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device copy failed")
        return tuple(tensors)

    stage.to_device = to_device
    with pipe:
        with pytest.raises(RuntimeError, match="device copy failed"):
            pipe.step(*x, target=y)


@pytest.mark.parametrize("delay", [(0.0, 0.0), (0.0, 0.002)], ids=["fifo", "delayed"])
def test_a_rank_killed_mid_step_fails_the_others_naming_it(delay):
    """Every surviving rank raises PeerLost naming the killed rank, without waiting for
    the watchdog (the loss reaches the runtime through the transport's on_error callback)."""
    import asyncio

    from rrfp.runtime.doors.compat import split_microbatches
    from rrfp.transport.base import PeerLost

    from unittest import mock

    from virtual_time import VirtualTimeLoop

    torch.manual_seed(0)
    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)
    # Simulated time: the 10 s bound below expires only if the ranks really wait (for the
    # watchdog, 60 s), however loaded the machine is.
    with mock.patch("rrfp.runtime.doors.local.new_event_loop", VirtualTimeLoop):
        pipe = LocalPipeline(split_toy(ToyModel(cfg), 3), 4, toy_loss, delay=delay, watchdog=60)

    def kill_after_rank0_f1(step, rank, task):  # mid-step, at a point fixed by the schedule
        if rank == 0 and task.stage == 0 and task.mb == 1:
            pipe.net.kill(1)
        return 0.0

    for rt in pipe.runtimes:
        rt.loop.task_delay = kill_after_rank0_f1
    mbs = split_microbatches(x, 4)
    tgs = [t[0] for t in split_microbatches([y], 4, "target")]

    async def main():
        steps = [rt.run_step(0, mbs if r == 0 else None, tgs if r == 2 else None)
                 for r, rt in enumerate(pipe.runtimes)]
        return await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), 10)

    res = pipe._loop.run_until_complete(main())
    with pytest.raises(PeerLost):  # closing reports the lost peer too
        pipe.close()
    for r in (0, 2):
        assert isinstance(res[r], PeerLost) and res[r].rank == 1, res


def test_a_flood_of_next_step_messages_is_bounded_and_the_step_still_matches():
    """Messages for the next step are kept until it starts, but no more of them than a step
    has inputs on the rank (one activation and one gradient per stage and microbatch): the rest
    are refused, so a hostile peer cannot grow a rank's memory. The step still matches."""
    from rrfp.transport.base import Message
    from rrfp.transport.keys import Direction, MsgKey

    model = GPT(CFG, seed=6)
    samples = _samples(4, 3)
    ref_loss, ref_grads = gpt_reference(model, samples)
    stages = split_gpt(model, 2)
    mbs = make_microbatches(samples, 2)
    with LocalPipeline(stages, 2, lm_loss, loss_weight_fn=count_tokens) as pipe:
        loss = pipe.step(microbatches=[(m.tokens,) for m in mbs], targets=[m.targets for m in mbs])
        rt1, job = pipe.runtimes[1], pipe.runtimes[1].job
        junk = [torch.zeros(1, 3, CFG.d_model)]
        for k in range(2 * 1 * 2 + 7):  # rank 1 holds 1 stage; 2 microbatches
            rt1.inbox.on_message(Message(0, MsgKey(job, 2, k % 2, 1, Direction.ACT), junk, {}))
        assert len(rt1.inbox.pending[2]) == 4
        assert rt1.inbox.rejected == 7
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)
