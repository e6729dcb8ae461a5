"""The split backward's routed layers (rrfp.runtime.engine.split): every routed layer computes
its own forward's op, so its output is bit for bit the layer's own (dtype included, under
autocast too); W leaves plain gradients and frees what it deferred; a split-backward
pipeline's losses and gradients equal a full-backward pipeline's exactly. References: the
layers' own forwards and backwards (nn.Linear, HF Conv1D, the TP layers' affine), the same
pipeline run with a full backward, and the single-process model."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.model.tp import ColumnParallelLinear, RowParallelLinear
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.runtime.engine import split
from rrfp.runtime.engine.split import WeightGradStore, deferring, disable_split_backward, enable_split_backward

from test_runtime_hints import _batch, _check

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)


def _conv1d(n_out: int, n_in: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    conv = transformers.pytorch_utils.Conv1D(n_out, n_in)
    nn.init.normal_(conv.bias)  # HF initialises it to 0, which would hide a wrong bias add
    return conv


LAYERS = {
    "linear": lambda: nn.Linear(24, 40),
    "linear-no-bias": lambda: nn.Linear(24, 40, bias=False),
    "conv1d": lambda: _conv1d(40, 24),
}
AUTOCAST = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}


@pytest.mark.parametrize("cast", AUTOCAST)
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("kind", LAYERS)
def test_routed_forward_equals_the_layers_own_forward_bit_for_bit(kind, shape, cast):
    """Under bf16 autocast a biased layer's own forward returns bf16 (autocast casts the bias
    into the fused op); a matmul then a float32 bias add returned float32 (main before this
    change) and so changed every later op's precision."""
    torch.manual_seed(0)
    own = LAYERS[kind]()
    routed = copy.deepcopy(own)
    assert enable_split_backward(routed) == 1
    x = torch.randn(*shape, requires_grad=True)
    with AUTOCAST[cast]():
        want, got = own(x), routed(x)
    assert got.dtype == want.dtype and torch.equal(got, want), (got.dtype, want.dtype)
    assert type(got.grad_fn).__name__ == "_DeferredAffineBackward"


@pytest.mark.parametrize("cls,bias", [(ColumnParallelLinear, True), (RowParallelLinear, False)])
def test_routed_tp_affine_equals_its_own_affine_bit_for_bit(cls, bias):
    torch.manual_seed(1)
    own = cls(torch.randn(12, 20), torch.randn(12) if bias else None, group=None)
    routed = copy.deepcopy(own)
    assert enable_split_backward(routed) == 1
    x = torch.randn(2, 6, 20)
    assert torch.equal(routed.affine(x), own.affine(x))


def test_the_public_apply_computes_what_the_fast_one_does(monkeypatch):
    """The C-level apply (no Function.apply wrapper) is this torch's path; without it (a
    torch that lacks ``_FunctionBase.apply``, or inside a functorch transform) the public
    apply runs: same output, same deferred weight gradients."""
    assert split._apply_fast is not None
    torch.manual_seed(2)
    x, g = torch.randn(4, 9, 16), torch.randn(4, 9, 8)
    runs = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(split, "_apply_fast", None)
        lay = nn.Linear(16, 8)
        torch.manual_seed(5)
        nn.init.normal_(lay.weight), nn.init.normal_(lay.bias)
        enable_split_backward(lay)
        xi = x.clone().requires_grad_()
        y = lay(xi)
        store = WeightGradStore()
        with deferring(store, lay):
            y.backward(g)
        assert lay.weight.grad is None and len(store) == 1
        store.flush()
        runs.append((y, xi.grad, lay.weight.grad, lay.bias.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_functorch_transform_takes_the_public_path():
    """torch.func.grad over a routed layer raises torch's own error for a Function without
    setup_context (what the public apply says), not whatever its C base would do."""
    lay = nn.Linear(4, 3)
    enable_split_backward(lay)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: lay(x).sum())(torch.randn(2, 4))
    disable_split_backward(lay)
    assert torch.func.grad(lambda x: lay(x).sum())(torch.randn(2, 4)).shape == (2, 4)


def test_w_leaves_plain_gradients_and_frees_the_deferred_tensors():
    """A layer past a stage's first op gets an input that requires grad: W's ``dY^T X`` must
    not record a history (with one, ``weight.grad`` held every deferred ``dY`` and its graph
    until the gradients were zeroed: main before this change). The gradients equal the
    layers' own backward's bit for bit."""
    torch.manual_seed(4)
    own = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    routed = copy.deepcopy(own)
    enable_split_backward(routed)
    x, g = torch.randn(5, 6), torch.randn(5, 3)
    own(x.clone().requires_grad_()).backward(g)
    out = routed(x.clone().requires_grad_())
    store = WeightGradStore()
    with deferring(store, routed):
        out.backward(g)
    assert len(store.items) == 2 and routed[2].weight.grad is None
    dys = [weakref.ref(item[3]) for item in store.items if item[3] is not g]  # g: the test holds it
    assert len(dys) == 1
    store.flush()
    del out
    gc.collect()
    assert dys[0]() is None
    for (n, p), q in zip(routed.named_parameters(), own.parameters()):
        assert p.grad.grad_fn is None and not p.grad.requires_grad, n
        assert torch.equal(p.grad, q.grad), n


def _pipeline_step(hint: str, cast: str):
    model = GPT(CFG, seed=4)
    samples, mbs = _batch(4, 1)
    stages = split_gpt(model, 2)
    with LocalPipeline(stages, 4, lm_loss, hint=hint, loss_weight_fn=count_tokens) as pipe:
        with AUTOCAST[cast]():
            loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    return loss, {f"{i}.{n}": p.grad for i, s in enumerate(stages) for n, p in s.named_parameters()}, \
        (model, samples, stages)


@pytest.mark.slow
@pytest.mark.parametrize("cast", AUTOCAST)
def test_split_backward_pipeline_equals_the_full_backwards_bit_for_bit(cast):
    """strict-split and strict-1f1b run the same forwards in the same order, so with the routed
    forward computing the layers' own op the losses are the same bits; so are the gradients:
    I's ``dY W`` and W's ``dY^T X`` are the mm calls autograd's own addmm backward makes for
    ``x @ W^T`` (torch's mm_mat1_backward / mm_mat2_backward, a column-major W^T), in the
    same accumulation order. Under bf16 autocast a matmul then a float32 bias add (main
    before) left the layers' outputs float32: 16 of 53 gradients differed (up to 7.6e-4).
    In float32 both also match the single-process model."""
    full = _pipeline_step("strict-1f1b", cast)
    spl = _pipeline_step("strict-split", cast)
    assert torch.equal(spl[0], full[0]), (spl[0], full[0])
    assert spl[1].keys() == full[1].keys()
    differ = [n for n, g in full[1].items() if not torch.equal(spl[1][n], g)]
    assert not differ, differ
    assert not [n for n, g in spl[1].items() if g.requires_grad]
    if cast == "fp32":
        model, samples, stages = spl[2]
        _check(model, samples, stages, spl[0])
