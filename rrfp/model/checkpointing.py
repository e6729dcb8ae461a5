"""Activation checkpointing per stage (``rrfp train --activation-checkpointing``), with
``torch.utils.checkpoint`` (non-reentrant):

* ``full``: each layer of the stage keeps only its inputs; its inner activations are
  recomputed in the backward;
* ``selective``: each layer also keeps the outputs of its matmuls and attention (torch's
  selective checkpointing, ``create_selective_checkpoint_contexts``) and recomputes the cheap
  element-wise ops between them (norms, activations), as torchtitan's op-level policy;
* ``none``: nothing is recomputed.

The memory budget counts what a forward leaves held through autograd's saved-tensor hooks
(:mod:`rrfp.runtime.engine.memory`). A checkpointed layer holds its inputs (and, selective, the saved
op outputs) outside those hooks, so the wrapper passes them through an identity autograd node
that saves them: the hooks then see exactly the storages the layer keeps (no extra memory:
they are alive anyway, and freed by that node's backward no later than by the layer's).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .spec import AC_MODES

__all__ = ["MODES", "SAVED_OPS", "checkpoint_units", "apply_activation_checkpointing"]

MODES = AC_MODES

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
"""Ops whose outputs selective checkpointing keeps (the compute-heavy ones)."""


class _Held(torch.autograd.Function):
    """Identity on ``x`` that saves ``held`` for its backward, so saved-tensor hooks see them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *held: torch.Tensor) -> torch.Tensor:
        ctx.n_held = len(held)
        ctx.save_for_backward(*held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *([None] * ctx.n_held))


def checkpoint_units(module: nn.Module) -> nn.ModuleList:
    """The layers of a stage module that checkpointing wraps: a Hugging Face stage's decoder
    layers (``layer_modules``) or an rrfp GPT stage's ``blocks``.

    Raises:
        ValueError: a module with neither.
    """
    units = getattr(module, "layer_modules", None)
    if units is None:
        units = getattr(module, "blocks", None)
    if not isinstance(units, nn.ModuleList):
        raise ValueError(f"activation checkpointing: {type(module).__name__} has no layer list "
                         "(expected .layer_modules or .blocks, an nn.ModuleList)")
    return units


def _checkpointed(unit: nn.Module, inner, mode: str):
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is kept, nothing to recompute
            return inner(*args, **kwargs)
        kept: list[torch.Tensor] = []
        context_fn = None
        if mode == "selective":
            def policy(ctx, op, *_a, **_k):
                if op in SAVED_OPS:
                    if not ctx.is_recompute:
                        out = ctx.op_output
                        kept.extend(t for t in (out if isinstance(out, (tuple, list)) else (out,))
                                    if isinstance(t, torch.Tensor))
                    return CheckpointPolicy.MUST_SAVE
                return CheckpointPolicy.PREFER_RECOMPUTE

            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        out = checkpoint(inner, *args, use_reentrant=False, **({"context_fn": context_fn} if context_fn else {}),
                         **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"activation checkpointing: {type(unit).__name__} returned {type(out).__name__}, "
                            "expected a tensor")
        return _Held.apply(out, *inputs, *(t.detach() for t in kept))

    return forward


def apply_activation_checkpointing(module: nn.Module, mode: str) -> nn.Module:
    """Checkpoint each layer of a stage module in place (``mode`` in :data:`MODES`); parameter
    names and the module's own forward are unchanged. Returns ``module``.

    Raises:
        ValueError: an unknown mode, or a module without a layer list (:func:`checkpoint_units`).
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "none":
        return module
    for unit in checkpoint_units(module):
        # An instance attribute: nn.Module.__call__ finds it before the class's forward.
        unit.forward = _checkpointed(unit, unit.forward, mode)
    return module
