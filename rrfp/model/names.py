"""A stage module's tensor names -> the unsplit model's, for checkpoints keyed by the model's
own names (any ``--pp``, ``--virtual-stages``, ``--placement`` or ``--tp`` of the same model
maps to the same keys)."""

from __future__ import annotations

from torch import nn

__all__ = ["model_names"]


def model_names(stage: nn.Module) -> dict[str, str]:
    """Every ``state_dict()`` key of ``stage`` -> the same tensor's key in the unsplit model's
    ``state_dict()``.

    Covers rrfp's stage modules: :class:`~rrfp.model.gpt.GPTStage` (also TP-sharded by
    :func:`~rrfp.model.tp.shard_gpt_stage`, whose tensors keep their names and hold
    :func:`~rrfp.model.tp.tp_slice` of the model's), :class:`~rrfp.model.hf.HFStage` (keys of the
    ``transformers`` model, e.g. ``transformer.h.2.attn.c_attn.weight``),
    :class:`~rrfp.model.multimodal.MultimodalStage`, :class:`~rrfp.model.toy.ToyStage`, with or
    without activation checkpointing (which keeps the names). A stage built on the meta device
    gives the map without allocating anything. A tied LM head maps to ``lm_head.weight``,
    its own key in the model's ``state_dict()``.

    Raises:
        TypeError: ``stage`` has no name map (not one of rrfp's stage modules).
        ValueError: a key of ``stage.state_dict()`` the map does not cover (names it).
    """
    params = getattr(stage, "stage_param_names", None)
    if params is None:
        raise TypeError(f"{type(stage).__name__}: expected one of rrfp's stage modules "
                        "(GPTStage, HFStage, MultimodalStage, ToyStage), which know the unsplit model's names")
    convert = getattr(stage, "model_name", None)
    out = {}
    for key in stage.state_dict(keep_vars=True):
        if key in params:
            out[key] = params[key]
        elif convert is not None:
            out[key] = convert(key)
        else:
            raise ValueError(f"{type(stage).__name__}: no model name for {key!r}")
    return out
