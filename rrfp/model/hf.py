"""Hugging Face ``transformers`` causal LMs split into pipeline stages by layer count.

:func:`split_hf` cuts a ``*ForCausalLM`` model of a supported family (:data:`FAMILIES`: GPT-2,
Llama, Mistral, Qwen2, Qwen3) into ``n`` contiguous stages: the embeddings on the first
stage, the final norm and the LM head on the last, the decoder layers spread as evenly as
:func:`~rrfp.model.gpt.stage_layer_ranges` spreads them. Each stage re-runs the family's own
forward around its layers (the package's ``create_causal_mask``, rotary embedding and layer
modules), so chaining the stages computes what the whole model computes.

Stage I/O (``B`` samples, ``T`` positions, ``D`` hidden size, ``V`` vocabulary):

* first stage: ``forward(input_ids int64 [B, T], attention_mask=None, position_ids=None)``;
  ``attention_mask`` ``[B, T]`` (1 keep, 0 padding) and ``position_ids`` ``[B or 1, T]``
  as in ``transformers`` (default ``arange(T)``);
* every stage but the last returns ``(hidden [B, T, D], attention_mask, position_ids)``:
  the mask and the positions travel with the activations (an empty int64 tensor stands for
  "no mask"), so later stages need no inputs of their own;
* the last stage returns logits ``[B, T, V]`` (float32 for float32 weights).

A model whose LM head shares the token embedding's weight (GPT-2, Qwen2's small models) gets
two copies after the split; :func:`hf_ties` gives the ``Pipeline(tied=...)`` argument that
sums their gradients, so the copies stay equal.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .gpt import stage_layer_ranges
from .spec import HF_PRESETS

__all__ = ["FAMILIES", "HF_PRESETS", "HFStage", "split_hf", "hf_ties", "hf_config", "hf_model", "meta_model",
           "build_hf_stages", "hf_layer_count"]


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts: attribute names under the ``*ForCausalLM`` model."""

    base: str            # the decoder: model.<base>
    embeddings: tuple    # token embedding first, then absolute position embeddings if any
    layers: str          # the ModuleList of decoder layers under <base>
    norm: str            # the final norm under <base>
    rotary: str | None   # the rotary embedding under <base> (every stage computes it)
    dropout: str | None  # the embedding dropout under <base>


_LLAMA_LIKE = Family("model", ("embed_tokens",), "layers", "norm", "rotary_emb", None)
FAMILIES: dict[str, Family] = {
    "gpt2": Family("transformer", ("wte", "wpe"), "h", "ln_f", None, "drop"),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}
"""Supported ``config.model_type`` values and their layout."""


def _family(config) -> Family:
    fam = FAMILIES.get(getattr(config, "model_type", None))
    if fam is None:
        raise ValueError(f"Hugging Face model type {getattr(config, 'model_type', None)!r}: "
                         f"expected one of {', '.join(FAMILIES)}")
    return fam


def _layer_kind(config, i: int) -> str:
    """``full_attention`` or ``sliding_attention`` for global layer ``i`` (as the family's forward picks)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[i]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


NO_MASK = torch.empty(0, dtype=torch.int64)
"""What a stage sends for "no attention mask" (messages carry tensors only)."""


class HFStage(nn.Module):
    """One pipeline stage of a ``transformers`` causal LM (I/O in the module docstring).

    Parameters keep the full model's names, with layer indices local to the stage
    (``transformer.h.0.attn.c_attn.weight`` of stage 1 of a 4-layer GPT-2 on 2 stages is the
    model's ``transformer.h.2.attn.c_attn.weight``): :attr:`stage_param_names` maps them.

    Attributes:
        config: the model's ``PretrainedConfig``.
        stage_index, n_stages: this stage's place in the pipeline.
        layer_range: the model's decoder layers this stage holds.
        is_first, is_last: whether it holds the embeddings / the norm and LM head.
        stage_param_names: this module's parameter name -> the whole model's.
    """

    def __init__(self, model: nn.Module, stage_index: int, n_stages: int, layers: range) -> None:
        super().__init__()
        config = model.config
        fam = _family(config)
        self.config, self.family = config, fam
        self.stage_index, self.n_stages, self.layer_range = stage_index, n_stages, layers
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1
        src = getattr(model, fam.base)
        keep: dict[str, Any] = {fam.layers: nn.ModuleList(getattr(src, fam.layers)[i] for i in layers)}
        if self.is_first:
            keep.update({name: getattr(src, name) for name in fam.embeddings})
            if fam.dropout:
                keep[fam.dropout] = getattr(src, fam.dropout)
        if fam.rotary:
            keep[fam.rotary] = getattr(src, fam.rotary)
        if self.is_last:
            keep[fam.norm] = getattr(src, fam.norm)
            keep["lm_head"] = model.lm_head
        # One deepcopy for all of a stage's parts: a tie inside one stage (the only stage)
        # stays one parameter; across stages the parts become independent copies.
        keep = copy.deepcopy(keep)
        base = nn.Module()
        for name, mod in keep.items():
            if name != "lm_head":
                base.add_module(name, mod)
        self.add_module(fam.base, base)
        if self.is_last:
            self.lm_head = keep["lm_head"]
        self.train(model.training)
        self.stage_param_names = {n: self.model_name(n) for n, _ in self.named_parameters(remove_duplicate=False)}

    def model_name(self, name: str) -> str:
        """The whole model's name of this stage's parameter, buffer or submodule ``name``
        (``transformer.h.0.attn`` of stage 1 of a 4-layer GPT-2 on 2 stages is
        ``transformer.h.2.attn``)."""
        return _full_name(name, f"{self.family.base}.{self.family.layers}.", self.layer_range.start)

    @property
    def layer_modules(self) -> nn.ModuleList:
        """This stage's decoder layers, in order (what activation checkpointing wraps)."""
        return getattr(getattr(self, self.family.base), self.family.layers)

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """Run this stage (shapes in the module docstring). On stages after the first the
        mask and positions come from the previous stage (``carried``); keyword values are
        then ignored, so one set of keyword inputs may reach every stage.

        Raises:
            ValueError: input ids that are not 2-D int64, or a later stage called without
                the carried mask and positions.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        fam, base = self.family, getattr(self, self.family.base)
        if self.is_first:
            if x.dim() != 2 or x.dtype != torch.int64:
                raise ValueError(f"stage 0 expects input_ids int64 [B, T], got {x.dtype} {tuple(x.shape)}")
            if position_ids is None:
                position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            h = getattr(base, fam.embeddings[0])(x)
            if len(fam.embeddings) > 1:
                h = h + getattr(base, fam.embeddings[1])(position_ids)
            if fam.dropout:
                h = getattr(base, fam.dropout)(h)
        else:
            if len(carried) != 2:
                raise ValueError(f"stage {self.stage_index} expects (hidden, attention_mask, position_ids) "
                                 f"from stage {self.stage_index - 1}, got {1 + len(carried)} tensors")
            h, (mask, position_ids) = x, carried
            attention_mask = None if mask.numel() == 0 else mask
        kinds = {_layer_kind(self.config, i) for i in self.layer_range}
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {k: make[k](config=self.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                            position_ids=position_ids) for k in kinds}
        rotary = getattr(base, fam.rotary)(h, position_ids=position_ids) if fam.rotary else None
        for i, layer in zip(self.layer_range, self.layer_modules):
            mask = masks[_layer_kind(self.config, i)]
            if fam.rotary:
                h = layer(h, attention_mask=mask, position_ids=position_ids, use_cache=False,
                          position_embeddings=rotary)
            else:
                h = layer(h, None, mask, use_cache=False, position_ids=position_ids)
        if self.is_last:
            return self.lm_head(getattr(base, fam.norm)(h))
        carried_mask = NO_MASK.to(h.device) if attention_mask is None else attention_mask
        return h, carried_mask, position_ids

    def extra_repr(self) -> str:
        r = self.layer_range
        return (f"{self.config.model_type}, stage_index={self.stage_index}, n_stages={self.n_stages}, "
                f"layers={r.start}..{r.stop - 1}")


def _full_name(name: str, prefix: str, first: int) -> str:
    if name.startswith(prefix):
        local, *rest = name[len(prefix):].split(".", 1)
        return ".".join([f"{prefix}{first + int(local)}", *rest])
    return name


def hf_layer_count(config) -> int:
    """Decoder layers of a ``transformers`` config (``num_hidden_layers`` or GPT-2's ``n_layer``)."""
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)


def split_hf(model: nn.Module, n_stages: int) -> list[HFStage]:
    """Split a ``transformers`` causal LM into ``n_stages`` :class:`HFStage` modules.

    Stages hold deep copies of the model's weights (the model is left unchanged), in its
    train/eval mode. Chaining them computes ``model(input_ids, attention_mask=...,
    position_ids=...).logits``.

    Args:
        model: a ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
            ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (:data:`FAMILIES`).
        n_stages: ``1 <= n_stages <=`` its decoder layers.

    Raises:
        ValueError: an unsupported model type, or a bad ``n_stages``.
    """
    _family(model.config)
    ranges = stage_layer_ranges(hf_layer_count(model.config), n_stages)
    return [HFStage(model, s, n_stages, r) for s, r in enumerate(ranges)]


def hf_ties(model: nn.Module, n_stages: int) -> dict | None:
    """``Pipeline(tied=...)`` for a split of ``model`` into ``n_stages``: the token
    embedding and the LM head when the model shares one weight between them and they land
    on different stages, else None."""
    fam = _family(model.config)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if n_stages < 2 or out is None or inp.weight is not out.weight:
        return None
    return {"embeddings": {0: f"{fam.base}.{fam.embeddings[0]}.weight", -1: "lm_head.weight"}}


def hf_config(spec: str, max_len: int = 256):
    """The ``PretrainedConfig`` of ``rrfp train --model hf:<spec>``.

    Args:
        spec: a :data:`HF_PRESETS` name (its config class, byte vocabulary of 256, ``max_len``
            positions) or a folder holding ``config.json``.
        max_len: positions a preset covers.

    Raises:
        ValueError: a folder of an unsupported model type.
        OSError: a folder without a readable ``config.json``.
        ImportError: ``transformers`` is not installed (``pip install rrfp[hf]``).
    """
    import transformers

    if spec in HF_PRESETS:
        cls_name, settings = HF_PRESETS[spec]
        pos = "n_positions" if cls_name == "GPT2Config" else "max_position_embeddings"
        return getattr(transformers, cls_name)(vocab_size=256, **{pos: max_len}, **settings)
    config = transformers.AutoConfig.from_pretrained(spec)
    _family(config)
    return config


def meta_model(config) -> nn.Module:
    """The ``*ForCausalLM`` model of ``config`` on the meta device, float32 (shapes only:
    nothing is allocated or drawn)."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def hf_model(spec: str, seed: int = 0, max_len: int = 256) -> nn.Module:
    """The whole model of ``rrfp train --model hf:<spec>``, in train mode, float32: the
    reference that :func:`build_hf_stages`'s stages split.

    Args:
        spec: a :data:`HF_PRESETS` name (random weights, each module's drawn by the family's
            own initialisation under a seed made of ``seed`` and the module's name, without
            touching the caller's random stream: :func:`~rrfp.model.hf_init.init_seeded`), or
            a local folder as ``from_pretrained`` reads it (``config.json`` and weights).
        seed: initialisation seed of a preset.
        max_len: positions a preset covers.

    Raises:
        ValueError: an unknown name or a folder of an unsupported model type.
        ImportError: ``transformers`` is not installed (``pip install rrfp[hf]``).
    """
    if spec in HF_PRESETS:
        from .hf_init import init_seeded

        model = meta_model(hf_config(spec, max_len))
        init_seeded(model, model, str, seed)
        return model.train()
    import transformers

    _family(transformers.AutoConfig.from_pretrained(spec))
    model = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
    return model.float().train()


def build_hf_stages(spec: str, n_stages: int, stage_ids: list[int], seed: int = 0,
                    max_len: int = 256) -> tuple[list[HFStage], dict | None]:
    """This rank's stages of ``hf:<spec>`` and the pipeline's ``tied=`` argument, with only
    their own tensors allocated: the model is built on the meta device, split there, and each
    stage is materialised alone, in train mode, float32. A preset's tensors are drawn per
    module name (:func:`~rrfp.model.hf_init.init_seeded`), a folder's read from its
    safetensors files, only the stage's own (:func:`~rrfp.model.hf_init.load_safetensors`).
    Every stage equals the same stage of ``split_hf(hf_model(spec, seed, max_len), n_stages)``.

    Args:
        spec: a :data:`HF_PRESETS` name or a folder ``save_pretrained`` wrote (safetensors,
            single file or sharded).
        n_stages: stages of the whole pipeline (``1 <= n_stages <=`` decoder layers).
        stage_ids: the stages to build.
        seed, max_len: as :func:`hf_model`.

    Raises:
        ValueError: an unknown preset, an unsupported model type, a bad ``n_stages``, a folder
            without safetensors weights, or a tensor missing from them or of the wrong shape
            (the message names it).
    """
    from .hf_init import init_seeded, load_safetensors

    config = hf_config(spec, max_len)
    model = meta_model(config)
    ranges = stage_layer_ranges(hf_layer_count(config), n_stages)
    stages = [HFStage(model, s, n_stages, ranges[s]) for s in stage_ids]
    for st in stages:
        if spec in HF_PRESETS:
            init_seeded(model, st, st.model_name, seed)
        else:
            load_safetensors(model, st, st.model_name, spec)
        st.train()
    return stages, hf_ties(model, n_stages)
