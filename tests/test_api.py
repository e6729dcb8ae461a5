"""torch.distributed.pipelining's API on rrfp's Pipeline/LocalPipeline, each against an
independent reference: the unpipelined model in one process, torch's own splitting and names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from rrfp.runtime.doors.names import hint_text
from rrfp.runtime.doors.local import LocalPipeline
from reference import sequential_reference
from rrfp.runtime.engine.split import CONV1D, disable_split_backward, enable_split_backward, layout_of, register_split_layer

RTOL, ATOL = 1e-5, 1e-6


class Conv1D(nn.Module):
    """HuggingFace's ``transformers.pytorch_utils.Conv1D``, line for line (weight ``[in, out]``)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


Conv1D.__module__, Conv1D.__qualname__ = "transformers.pytorch_utils", "Conv1D"  # recognised by name


class Block(nn.Module):
    def __init__(self, d: int, conv: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = Conv1D(2 * d, d) if conv else nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _model(n_stages: int, d: int = 8, conv: bool = False, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Block(d, conv) for _ in range(n_stages)]


_reference = sequential_reference


def _assert_grads(modules, ref_grads):
    for m, gs in zip(modules, ref_grads):
        for p, g in zip(m.parameters(), gs):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("batch,n_mb", [(8, 3), (10, 4), (12, 4)])
@pytest.mark.parametrize("hint", ["bf", "strict-gpipe", "bfw"])
def test_uneven_splits_equal_the_unpipelined_loss_gradients_and_outputs(batch, n_mb, hint):
    modules = _model(2, seed=batch)
    x, y = torch.randn(batch, 5, 8), torch.randn(batch, 5, 8)
    ref_out, ref_loss, ref_grads = _reference(modules, x, y)
    losses = ["stale", "entries"]
    with LocalPipeline(modules, n_mb, F.mse_loss, hint=hint, delay=(0.0, 0.002), seed=batch) as pipe:
        out = pipe.step(x, target=y, losses=losses, return_outputs=True)
    # Outputs merged in microbatch order whatever order the forwards ran in.
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss, rtol=RTOL, atol=ATOL)
    _assert_grads(modules, ref_grads)
    # losses: cleared, then exactly one unweighted loss per microbatch, in microbatch order.
    assert len(losses) == n_mb
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, n_mb), torch.tensor_split(y, n_mb))):
        h = xm
        for mod in copy.deepcopy(modules):
            h = mod(h)
        torch.testing.assert_close(losses[m], F.mse_loss(h, ym).detach(), rtol=RTOL, atol=ATOL)


def test_losses_are_refilled_each_step_and_loss_kwargs_reach_the_loss():
    modules = _model(2, seed=1)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    seen = []

    def loss_fn(out, target, scale=1.0):
        seen.append(scale)
        return F.mse_loss(out, target) * scale

    losses: list = []
    with LocalPipeline(modules, 3, loss_fn) as pipe:
        pipe.step(x, target=y, losses=losses, loss_kwargs={"scale": 2.0})
        first = list(losses)
        pipe.step(x, target=y, losses=losses)
    assert len(losses) == 3 and seen == [2.0] * 3 + [1.0] * 3
    for a, b in zip(first, losses):
        torch.testing.assert_close(a, 2 * b)


def test_step_under_no_grad_raises_and_leaves_no_gradients():
    modules = _model(2, seed=2)
    with LocalPipeline(modules, 2, F.mse_loss) as pipe:
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"under torch.no_grad\(\) call eval\(\)"):
            pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
    assert all(p.grad is None for m in modules for p in m.parameters())


def test_unscaled_microbatch_losses_are_summed():
    modules = _model(2, seed=3)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    ref = copy.deepcopy(modules)
    h = x
    for m in ref:
        h = m(h)
    total = sum(F.mse_loss(hm, ym) for hm, ym in zip(torch.tensor_split(h, 4), torch.tensor_split(y, 4)))
    total.backward()
    with LocalPipeline(modules, 4, F.mse_loss, scale_grads=False) as pipe:
        pipe.step(x, target=y)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), total.detach(), rtol=RTOL, atol=ATOL)
    _assert_grads(modules, [[p.grad for p in m.parameters()] for m in ref])


@pytest.mark.parametrize("name,expected", [
    ("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved-1f1b"), ("LoopedBFS", "looped-bfs"),
    ("InterleavedZeroBubble", "zb-h1"), ("ZBVZeroBubble", "zb-v"), ("ScheduleZBVZeroBubble", "zb-v"),
    ("schedule1f1b", "1f1b"), ("strict-Interleaved1F1B", "strict-interleaved-1f1b"), ("bf", "bf"),
])
def test_pytorch_schedule_names_are_hints(name, expected):
    assert hint_text(name) == expected


def test_pytorch_schedule_classes_are_hints():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    assert [hint_text(c) for c in (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)] == [
        "1f1b", "gpipe", "interleaved-1f1b"]
    modules = _model(4, seed=4)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    _, ref_loss, ref_grads = _reference(modules, x, y)
    with LocalPipeline(modules, 4, F.mse_loss, hint="Interleaved1F1B", n_virtual=2) as pipe:
        pipe.step(x, target=y)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss, rtol=RTOL, atol=ATOL)
    _assert_grads(modules, ref_grads)


def test_conv1d_layout_is_registered_by_name_and_its_split_backward_equals_autograd():
    conv = Conv1D(6, 4)
    assert layout_of(conv) is CONV1D
    ref = copy.deepcopy(conv)
    x = torch.randn(3, 5, 4)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 5, 6)
    ref(xa).backward(g)
    from rrfp.runtime.engine.split import WeightGradStore, deferring

    assert enable_split_backward(conv) == 1
    store = WeightGradStore()
    with deferring(store):
        conv(xb).backward(g)
    assert conv.weight.grad is None and conv.bias.grad is None and len(store) == 1  # I: input gradient only
    torch.testing.assert_close(xb.grad, xa.grad)
    store.flush()  # W
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad)
    torch.testing.assert_close(conv.bias.grad, ref.bias.grad)
    assert disable_split_backward(conv) == 1 and "forward" not in conv.__dict__


@pytest.mark.parametrize("hint", ["bfw", "zb-h1"])
def test_split_backward_pipeline_with_conv1d_equals_reference_and_leaves_modules_unpatched(hint):
    modules = _model(2, conv=True, seed=5)
    x, y = torch.randn(6, 3, 8), torch.randn(6, 3, 8)
    _, ref_loss, ref_grads = _reference(modules, x, y)
    with LocalPipeline(modules, 3, F.mse_loss, hint=hint, delay=(0.0, 0.002)) as pipe:
        assert all("_rrfp_split" in m.__dict__ for mod in modules for m in (mod.up, mod.down))
        pipe.step(x, target=y)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss, rtol=RTOL, atol=ATOL)
    _assert_grads(modules, ref_grads)
    for mod in modules:
        for m in mod.modules():
            assert "_rrfp_split" not in m.__dict__ and "forward" not in m.__dict__, m


def test_a_layer_class_can_declare_its_layout():
    from rrfp.runtime.engine.split import SplitLayout

    class MyAffine(nn.Module):
        rrfp_split_layout = SplitLayout(weight="w", bias="b")

        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(3, 4)), None

        def forward(self, x):
            return x @ self.w.t()

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return x @ self.w

    assert layout_of(MyAffine()) is MyAffine.rrfp_split_layout and layout_of(Other()) is None
    register_split_layer(Other, SplitLayout(weight="w", bias="nonexistent", weight_in_out=True))
    assert layout_of(Other()).weight_in_out
    with pytest.raises(TypeError, match="expected a SplitLayout"):
        register_split_layer(Other, "w")
