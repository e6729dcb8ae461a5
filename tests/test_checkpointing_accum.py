"""Activation checkpointing per stage and gradient accumulation: gradients equal PyTorch's on
the unsplit model, and the bytes the runtime's memory budget counts equal the hand-computed
bytes a checkpointed layer keeps."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from rrfp import LocalPipeline
from rrfp.model.checkpointing import apply_activation_checkpointing
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.runtime.engine.memory import SavedBytes

CFG = GPTConfig(n_layer=6, n_head=2, d_model=64, max_len=64)
RTOL, ATOL = 1e-5, 1e-6


def _batch(seed: int, b: int = 4, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def _kept_bytes_per_layer(mode: str, b: int, t: int) -> int:
    """What one checkpointed block keeps, by hand (float32): its input [b, t, D]; selective
    adds the outputs of qkv (3D), attention (D, and its log-sum-exp [b, heads, t]), the
    attention projection (D), the MLP's two linears (4D, D)."""
    d, h = CFG.d_model, CFG.n_head
    if mode == "full":
        return 4 * b * t * d
    return 4 * (b * t * (1 + 3 + 1 + 1 + 4 + 1) * d + b * h * t)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_saved_bytes_are_what_a_checkpointed_stage_keeps(mode):
    middle = split_gpt(GPT(CFG, seed=0), 3)[1]  # 2 blocks, hidden in and out
    b, t = 3, 20
    counted = {}
    for m in ("none", mode):
        st = apply_activation_checkpointing(copy.deepcopy(middle), m)
        counter = SavedBytes({p.untyped_storage().data_ptr() for p in st.parameters()})
        x = torch.randn(b, t, CFG.d_model, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            y = st(x)
        y.sum().backward()
        counted[m] = counter.total
    assert counted[mode] == 2 * _kept_bytes_per_layer(mode, b, t)
    assert counted[mode] < counted["none"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_runtimes_budget_measures_the_kept_bytes(mode):
    """Rank 1 of a LocalPipeline under a memory budget, one microbatch in flight: its peak
    measured bytes are one microbatch's checkpointed stage."""
    stages = [apply_activation_checkpointing(s, mode) for s in split_gpt(GPT(CFG, seed=0), 3)]
    x, y = _batch(0, b=4, t=16)
    with LocalPipeline(stages, 2, lm_loss, inflight_limit=1, memory_budget="1GiB", loss_weight_fn=count_tokens,
                       hint="bf") as pipe:  # a readiness hint: the in-flight limit of 1 holds
        pipe.step(x, target=y)
        pipe.step(x, target=y)
        assert pipe.last_stats[1].peak_bytes == 2 * _kept_bytes_per_layer(mode, 2, 16)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("hint", [pytest.param("bf", marks=pytest.mark.slow), "bfw"])
def test_checkpointed_gradients_equal_the_unsplit_model(mode, hint):
    model = GPT(CFG, seed=2)
    x, y = _batch(1)
    ref = copy.deepcopy(model)
    lm_loss(ref(x), y).backward()
    _assert_pipeline_grads([apply_activation_checkpointing(s, mode) for s in split_gpt(model, 3)], x, y, ref, hint)


@pytest.mark.slow
def test_checkpointed_hugging_face_stages_equal_the_unsplit_model():
    pytest.importorskip("transformers")
    from rrfp.hf import hf_model, split_hf

    model = hf_model("llama", seed=4, max_len=32)
    x, y = _batch(3, t=16)
    ref = copy.deepcopy(model)
    lm_loss(ref(x).logits, y).backward()
    _assert_pipeline_grads([apply_activation_checkpointing(s, "selective") for s in split_hf(model, 2)], x, y, ref)


def _assert_pipeline_grads(stages, x, y, ref, hint="bf"):
    """One LocalPipeline step over ``stages``; every gradient equals ``ref``'s (already backpropagated)."""
    with LocalPipeline(stages, 2, lm_loss, hint=hint, loss_weight_fn=count_tokens) as pipe:
        pipe.step(x, target=y)
    want = dict(ref.named_parameters())
    for st in stages:
        for n, p in st.named_parameters():
            torch.testing.assert_close(p.grad, want[st.stage_param_names[n]].grad, rtol=RTOL, atol=ATOL, msg=n)


def test_unknown_mode_and_a_module_without_layers_are_refused():
    with pytest.raises(ValueError, match="activation checkpointing 'most': expected one of none, full, selective"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "most")
    with pytest.raises(ValueError, match="Linear has no layer list"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def test_accumulated_steps_equal_one_big_batch():
    """Four pipeline steps of 2 microbatches against one batch of all their samples on the
    unsplit model; samples of different lengths, so the token weights matter."""
    from rrfp.data.batches import make_microbatches, pad_batch
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage
    from rrfp.train.accum import accumulated_step
    from rrfp.transport.fake import FakeNetwork

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 30, (16,), generator=g)
    samples = [bytes(torch.randint(0, 256, (int(n),), generator=g).tolist()) for n in lengths]
    cfg = dataclasses.replace(CFG, n_layer=2)
    model = GPT(cfg, seed=6)
    ref = copy.deepcopy(model)
    tokens, targets = pad_batch(samples)
    want_loss = lm_loss(ref(tokens), targets)
    want_loss.backward()
    stage = split_gpt(model, 1)[0]
    pipe = Pipeline(PipelineStage(stage, 0, 1), 2, lm_loss, loss_weight_fn=count_tokens, rank=0, n_ranks=1,
                    transport=FakeNetwork(1).transport(0), hint="bf")  # a full backward: F and B counted below
    try:
        mbs = make_microbatches(samples, 8)
        loss, stats = accumulated_step(pipe, mbs, 2, 4, True, True)
    finally:
        pipe.close()
    assert loss == pytest.approx(want_loss.item(), rel=RTOL)
    assert stats.n_tasks == 4 * 2 * 2  # F and B of 2 microbatches, 4 times
    # auto's batch work of the optimizer step: every pipeline step's tokens, not the last one's
    assert stats.input_elems == sum(mb.tokens.numel() for mb in mbs)
    assert stats.input_elems != sum(mb.tokens.numel() for mb in mbs[-2:])
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, rtol=RTOL, atol=ATOL, msg=n)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["tiny", "hf:gpt2"])
def test_rrfp_train_grad_accum_and_checkpointing_follow_one_big_batch(tmp_path, model):
    """`--grad-accum 2 --batch-size 4` with selective checkpointing prints the loss and the
    gradient norm of the unsplit model on the 8 samples of its first optimizer step (hf:gpt2:
    its head and embedding are one weight, two copies summed by the tie each pipeline step)."""
    pytest.importorskip("tensorboard")
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rrfp.data.batches import BatchSampler, pad_batch
    from rrfp.data.text import load_samples
    from rrfp.model.gpt import GPT_PRESETS
    from rrfp.train.worker import SAMPLE_POOL

    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--model", model, "--stages", "2", "--steps", "1", "--batch-size", "4",
         "--grad-accum", "2", "--microbatches", "2", "--max-len", "64", "--activation-checkpointing", "selective",
         "--tensorboard", str(tmp_path / "tb"), "--loss-file", str(tmp_path / "loss.txt")],
        capture_output=True, text=True, timeout=840, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    samples = load_samples(None, 64, 0, limit=SAMPLE_POOL)
    tokens, targets = pad_batch(BatchSampler(samples, 8, 0).batch(0))
    if model == "tiny":
        ref = GPT(dataclasses.replace(GPT_PRESETS["tiny"], max_len=64), seed=0)
        loss = lm_loss(ref(tokens), targets)
    else:
        from rrfp.hf import hf_model

        ref = hf_model("gpt2", seed=0, max_len=64)
        loss = lm_loss(ref(tokens).logits, targets)
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]))
    got_loss = float.fromhex((tmp_path / "loss.txt").read_text().split()[1])
    assert got_loss == pytest.approx(loss.item(), rel=1e-5)
    assert acc.Scalars("train/grad_norm")[0].value == pytest.approx(norm, rel=1e-5)


class _Chain(torch.nn.Module):
    def __init__(self, tie: bool = False, skip: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.l1, self.l2, self.l3 = (torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.skip = skip

    def forward(self, x):
        h0 = self.emb(x)
        h = self.l3(torch.relu(self.l2(torch.relu(self.l1(h0)))))
        return self.head(h + h0 if self.skip else h)


def _traced(model, x):
    from torch.distributed.pipelining import SplitPoint, pipeline

    return pipeline(model, mb_args=(x[:2],), split_spec={"l2": SplitPoint.BEGINNING, "l3": SplitPoint.BEGINNING})


def test_a_model_traced_by_torchs_pipeline_runs_as_stages():
    from rrfp.model.traced import traced_stages

    torch.manual_seed(0)
    model = _Chain()
    x, y = torch.randint(0, 50, (6, 8)), torch.randint(0, 50, (6, 8))
    ref = copy.deepcopy(model)
    lm_loss(ref(x), y).backward()
    stages = traced_stages(_traced(model, x))
    with LocalPipeline(stages, 3, lm_loss, loss_weight_fn=count_tokens) as pipe:
        loss = pipe.step(x, target=y)
    assert float(loss) == pytest.approx(lm_loss(ref(x), y).item(), rel=RTOL)
    want = dict(ref.named_parameters())
    got = {n: p.grad for st in stages for n, p in st.named_parameters()}
    assert set(got) == set(want)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n].grad, rtol=RTOL, atol=ATOL, msg=n)


@pytest.mark.parametrize("tie,skip,needle", [
    (False, True, "traced stage 2 takes 'getitem_1', not an output of stage 1"),
    (True, False, "traced stages 0 and 2 both hold parameter 'head.weight'"),
])
def test_traced_models_rrfp_cannot_run_are_refused_in_one_line(tie, skip, needle):
    from rrfp.model.traced import traced_stages

    x = torch.randint(0, 50, (4, 8))
    with pytest.raises(ValueError, match=needle):
        traced_stages(_traced(_Chain(tie, skip), x))
