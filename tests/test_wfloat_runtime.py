"""The floating-W order policies (hints ``wfloat``, ``ahead``) in the real runtime: a
LocalPipeline step equals the unpipelined model's outputs, loss and gradients, with message
delays that reorder arrivals, and under a byte budget (the ledger's sizes measured by the
runtime, unknown before the first forward of each stage). 1 KiB is below one microbatch's
activations on every rank (about 3 KB on rank 0), so the budget refuses every forward while
anything is held: pending W run first and each rank holds no more than its order, 1F1B's
``p - r`` microbatches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from reference import sequential_reference
from rrfp.runtime.doors.local import LocalPipeline

RTOL, ATOL = 1e-5, 1e-6


def _model(n_stages: int, d: int = 8, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)) for _ in range(n_stages)]


@pytest.mark.parametrize("budget", [None, "1KiB"])
@pytest.mark.parametrize("hint", ["wfloat", "ahead"])
def test_step_equals_the_unpipelined_model(hint, budget):
    modules = _model(3, seed=7)
    x, y = torch.randn(12, 5, 8), torch.randn(12, 5, 8)
    ref_out, ref_loss, ref_grads = sequential_reference(modules, x, y)
    with LocalPipeline(modules, 6, F.mse_loss, hint=hint, delay=(0.0, 0.002), seed=3, memory_budget=budget) as pipe:
        out = pipe.step(x, target=y, return_outputs=True)
        if budget is not None:  # the ledger counted the bytes (0 without a budget)
            assert all(st.peak_bytes > 0 for st in pipe.last_stats)
            assert [st.peak_inflight for st in pipe.last_stats] == [3, 2, 1]
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss, rtol=RTOL, atol=ATOL)
    for m, gs in zip(modules, ref_grads):
        for p, g in zip(m.parameters(), gs):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(60)
def test_a_limit_wfloat_could_deadlock_under_is_refused_before_the_first_step():
    # 4 stages, 1F1B's order holds [4, 3, 2, 1] in flight: at 2 per rank the pipeline hung
    # on main (the watchdog, shortened here, fired in the first step).
    with pytest.raises(ValueError, match="hint 'wfloat': in-flight limit 2 on rank 0 is below its order's own 4"):
        LocalPipeline(_model(4), 8, F.mse_loss, hint="wfloat", inflight_limit=2, watchdog=5)
