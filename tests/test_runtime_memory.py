"""The memory budget in the runtime: measured activation bytes per forward (rrfp issue 13)."""

from __future__ import annotations


import pytest
import torch

from rrfp.data.batches import make_microbatches
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.runtime.engine.memory import ForwardSizer, WeightBytes
from rrfp.runtime.doors.local import LocalPipeline

from reference import ATOL, RTOL, assert_stage_grads, gpt_reference
CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)


def _samples(n: int) -> list[bytes]:
    text = b"def f(x):\n    return x * 2 + 1\n" * 8
    return [text[i : i + 5 + 4 * i] for i in range(n)]


@pytest.mark.parametrize("hint", ["bf", pytest.param("bfw-df", marks=pytest.mark.slow), "bfw-alt-df"])
def test_one_byte_budget_holds_one_microbatch_and_keeps_gradients(hint):
    # A budget below any microbatch's size admits a microbatch only when none is held: every
    # rank then runs one microbatch at a time, and the gradients stay the reference's.
    model = GPT(CFG, seed=1)
    samples = _samples(8)
    ref_loss, ref_grads = gpt_reference(model, samples)
    stages = split_gpt(model, 4)
    mbs = make_microbatches(samples, 4)
    with LocalPipeline(stages, 4, lm_loss, hint=hint, loss_weight_fn=count_tokens, delay=(0.0, 0.002), seed=3,
                       memory_budget=1) as pipe:
        for step in range(2):  # step 1 admits by estimates learned in step 0
            for st in stages:
                st.zero_grad(set_to_none=True)
            loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
            assert [s.peak_mb_inflight for s in pipe.last_stats] == [1, 1, 1, 1]
            assert all(s.peak_bytes > 1 for s in pipe.last_stats)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def _peaks_v2(stages, mbs, budget: int, steps: int = 1):
    with LocalPipeline(stages, 4, lm_loss, hint="bfw-alt-df", n_virtual=2, loss_weight_fn=count_tokens,
                       delay=(0.0, 0.002), seed=3, memory_budget=budget) as pipe:
        for _ in range(steps):  # a later step admits by the sizes measured in the one before
            for st in stages:
                st.zero_grad(set_to_none=True)
            loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
        return loss, [s.peak_bytes for s in pipe.last_stats]


@pytest.mark.slow
def test_banker_budget_with_virtual_stages_keeps_gradients_and_bytes():
    # 2 ranks x 2 virtual stages under bfw-alt-df: every forward asks the banker's check
    # (rrfp.scheduler.memory). Probes: a budget that admits everything gives each rank's peak
    # unconstrained; a 1-byte budget runs one microbatch at a time, so its peak is the largest
    # single microbatch's bytes on the rank. With a budget between the two on rank 0, step 1
    # (sizes measured in step 0) keeps each rank within max(budget, largest microbatch), and
    # the gradients stay the reference's.
    model = GPT(CFG, seed=1)
    samples = _samples(8)
    ref_loss, ref_grads = gpt_reference(model, samples)
    stages = split_gpt(model, 4)
    mbs = make_microbatches(samples, 4)
    _, free = _peaks_v2(stages, mbs, 2**40)
    _, single = _peaks_v2(stages, mbs, 1, steps=2)
    budget = (single[0] + free[0]) // 2  # binds on rank 0: above its largest microbatch, below its peak
    assert single[0] < budget < free[0]
    loss, peaks = _peaks_v2(stages, mbs, budget, steps=2)
    assert all(p <= max(budget, s) for p, s in zip(peaks, single)), (peaks, budget, single)
    assert peaks[0] <= budget < free[0]
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def test_sizer_measures_saved_activations_and_scales_by_input():
    lin = torch.nn.Linear(16, 16)
    sizer = ForwardSizer({0: lin}, 0)
    act = {(0, 0): (torch.randn(4, 16),), (0, 1): (torch.randn(8, 16),)}
    sizer.begin_step(act)
    assert sizer(0, 0) is None  # nothing measured yet
    x = act[(0, 0)][0].requires_grad_(True)
    with sizer.measure(0, 0, act[(0, 0)]):
        y = torch.relu(lin(x))
    # Saved: the input x (linear's backward) and relu's output; the weight is a parameter.
    assert sizer(0, 0) == x.numel() * 4 + y.numel() * 4
    assert sizer(0, 1) == 2 * sizer(0, 0)  # twice the input elements


def test_schedule_named_budget_is_refused_in_the_runtime():
    with pytest.raises(ValueError, match="the runtime takes a size in bytes"):
        LocalPipeline(split_gpt(GPT(CFG), 2), 2, lm_loss, memory_budget="1f1b")


def test_sizer_reuses_the_bytes_of_measured_shapes_and_remeasures_periodically():
    """A forward whose input shapes were measured on that stage runs without saved-tensor hooks
    (they cost a Python call per saved tensor) and takes the measured bytes; new shapes, and
    every REMEASURE_EVERY-th forward, are measured."""
    from rrfp.runtime.engine import memory

    hooked: list[bool] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            return torch.relu(self.lin(x))

    probe = Probe()
    sizer = ForwardSizer({0: probe}, 0)
    shapes = [4, 4, 8, 4] + [4] * (memory.REMEASURE_EVERY - 4)
    act = {(0, m): (torch.randn(n, 16, requires_grad=True),) for m, n in enumerate(shapes)}
    sizer.begin_step(act)
    for m in range(len(shapes)):
        with sizer.measure(0, m, act[(0, m)]):
            probe(*act[(0, m)])
    assert hooked[:4] == [True, False, True, False]
    assert hooked[4:] == [False] * (memory.REMEASURE_EVERY - 5) + [True]  # the 64th forward
    assert sizer(0, 1) == sizer(0, 0) == 4 * 16 * 4 * 2  # input and relu output, fp32
    assert sizer(0, 2) == 2 * sizer(0, 0)


def test_weight_store_bytes_hand_computed():
    """Two linear layers deferred to W: the store keeps each layer's input X and output
    gradient dY. x [5, 8], y1 [5, 16], y2 [5, 4], float32: x 160 + dY1 320 + y1 320 + dY2 80."""
    from rrfp.runtime.engine.split import WeightGradStore, deferring, disable_split_backward, enable_split_backward

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    assert enable_split_backward(model) == 2
    x = torch.randn(5, 8, requires_grad=True)
    out = model(x)
    store = WeightGradStore()
    with deferring(store, model):
        out.backward(torch.ones_like(out))
    assert len(store) == 2 and store.nbytes() == 160 + 320 + 320 + 80
    disable_split_backward(model)


def _peaks(hint: str, monkeypatch=None) -> list[int]:
    model = GPT(CFG, seed=1)
    stages = split_gpt(model, 4)
    mbs = make_microbatches(_samples(8), 4)
    with LocalPipeline(stages, 4, lm_loss, hint=hint, loss_weight_fn=count_tokens, seed=3,
                       memory_budget=2**40) as pipe:
        for _ in range(2):
            pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
        return [s.peak_bytes for s in pipe.last_stats]


@pytest.mark.slow
def test_split_ledger_frees_at_i_all_but_the_weight_store(monkeypatch):
    """Strict ZB-H1 defers W: with W's bytes measured from its store the ledger frees the rest
    at I, so every rank that defers holds less than under the conservative rule (everything
    until W, what WeightBytes answering None gives); strict-split (W right after I) holds
    exactly strict 1F1B's bytes."""
    measured = _peaks("strict-zb-h1")
    monkeypatch.setattr(WeightBytes, "__call__", lambda self, s, m: None)
    conservative = _peaks("strict-zb-h1")
    assert measured[0] == conservative[0]  # rank 0 defers no W
    assert all(a < b for a, b in zip(measured[1:], conservative[1:])), (measured, conservative)
    monkeypatch.undo()
    assert _peaks("strict-split") == _peaks("strict-1f1b")
