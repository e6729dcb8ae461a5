"""The optimizer side of ``rrfp train``: the learning-rate schedule (``--warmup``,
``--lr-schedule``) and global gradient-norm clipping across pipeline stages (``--clip-grad``).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch


def lr_scheduler(opt: torch.optim.Optimizer, steps: int, warmup: int, schedule: str, min_lr: float):
    """Linear warm-up over ``warmup`` steps (from ``lr / warmup`` to ``lr``), then
    ``constant`` or ``cosine`` decay to ``min_lr`` at the last step (torch's ``LambdaLR``,
    ``CosineAnnealingLR`` and ``SequentialLR``). Call ``.step()`` after each optimizer step.

    Raises:
        ValueError: an unknown schedule, or a warm-up longer than the run.
    """
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LambdaLR, SequentialLR

    if schedule not in ("constant", "cosine"):
        raise ValueError(f"learning-rate schedule {schedule!r}: expected constant or cosine")
    if not 0 <= warmup <= steps:
        raise ValueError(f"warm-up {warmup} steps: expected 0..{steps} (the run's steps)")
    rest = max(steps - warmup, 1)
    if schedule == "cosine":
        after = CosineAnnealingLR(opt, T_max=rest, eta_min=min_lr)
    else:
        after = ConstantLR(opt, factor=1.0, total_iters=0)
    if warmup == 0:
        return after
    warm = LambdaLR(opt, lambda k: min(1.0, (k + 1) / warmup))
    return SequentialLR(opt, [warm, after], milestones=[warmup])


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, group=None) -> float:
    """Scale the gradients of ``params`` so that the global L2 norm over every rank of
    ``group`` (default: the world; the pipeline's ranks) is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process.

    One all-reduce of one float64 (the sum of squared norms) per call; other groups (DP, TP
    replicas that hold copies or shards) extend this by reducing over their group too.

    Returns:
        the global norm before clipping.

    Raises:
        ValueError: a ``max_norm`` that is not positive and finite.
    """
    import torch.distributed as dist

    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm={max_norm}: expected a positive, finite number")
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().to(torch.float64).pow(2).sum().cpu()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    total = math.sqrt(float(sq))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
