"""The single-process reference the pipeline tests compare against: the whole model run once
on the whole batch, unpipelined (the correctness contract: loss and every gradient equal to
it, fp32 rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import copy

import torch

from rrfp.data.batches import pad_batch
from rrfp.model.gpt import lm_loss

RTOL, ATOL = 1e-5, 1e-6


def gpt_reference(model: torch.nn.Module, samples: list[bytes]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (by parameter name) of a copy of ``model`` on ``samples`` padded
    into one batch; ``model`` itself is left untouched."""
    ref = copy.deepcopy(model)
    tokens, targets = pad_batch(samples)
    loss = lm_loss(ref(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def assert_stage_grads(stages, ref_grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    """Every parameter of every stage has a gradient equal to ``scale`` times the reference's
    (matched by ``stage_param_names``), and every reference parameter is covered."""
    seen = set()
    for st in stages:
        for name, p in st.named_parameters():
            full = st.stage_param_names[name]
            seen.add(full)
            assert p.grad is not None, f"{full} got no gradient"
            torch.testing.assert_close(p.grad, scale * ref_grads[full], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{full}: {m}")
    assert seen == set(ref_grads)
