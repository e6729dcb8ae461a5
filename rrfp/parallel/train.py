"""What ``rrfp train --dp N --tp N --dp-shard`` adds to a rank: its layout, its share of the
global batch, its TP shard of each stage, its FSDP2 sharding. The train worker calls these; the
rules live here."""

from __future__ import annotations

import argparse
from typing import Sequence

import torch.distributed as dist

from .layout import ParallelLayout

__all__ = ["train_layout", "replica_samples", "reports", "shard_stage", "dp_shard_mesh"]


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
    layout = ParallelLayout.build(args.stages, dp, tp)
    layout.dp_shard = getattr(args, "dp_shard", "none")
    return layout


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


def dp_shard_mesh(layout: ParallelLayout, device_type: str = "cpu"):
    """The 1-D ``dp`` mesh ``--dp-shard full`` shards over: the layout's own (gloo) on CPU; on a
    GPU a second ``(pp, dp, tp)`` mesh whose ``dp`` groups are NCCL (collective: every rank
    calls it at the same point). The CUDA path is written to torch's API but untested here."""
    if device_type == "cpu":
        return layout.mesh["dp"]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"),
                            backend_override={"dp": "nccl"} if device_type == "cuda" else None)
    return mesh["dp"]


def shard_stage(module, layout: ParallelLayout, precision: str = "fp32", last: bool = False, mesh=None) -> None:
    """``--dp-shard full``: FSDP2 ``fully_shard`` of every block (each element of the stage's
    outermost ``nn.ModuleList``s), then of the stage itself, over the layout's ``dp`` mesh,
    gathered once per step (``reshard_after_forward=False``, torchtitan's choice for pipeline
    stages). ``precision="bf16"``: ``MixedPrecisionPolicy`` computing in bf16 and reducing
    gradients in fp32, the last stage's outputs (the logits) cast back to fp32 for the loss.
    A TP shard keeps its ``_rrfp_tp_shard`` mark (clipping counts it on every TP rank).
    ``mesh``: the ``dp`` mesh to shard over (default the layout's; :func:`dp_shard_mesh`).
    """
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tp_marked = {n for n, p in module.named_parameters() if getattr(p, "_rrfp_tp_shard", False)}
    bf16 = precision == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    mesh = layout.mesh["dp"] if mesh is None else mesh
    lists: list[str] = []
    for path, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and not any(path.startswith(q + ".") for q in lists):
            lists.append(path)
            for block in sub:
                fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   output_dtype=torch.float32) if bf16 and last else mp
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp)
    for name, p in module.named_parameters():
        if name in tp_marked:
            p._rrfp_tp_shard = True
