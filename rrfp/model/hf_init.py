"""Give a Hugging Face stage built on the meta device its tensors, and only its own: drawn per
module name (rrfp's ``hf:<preset>`` models) or read from a saved model's safetensors files.

Both take the meta ``*ForCausalLM`` model the stage was split from (its family's
``_init_weights`` and its tie between the token embedding and the LM head), the stage (or the
whole model) to materialise, and ``model_name``: a name in that module -> the whole model's name.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .hf_weights import SafeTensors
from .meta import materialise

__all__ = ["init_seeded", "load_safetensors", "module_seed"]


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of the whole model's module ``name`` under initialisation seed ``seed``."""
    digest = hashlib.sha256(f"rrfp.hf:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tie(model: nn.Module) -> tuple[str, str] | None:
    """``(LM head's module name, token embedding's module name)`` when they share one weight."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is None or inp.weight is not out.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(out)], names[id(inp)]


def _empty(name: str, owner: nn.Module, meta: torch.Tensor) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.dtype)


def init_seeded(model: nn.Module, root: nn.Module, model_name: Callable[[str], str], seed: int) -> None:
    """Materialise ``root`` (a stage of ``model``, or ``model`` itself) with the family's own
    initialisation (``model._init_weights``), each module's under torch's RNG seeded with
    :func:`module_seed` of its whole-model name, descendants before ancestors as
    ``model.apply`` runs it. A module's values thus depend on its name alone, so every split
    holds the unsplit model's values. A tied LM head is drawn as the token embedding it shares
    its weight with. The caller's random stream is left unchanged.
    """
    materialise(root, _empty)
    tie = _tie(model)
    held = {model_name(n) for n, _ in root.named_modules()}
    with torch.random.fork_rng(devices=[]):
        # Reversed pre-order: every module after all of its descendants (GPT-2's attention
        # redraws its c_proj after the Conv1D's own init, as in model.apply).
        for local, mod in reversed(list(root.named_modules())):
            name = model_name(local)
            if tie is not None and name == tie[0]:
                if tie[1] in held:
                    continue  # one weight: the embedding's init draws it
                # The last stage's copy of the shared weight: the embedding's draw, made into it.
                twin = copy.deepcopy(model.get_submodule(tie[1]))
                twin.weight = mod.weight
                mod, name = twin, tie[1]
            torch.manual_seed(module_seed(seed, name))
            model._init_weights(mod)


def load_safetensors(model: nn.Module, root: nn.Module, model_name: Callable[[str], str], folder: str | Path) -> SafeTensors:
    """Materialise ``root`` (a stage of ``model``) from the saved model in ``folder``, reading
    only its own tensors (:class:`~rrfp.model.hf_weights.SafeTensors`), converted to the meta
    model's dtype. A tied LM head missing from the files reads the token embedding's tensor;
    buffers the files do not hold (rotary frequencies) are computed by the family's init.

    Returns:
        The :class:`~rrfp.model.hf_weights.SafeTensors` read (``.read`` lists the tensors read).

    Raises:
        ValueError: no safetensors weights in ``folder``, or a tensor of the stage missing from
            them or saved with another shape (the message names it).
    """
    tie = _tie(model)
    tied = {f"{tie[0]}.weight": f"{tie[1]}.weight"} if tie is not None else {}
    prefix = getattr(model, "base_model_prefix", None)
    computed: list[nn.Module] = []

    with SafeTensors(folder) as weights:
        def key(local: str) -> str | None:
            name = model_name(local)
            found = weights.find(name, prefix)
            if found is None and name in tied:
                found = weights.find(tied[name], prefix)
            return found

        def read(k: str, local: str, meta: torch.Tensor) -> torch.Tensor:
            # Checked here, not only by materialise, whose message knows the stage's local name
            # (h.1 of a later stage) rather than the model's (h.3) that the file holds.
            value = weights.get(k)
            if tuple(value.shape) != tuple(meta.shape):
                raise ValueError(f"{folder}: tensor {k!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(meta.shape)} for {model_name(local)!r} (its config.json's "
                                 f"{model.config.model_type} model)")
            return value

        def buffer(local: str, owner: nn.Module, meta: torch.Tensor) -> torch.Tensor:
            if (k := key(local)) is not None:
                return read(k, local, meta)
            computed.append(owner)
            return torch.empty(meta.shape, dtype=meta.dtype)

        def parameter(local: str, owner: nn.Module, meta: torch.Tensor) -> torch.Tensor:
            if (k := key(local)) is None:
                raise ValueError(f"{folder}: no tensor {model_name(local)!r} in its safetensors files "
                                 f"(its config.json's {model.config.model_type} model has one)")
            return read(k, local, meta)

        materialise(root, buffer, parameters=False)
        with torch.no_grad():
            for owner in dict.fromkeys(computed):  # parameters still on meta: untouched by the init
                model._init_weights(owner)
        materialise(root, parameter, buffers=False)
    return weights
