"""Stage modules built on the meta device and given real tensors one by one.

A model is constructed under ``torch.device("meta")`` (shapes and dtypes only, no storage), split
into stages there, and each rank then calls :func:`materialise` on its own stages: every tensor is
allocated once, by a ``fill`` that draws it (rrfp's presets, per parameter name) or reads it (a
saved checkpoint). Nothing of the other stages is ever allocated. Same idea as torchtitan's
meta-device initialisation and ``nn.Module.to_empty``, without the latter's first-call import of
sympy (0.3 s of a fresh process, measured at load 6).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["Fill", "materialise"]

Fill = Callable[[str, nn.Module, torch.Tensor], torch.Tensor]
"""``fill(name, owner, meta) -> tensor``: the value of the parameter or buffer ``name`` (its
qualified name in the materialised module) held by submodule ``owner``, given its meta tensor
(shape, dtype). Returns a CPU tensor of that shape; a different dtype is converted."""


def materialise(module: nn.Module, fill: Fill, *, parameters: bool = True, buffers: bool = True) -> nn.Module:
    """Replace ``module``'s meta parameters and buffers by ``fill``'s values, in place.

    A tensor that several submodules share (a tied weight) is filled once, under the first name
    ``named_modules`` reaches it by, and stays one :class:`~torch.nn.Parameter`. Tensors that are
    already real are left alone, so the two kinds may be materialised in separate calls.

    Args:
        module: a module built (at least partly) on the meta device.
        fill: gives each tensor's value (:data:`Fill`).
        parameters, buffers: which kinds to materialise.

    Returns:
        ``module``.

    Raises:
        ValueError: ``fill`` returned a tensor of another shape than the meta tensor's (the
            message names the tensor and both shapes).
    """
    kinds = [slot for slot, on in (("_parameters", parameters), ("_buffers", buffers)) if on]
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta kept alive, value)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for slot in kinds:
            table = getattr(mod, slot)
            for attr, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    value = fill(name, mod, t)
                    if tuple(value.shape) != tuple(t.shape):
                        raise ValueError(f"{name}: got a tensor of shape {tuple(value.shape)}, expected {tuple(t.shape)}")
                    value = value.to(t.dtype)
                    if slot == "_parameters":
                        value = nn.Parameter(value, requires_grad=t.requires_grad)
                    done[id(t)] = (t, value)
                table[attr] = done[id(t)][1]
    return module


