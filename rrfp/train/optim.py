"""The optimizer side of ``rrfp train``: the learning-rate schedule (``--warmup``,
``--lr-schedule``); ``--clip-grad`` is :func:`rrfp.parallel.clip.clip_grad_norm_`.
"""

from __future__ import annotations

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
