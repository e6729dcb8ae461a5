"""A pipeline stage: the user's ``nn.Module`` for one stage, and how to run its tasks.

Modeled on ``torch.distributed.pipelining.PipelineStage`` so that switching is a one-line
change: ``PipelineStage(module, stage_index, num_stages, device)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


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
            layers in rrfp's registry (:func:`rrfp.runtime.split.register_split_layer`); with
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
        from ..parallel.layout import check_stage_module

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
