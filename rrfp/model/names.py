"""The unsplit model's names for a stage's parameters, where a tensor-parallel shard lies in the
unsplit tensor, and the byte-level GPT's names in Hugging Face's GPT-2: what name-keyed
checkpoints (:mod:`rrfp.train.dcp`) and ``rrfp export`` (:mod:`rrfp.train.export`) need.

Each model family keeps its own rule for renaming a stage's parameters (a stage numbers its
layers from 0): :class:`~rrfp.model.gpt.GPTStage` (``_full_param_name``),
:class:`~rrfp.model.hf.HFStage` (``_full_name``) and
:class:`~rrfp.model.multimodal.MultimodalStage` each build ``stage_param_names`` when they are
constructed; :func:`full_names` reads it. Tensor parallelism (:mod:`rrfp.model.tp`) keeps the
names and shards some tensors: :func:`tp_runs` says which rows or columns of the unsplit tensor
a rank holds, from :func:`~rrfp.model.tp.tp_slice` itself.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["full_names", "tp_runs", "gpt2_config", "gpt_to_gpt2"]


def full_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name of a stage module -> the same parameter's name in the unsplit model.

    A weight the module holds under two names (a tied embedding and head on the only stage)
    appears under both.

    Args:
        module: a stage of the GPT presets, the multimodal model or ``hf:<model>`` (possibly
            tensor-parallel, checkpointed or wrapped in ``fully_shard``: none renames a parameter).

    Raises:
        ValueError: a module without the map (``stage_param_names``), or one whose map misses
            a parameter (one line naming it).
    """
    names = getattr(module, "stage_param_names", None)
    if not isinstance(names, dict):
        raise ValueError(f"{type(module).__name__} has no map from its parameter names to the unsplit model's: "
                         "expected a stage of a GPT preset, the multimodal model or hf:<model> (stage_param_names)")
    local = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    missing = [n for n in local if n not in names]
    if missing:
        raise ValueError(f"{type(module).__name__}: parameter {missing[0]!r} has no name in the unsplit model")
    return {n: names[n] for n in local}


Run = tuple[int, int, int]
"""``(local start, unsplit start, length)`` along the sharded dimension."""


def tp_runs(module: nn.Module, tp_rank: int, tp: int) -> dict[str, tuple[int, list[Run]]]:
    """Where this TP rank's shards of a stage's parameters lie in the unsplit tensors.

    Returns:
        For each TP-sharded parameter (its local name): the sharded dimension and the runs of
        consecutive rows (columns) it holds, in local order; e.g. a fused ``qkv`` weight holds
        three runs, its heads of q, of k and of v. Replicated parameters are not listed.

    Raises:
        ValueError: a shard that is not what :func:`~rrfp.model.tp.tp_slice` gives this rank,
            or layers of ``impl="dtensor"`` (their qkv rows are regrouped rank-major).
    """
    from .tp import ColumnParallelLinear, RowParallelLinear, TPAttention, tp_slice

    if tp == 1:
        return {}
    cfg = module.cfg
    out: dict[str, tuple[int, list[Run]]] = {}
    for prefix, mod in module.named_modules():
        if isinstance(mod, TPAttention) and not isinstance(mod.qkv, ColumnParallelLinear):
            raise ValueError(f"{prefix}: tensor-parallel layers of impl 'dtensor' hold qkv regrouped rank-major; "
                             "checkpoints keyed by name take impl 'manual' (rrfp train's)")
        # Column-parallel layers shard their output features (weight rows, bias), row-parallel
        # ones their input features (weight columns; the bias is whole on every rank).
        dims = {"weight": 0, "bias": 0} if isinstance(mod, ColumnParallelLinear) else \
            {"weight": 1} if isinstance(mod, RowParallelLinear) else {}
        for attr, dim in dims.items():
            p = getattr(mod, attr)
            if p is None:
                continue
            name = f"{prefix}.{attr}"
            n = p.shape[dim] * tp
            probe = torch.arange(n).view([n if d == dim else 1 for d in range(p.dim())])
            rows = tp_slice(name, probe, tp_rank, tp, cfg.d_model, cfg.n_head).flatten().tolist()
            if len(rows) != p.shape[dim]:
                raise ValueError(f"{name}: TP rank {tp_rank} of {tp} holds {p.shape[dim]} along dim {dim}, "
                                 f"tp_slice gives {len(rows)}")
            out[name] = (dim, _runs(rows))
    return out


def _runs(rows: list[int]) -> list[Run]:
    runs: list[list[int]] = []
    for i, r in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == r:
            runs[-1][2] += 1
        else:
            runs.append([i, r, 1])
    return [(a, b, c) for a, b, c in runs]


# ----------------------------------------------------------------------------- GPT-2
def gpt2_config(cfg) -> dict:
    """The ``transformers.GPT2Config`` settings that compute exactly what :class:`~rrfp.model.gpt.GPT`
    of ``cfg`` computes: the same pre-norm blocks, fused qkv, exact GELU (``gelu``, not GPT-2's
    tanh ``gelu_new``), LayerNorm eps 1e-5, the same dropouts, and a head not tied to the token
    embedding (rrfp's GPT has none)."""
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head,
                n_inner=cfg.ff_width, activation_function="gelu", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None)


_TOP = {"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "ln_f": "transformer.ln_f", "head": "lm_head"}
_CONV1D = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def gpt_to_gpt2(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A :class:`~rrfp.model.gpt.GPT` parameter as the ``GPT2LMHeadModel`` one: its name
    (``blocks.3.attn.qkv.weight`` -> ``transformer.h.3.attn.c_attn.weight``) and its tensor,
    transposed for GPT-2's ``Conv1D`` layers (which store ``[in, out]``).

    Raises:
        ValueError: a name :class:`~rrfp.model.gpt.GPT` does not have.
    """
    block = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if block:
        layer, part, kind = block.groups()
        if part in _CONV1D and kind == "weight":
            tensor = tensor.t().contiguous()
        return f"transformer.h.{layer}.{_CONV1D.get(part, part)}.{kind}", tensor
    part, _, kind = name.rpartition(".")
    if part not in _TOP:
        raise ValueError(f"{name!r} is not a parameter of rrfp's GPT")
    return f"{_TOP[part]}.{kind}", tensor
