"""``PipelineStage(dw_builder=)`` with PyTorch's meaning: the module's own backward leaves out
its weight gradients, ``dw_builder()`` (called right after each microbatch's backward) returns
the callable that computes them, and rrfp runs it at that microbatch's W (or at once after a
full backward). Checked against the unsplit model's gradients, under a forced order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rrfp.runtime.doors.local import LocalPipeline

N_MB = 2


class _InputGradOnly(torch.autograd.Function):
    """``y = x W^T + b`` whose backward returns only ``dx`` and leaves ``(x, dy)`` in the
    layer's stash for its weight-gradient runner."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return x.matmul(weight.t()) + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.layer.stash.append((x, dy))
        ctx.layer.log.append(("I", len(ctx.layer.log)))
        return dy.matmul(weight), None, None, None


class StashLinear(nn.Linear):
    def __init__(self, d_in: int, d_out: int, log: list) -> None:
        super().__init__(d_in, d_out)
        self.stash: list = []
        self.log = log

    def forward(self, x):
        return _InputGradOnly.apply(x, self.weight, self.bias, self)

    def dw_builder(self):
        """What the stage's dw_builder returns: the runner for the stash so far (one microbatch)."""
        items, self.stash = self.stash, []

        def run() -> None:
            self.log.append(("W", len(self.log)))
            for x, dy in items:
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
                for p, g in ((self.weight, dy2.t() @ x2), (self.bias, dy2.sum(0))):
                    p.grad = g if p.grad is None else p.grad + g

        return run


def _models(log):
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    a, b = StashLinear(6, 8, log[0]), StashLinear(8, 3, log[1])
    a.load_state_dict(ref[0].state_dict())
    b.load_state_dict(ref[2].state_dict())
    return ref, [nn.Sequential(a, nn.Tanh()), nn.Sequential(b)], [a, b]


@pytest.mark.parametrize("hint", [
    # Rank 0 runs both microbatches' backwards before either W: the weight gradients must wait.
    "strict-order:rank0: 0F0 0F1 0I0 0I1 0W0 0W1 | rank1: 1F0 1I0 1F1 1I1 1W0 1W1",
    "bfw",
    "bf",  # full backward: the runner runs right after each backward
])
def test_dw_builder_runs_the_weight_gradients_at_w_and_matches_the_unsplit_model(hint):
    log = [[], []]
    ref, mods, layers = _models(log)
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.randn(8, 3)
    loss_fn = nn.MSELoss()
    loss_fn(ref(x), y).backward()
    with LocalPipeline(mods, N_MB, loss_fn, hint=hint, delay=(0.0, 0.001),
                       dw_builders=[layers[0].dw_builder, layers[1].dw_builder]) as pipe:
        pipe.step(x, target=y, return_outputs=False)
        assert all("_rrfp_split" not in l.__dict__ for l in layers)  # rrfp left the layers alone
    torch.testing.assert_close(torch.tensor(pipe.last_loss), loss_fn(ref(x), y).detach(), rtol=1e-6, atol=1e-7)
    for got, want in ((layers[0], ref[0]), (layers[1], ref[2])):
        torch.testing.assert_close(got.weight.grad, want.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.bias.grad, want.bias.grad, rtol=1e-5, atol=1e-6)
    kinds = [[k for k, _ in stage_log] for stage_log in log]
    assert all(sorted(k) == ["I"] * N_MB + ["W"] * N_MB for k in kinds), kinds
    if hint.startswith("strict-order"):
        assert kinds[0] == ["I", "I", "W", "W"] and kinds[1] == ["I", "I", "W", "W"]  # the forced order
    elif hint == "bf":
        assert kinds[0] == ["I", "W"] * N_MB and kinds[1] == ["I", "W"] * N_MB


def test_dw_builders_need_one_per_stage():
    with pytest.raises(ValueError, match="dw_builders: 1 given, expected one per stage"):
        LocalPipeline([nn.Linear(2, 2), nn.Linear(2, 2)], 2, nn.MSELoss(), dw_builders=[None])
