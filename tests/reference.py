"""The single-process reference the pipeline tests compare against: the whole model run once
on the whole batch, unpipelined (the correctness contract: loss and every gradient equal to
it, fp32 rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from rrfp.data.batches import pad_batch
from rrfp.model.gpt import lm_loss

RTOL, ATOL = 1e-5, 1e-6


def reference_run(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_of(model)`` (the whole model on the whole batch, one process) and its backward:
    the loss and the gradients by parameter name. ``model`` gets the gradients: pass a copy
    or a fresh build."""
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def gpt_reference(model: torch.nn.Module, samples: list[bytes]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (by parameter name) of a copy of ``model`` on ``samples`` padded
    into one batch; ``model`` itself is left untouched."""
    tokens, targets = pad_batch(samples)
    return reference_run(copy.deepcopy(model), lambda m: lm_loss(m(tokens), targets))


def sequential_reference(modules: Sequence[torch.nn.Module], x: torch.Tensor, y: torch.Tensor, loss_fn=F.mse_loss):
    """Copies of ``modules`` applied in order to ``x``, ``loss_fn(output, y)`` and its
    backward: ``(output, loss, per module the gradients of its parameters in order)``."""
    ref = torch.nn.Sequential(*copy.deepcopy(list(modules)))
    out = ref(x)
    loss, _ = reference_run(ref, lambda _: loss_fn(out, y))
    return out.detach(), loss, [[p.grad for p in m.parameters()] for m in ref]


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
