"""What ``rrfp train --dp N --tp N`` adds to a rank: its layout, its share of the global batch,
its TP shard of each stage. The train worker calls these; the rules live here."""

from __future__ import annotations

import argparse
from typing import Sequence

import torch.distributed as dist

from .layout import ParallelLayout

__all__ = ["train_layout", "replica_samples", "reports"]


def train_layout(args: argparse.Namespace) -> ParallelLayout:
    """This rank's layout: PP degree ``--stages``, ``--dp``, ``--tp`` (torch.distributed is
    initialised).

    Raises:
        ValueError: one line when the world size is not ``stages x dp x tp``.
    """
    dp, tp = getattr(args, "dp", 1), getattr(args, "tp", 1)
    world = dist.get_world_size()
    if world != args.stages * dp * tp:
        raise ValueError(
            f"world size {world} != --stages {args.stages} x --dp {dp} x --tp {tp} = {args.stages * dp * tp}: "
            "launch pp x dp x tp processes"
        )
    if dp == 1 and tp == 1:
        rank = dist.get_rank()
        return ParallelLayout(args.stages, 1, 1, rank, rank, world_group=dist.group.WORLD)
    return ParallelLayout.build(args.stages, dp, tp)


def replica_samples(batch: Sequence, layout: ParallelLayout) -> list:
    """This DP replica's contiguous share of the global batch (``torch.tensor_split`` sizes:
    as equal as possible, earlier replicas one sample more)."""
    base, extra = divmod(len(batch), layout.dp)
    d = layout.dp_rank
    start = d * base + min(d, extra)
    return list(batch[start:start + base + (1 if d < extra else 0)])


def reports(layout: ParallelLayout) -> bool:
    """Whether this rank's pipeline is the one whose statistics rank 0 prints (dp 0, tp 0):
    every pipeline's step statistics are alike, and the loss is already global."""
    return layout.dp_rank == 0 and layout.tp_rank == 0
