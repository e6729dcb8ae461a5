"""``rrfp train --precision bf16``: each stage's forward under ``torch.autocast`` (CPU and
CUDA), parameters and gradients kept in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a stage is wrapped, not when rrfp train's parser is built
    from torch import nn

PRECISIONS = ("fp32", "bf16")


def use_autocast(module: nn.Module, precision: str, device_type: str, last: bool) -> None:
    """Run ``module``'s forward under autocast to ``precision`` on ``device_type``.

    The last stage's outputs (the logits) go back to float32, so the loss, computed outside
    the forward, is a float32 softmax, as autocast itself computes cross-entropy.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return
    import torch

    forward = module.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        if last and isinstance(out, torch.Tensor) and out.is_floating_point():
            return out.float()
        return out

    module.forward = autocast_forward
