"""Gradient clipping by the global norm across PP, TP and DP: one reduction of squared norms.

Each rank adds the squared norms of the gradients it *counts* (:func:`counted`): a gradient
replicated over TP (LayerNorms, embeddings, row-parallel biases), over DP (every replica holds
the reduced gradient) or across stages (a tied parameter's copies) is counted on one rank
only, and a shard on every rank that holds one: a TP shard on every TP rank, an FSDP2 shard
(:mod:`rrfp.parallel.sharded`) on every DP rank. One all-reduce of that float64 scalar over
the world gives the global squared norm.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from .layout import ParallelLayout
from .sharded import dp_sharded

__all__ = ["clip_grad_norm_", "counted"]


def counted(p: torch.Tensor, layout: ParallelLayout | None) -> bool:
    """Whether this rank counts parameter ``p`` in the global norm (module docstring)."""
    if getattr(p, "_rrfp_tied_copy", False):
        return False
    if layout is None:
        return True
    if layout.dp_rank != 0 and not dp_sharded(p, layout):
        return False
    return layout.tp_rank == 0 or getattr(p, "_rrfp_tp_shard", False)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, layout: ParallelLayout | None = None,
                    group=None, eps: float = 1e-6) -> float:
    """Scale every gradient by ``min(1, max_norm / (total_norm + eps))`` in place, like
    ``torch.nn.utils.clip_grad_norm_`` over the whole model (source: Megatron's
    ``clip_grad_norm_fp32``).

    Args:
        params: this rank's parameters (every stage it holds).
        max_norm: the largest global 2-norm, > 0.
        layout: which copies this rank counts (None: every parameter, PP only).
        group: the group to reduce over (default: the world when torch.distributed is up).

    Returns:
        The global gradient norm before clipping.

    Raises:
        ValueError: ``max_norm`` not a positive finite number.
    """
    if not (max_norm > 0 and max_norm != float("inf")):
        raise ValueError(f"max_norm={max_norm!r}: expected a positive finite number")
    params = [p for p in params if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params)]
    sq = torch.zeros((), dtype=torch.float64)
    for p, g in zip(params, grads):
        if counted(p, layout):
            sq += g.detach().to(torch.float64).pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    total = float(sq.sqrt())
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return total
