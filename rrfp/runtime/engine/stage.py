"""A pipeline stage: the user's ``nn.Module`` for one stage, and how to run its tasks.

Modeled on ``torch.distributed.pipelining.PipelineStage`` so that switching is a one-line
change: ``PipelineStage(module, stage_index, num_stages, device)``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from torch import nn

# Gradient-reducing wrappers (module, class, what the error calls it). Looked up only if their
# module is loaded: importing torch's FSDP here would pull in torch._dynamo (seconds per
# process), and a module can only be an instance of a class whose module is loaded.
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "DistributedDataParallel"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "FullyShardedDataParallel"),
    ("torch.distributed._composable.replicate_with_fsdp", "ReplicateModule", "replicate (DDP)"),
)
# torch's composable APIs mark a module in a registry attribute instead of wrapping it.
_COMPOSABLE = {"replicate": "replicate (DDP)", "fully_shard": "fully_shard (FSDP)"}
# FSDP2's fully_shard: accepted, driven by rrfp.parallel.sharded (its own registry entry is
# "fully_shard" too, which on a module that is no FSDPModule means FSDP1's composable API).
_FSDP2 = ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule")


def _reducer(module: nn.Module, classes: Sequence[tuple[type, str]], registry_key: str | None,
             fsdp2: type | None) -> str | None:
    for cls, label in classes:
        if isinstance(module, cls):
            return label
    if fsdp2 is not None and isinstance(module, fsdp2):
        return None
    registry = getattr(module, registry_key, None) if registry_key else None
    for api in registry or ():
        if api in _COMPOSABLE:
            return _COMPOSABLE[api]
    return None


def check_stage_module(module: nn.Module, stage_index: int) -> None:
    """Refuse a stage module that holds a gradient-reducing wrapper anywhere inside it.

    DDP reduces gradients in its own backward hooks, which fire once per microbatch backward
    and in whatever order the runtime runs them, so replicas would reduce partial, mismatched
    gradients (measured: stage-0 gradients off by 2.7e-2 against a largest entry of 2.9e-2,
    whether DDP wraps the stage or a submodule of it). FSDP1 likewise shards and reduces
    inside backward. rrfp reduces a stage's gradients itself once they are final
    (``Pipeline(..., layout=...)``, ``rrfp train --dp N``). FSDP2's ``fully_shard`` is
    accepted: the pipeline turns its per-backward reduction off and runs it once the stage's
    gradients are final (:mod:`rrfp.parallel.sharded`).

    Raises:
        ValueError: one line naming the stage, the submodule's path and the wrapper.
    """
    classes = [(getattr(sys.modules.get(m), c, None), label) for m, c, label in _WRAPPERS]
    classes = [(c, label) for c, label in classes if isinstance(c, type)]
    registry_key = getattr(sys.modules.get("torch.distributed._composable.contract"), "REGISTRY_KEY", None)
    if not classes and registry_key is None:
        return
    fsdp2 = getattr(sys.modules.get(_FSDP2[0]), _FSDP2[1], None)
    for path, sub in module.named_modules():
        label = _reducer(sub, classes, registry_key, fsdp2 if isinstance(fsdp2, type) else None)
        if label is None:
            continue
        where = f"is wrapped in {label}" if not path else f"holds {label} at submodule {path!r}"
        raise ValueError(
            f"stage {stage_index}'s module {where}: pass the plain module and give the data-parallel degree to rrfp "
            "(Pipeline(..., layout=ParallelLayout.build(pp, dp, tp)) or rrfp train --dp N), "
            "which reduces each stage's gradients once they are final"
        )


def as_tuple(x: Any) -> tuple:
    """A stage's inputs or outputs as a tuple of tensors (a lone tensor becomes a 1-tuple)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    raise TypeError(f"stage inputs and outputs must be tensors or tuples of tensors, got {type(x).__name__}")


def detach_for_next(t: torch.Tensor | None) -> torch.Tensor | None:
    """The next stage's view of an output: a leaf that requires grad iff the output did."""
    if t is None:
        return None
    d = t.detach()
    if t.requires_grad and d.is_floating_point():
        d.requires_grad_(True)
    return d


class PipelineStage:
    """One stage of a pipeline.

    Args:
        module: the stage's ``nn.Module``; ``forward(*inputs)`` takes the previous stage's
            outputs (stage 0: the microbatch's inputs) and returns a tensor or a tuple of
            tensors of any dtypes; float outputs that require grad receive gradients.
        stage_index: this stage's index in the pipeline, ``0 <= stage_index < num_stages``.
        num_stages: the pipeline's number of stages (virtual stages included).
        device: where the module's parameters and inputs live (default: the module's).
        input_args, output_args, output_grads, input_grads: accepted for signature parity
            with ``torch.distributed.pipelining.PipelineStage``, which uses them to infer
            message shapes; rrfp's messages carry their shapes, so they are ignored (not
            checked against what arrives either).
        group: the pipeline's process group (default: the world); :class:`Pipeline` takes
            this rank's pipeline index and the rank count from it.
        dw_builder: as in PyTorch: ``dw_builder()`` returns a callable that computes the
            weight gradients the module's own backward leaves out. rrfp calls it right after
            each microbatch's backward on this stage and runs the callable at that
            microbatch's W (split-backward hints: ``bfw``, ``zb-*``), or at once after a full
            backward B. Without it, split-backward hints defer the weight gradients of the
            layers in rrfp's registry (:func:`rrfp.runtime.engine.split.register_split_layer`); with
            it, rrfp leaves the module's layers alone.
        get_mesh: accepted for parity (DeviceMesh callback), unused.

    Raises:
        ValueError: for an index outside ``[0, num_stages)``.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str | None = None,
        input_args: Any = None,
        output_args: Any = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: Any = None,
        dw_builder: Any = None,
        get_mesh: Any = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index}: expected 0 <= stage_index < num_stages={num_stages}")
        check_stage_module(module, stage_index)
        self.submod = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.dw_builder = dw_builder
        if device is None:
            p = next(module.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def to_device(self, tensors: Sequence[torch.Tensor | None]) -> tuple:
        if self.device.type == "cpu":
            return tuple(tensors)
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            rg = t.requires_grad
            d = t.detach().to(self.device, non_blocking=True)
            out.append(d.requires_grad_(True) if rg else d)
        return tuple(out)
