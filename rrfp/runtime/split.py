"""Split backward: I computes input gradients now, W computes the deferred weight gradients
later (RRFP §4 "BFW"; the zero-bubble papers' B/W split).

The runtime does not walk the autograd graph in Python (torch.distributed.pipelining's
``stage_backward_input`` does, which cost 40-50% on top of a full backward for a one-layer
stage here). Instead, every ``nn.Linear`` of a stage runs through :class:`_DeferredLinear`.
During I, its backward returns only ``dX = dY @ W``. It records ``(X, dY)`` in the active
:class:`WeightGradStore`, and W later computes ``dW = dY^T X`` and ``db = sum(dY)``. This is the
way Megatron's zero-bubble implementation defers weight gradients. Parameters outside
``nn.Linear`` layers (norms, embeddings) get their gradients during I, as in a full backward.
They are a small share of the FLOPs.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_active: "WeightGradStore | None" = None


class WeightGradStore:
    """The weight-gradient work of one (stage, microbatch) left for W.

    Each entry is ``(weight, bias, X[..., in], dY[..., out])``; :meth:`flush` accumulates
    ``dW [out, in]`` into ``weight.grad`` and ``db [out]`` into ``bias.grad``.
    """

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.items)

    def flush(self) -> None:
        """Compute and accumulate every deferred weight gradient, then forget them."""
        for weight, bias, x, dy in self.items:
            dw, db = _weight_grads(x, dy, bias is not None)
            _accumulate(weight, dw)
            if bias is not None:
                _accumulate(bias, db)
        self.items.clear()


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[None]:
    """While active, split linear layers defer their weight gradients to ``store``."""
    global _active
    prev, _active = _active, store
    try:
        yield
    finally:
        _active = prev


def _weight_grads(x: torch.Tensor, dy: torch.Tensor, has_bias: bool):
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
    return dw, (dy2.sum(0) if has_bias else None)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        # Parameters are not modified before W runs (the optimizer steps after every W), so
        # plain references are safe where saved tensors would not let us reach the Parameter.
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or (b_param is not None and ctx.needs_input_grad[2])):
            return dx, None, None
        store = _active
        if store is not None:
            store.items.append((w_param, b_param, x, dy))
            return dx, None, None
        dw, db = _weight_grads(x, dy, b_param is not None)
        return dx, dw, db


def _deferred_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(x, self.weight, self.bias)


def enable_split_backward(module: nn.Module) -> int:
    """Route every ``nn.Linear`` in ``module`` through the deferring linear function.

    Outside :func:`deferring` the layers compute their weight gradients at once, so a full
    backward still works. Idempotent.

    Returns:
        the number of linear layers routed.
    """
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            if getattr(m, "_rrfp_split", False):
                n += 1
                continue
            m.forward = types.MethodType(_deferred_forward, m)
            m._rrfp_split = True
            n += 1
    return n
