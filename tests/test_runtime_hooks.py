"""Step hooks (rrfp.runtime.engine.hooks): when they fire, that their awaitables finish before the step
ends, and that they see final gradients: in-process, fake transport, fixed per-rank orders."""

from __future__ import annotations

import asyncio

import pytest

from rrfp.data.batches import Microbatch, pad_batch
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.runtime.engine.hooks import StepHooks
from rrfp.runtime.doors.local import LocalPipeline

from reference import assert_stage_grads, gpt_reference
CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)
TEXT = b"def g(a, b):\n    return {a: b for _ in range(2)}\n" * 4

# 2 ranks x 2 virtual stages (loop placement: rank 0 holds stages 0 and 2, rank 1 stages 1
# and 3), 2 microbatches, split backward. Stage 2's last W (2W1) and stage 3's (3W1) come in
# the middle of their rank's order, after other stages' I tasks.
ORDER = ("strict-order:0F0 0F1 2F0 2F1 2I0 2I1 2W0 0I0 2W1 0I1 0W0 0W1"
         " | 1F0 1F1 3F0 3F1 3I0 3W0 3I1 1I0 3W1 1I1 1W0 1W1")
# Hand-computed from ORDER: each stage's hook right after that stage's last W, every hook's
# awaitable done ("R<s>") before on_step_end ("end"), and on_step_end's awaitable ("end done")
# before the step returns.
EXPECTED = {
    0: ["0F0", "0F1", "2F0", "2F1", "2I0", "2I1", "2W0", "0I0", "2W1", "G2", "0I1", "0W0", "0W1", "G0"],
    1: ["1F0", "1F1", "3F0", "3F1", "3I0", "3W0", "3I1", "1I0", "3W1", "G3", "1I1", "1W0", "1W1", "G1"],
}


def _batch(M: int) -> tuple[list[bytes], list[Microbatch]]:
    samples = [TEXT[m: m + 6 + 5 * m] for m in range(M)]  # a different length per microbatch
    return samples, [Microbatch(*pad_batch([s])) for s in samples]


class Recorder(StepHooks):
    """Logs tasks (through task_delay) and hooks; each stage hook returns a coroutine that
    doubles the stage's gradients after yielding to the loop a few times (as a DP all-reduce
    polled from the loop would)."""

    def __init__(self, rank: int, stages: dict, log: list) -> None:
        self.rank, self.stages, self.log = rank, stages, log

    def on_stage_grads_final(self, stage_index: int):
        self.log.append(f"G{stage_index}")

        async def reduce() -> None:
            for _ in range(3):
                await asyncio.sleep(0)
            for p in self.stages[stage_index].submod.parameters():
                p.grad.mul_(2)
            self.log.append(f"R{stage_index}")

        return reduce()

    def on_step_end(self):
        self.log.append("end")

        async def done() -> None:
            await asyncio.sleep(0)
            self.log.append("end done")

        return done()


def test_stage_hooks_fire_after_the_stage_last_w_and_their_awaitables_end_the_step():
    model = GPT(CFG, seed=5)
    samples, mbs = _batch(2)
    _, ref = gpt_reference(model, samples)
    stages = split_gpt(model, 4)
    logs = {0: [], 1: []}
    with LocalPipeline(stages, 2, lm_loss, hint=ORDER, n_virtual=2, loss_weight_fn=count_tokens,
                       delay=(0.0, 0.002)) as pipe:
        assert pipe.spec.split_backward
        for r, rt in enumerate(pipe.runtimes):
            rt.add_step_hooks(Recorder(r, rt.stages, logs[r]))
            rt.loop.task_delay = lambda step, rank, task: logs[rank].append(str(task)) or 0.0
        pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    for r in (0, 1):
        log = logs[r]
        assert [e for e in log if not e.startswith("R") and not e.startswith("end")] == EXPECTED[r]
        stage_ids = [int(e[1:]) for e in EXPECTED[r] if e.startswith("G")]
        # every awaitable done before on_step_end, which is last, its awaitable after it
        assert log[-2:] == ["end", "end done"]
        assert sorted(e for e in log if e.startswith("R")) == sorted(f"R{s}" for s in stage_ids)
        assert all(log.index(f"R{s}") > log.index(f"G{s}") for s in stage_ids)
    # The hooks saw final gradients: doubling them then gives twice the reference exactly.
    assert_stage_grads(stages, ref, scale=2.0)


def test_hooks_with_a_full_backward_fire_after_the_last_b():
    """Without split backward the last B is final (hand-computed from a fixed order)."""
    model = GPT(CFG, seed=5)
    _, mbs = _batch(2)
    order = "strict-order:0F0 0F1 0B0 0B1 | 1F0 1B0 1F1 1B1"
    logs = {0: [], 1: []}
    with LocalPipeline(split_gpt(model, 2), 2, lm_loss, hint=order, loss_weight_fn=count_tokens) as pipe:
        for r, rt in enumerate(pipe.runtimes):
            rt.add_step_hooks(Recorder(r, rt.stages, logs[r]))
            rt.loop.task_delay = lambda step, rank, task: logs[rank].append(str(task)) or 0.0
        for _ in range(2):  # hooks fire every step
            pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    one = {0: ["0F0", "0F1", "0B0", "0B1", "G0", "R0", "end", "end done"],
           1: ["1F0", "1B0", "1F1", "1B1", "G1", "R1", "end", "end done"]}
    assert logs == {r: one[r] * 2 for r in (0, 1)}


def test_a_failing_hook_awaitable_fails_the_step():
    class Boom(StepHooks):
        def on_stage_grads_final(self, stage_index):
            async def fail():
                raise RuntimeError(f"all-reduce of stage {stage_index} failed")
            return fail()

    model = GPT(CFG, seed=5)
    _, mbs = _batch(2)
    with LocalPipeline(split_gpt(model, 2), 2, lm_loss, loss_weight_fn=count_tokens) as pipe:
        pipe.runtimes[1].add_step_hooks(Boom())
        with pytest.raises(RuntimeError, match="all-reduce of stage 1 failed"):
            pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
