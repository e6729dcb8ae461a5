"""A small byte-level GPT and its pipeline split into stage modules.

The model is the reference workload of rrfp: a decoder-only transformer over
byte tokens (ids 0..255) whose layers are split into contiguous pipeline
stages. Every stage owns a disjoint set of parameters (the LM head is not tied
to the token embedding), so a stage's gradients can be compared one-to-one
with the full model's through ``stage_param_names``.

Initialisation is deterministic and independent of torch's global RNG: every
parameter draws its values from its own ``torch.Generator`` seeded from
``(seed, its name in the unsplit GPT)`` (:func:`init_fill`). Two processes that
build the same configuration with the same seed therefore get bit-identical
weights, and :func:`build_stage` builds one stage on the meta device and
initialises only its parameters: every split (any number of stages or virtual
stages, any placement, TP) holds the unsplit model's values under its names.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .meta import Fill, materialise
from .spec import GPT_PRESETS, GPTConfig

__all__ = [
    "IGNORE_INDEX",
    "GPTConfig",
    "GPT_PRESETS",
    "GPT",
    "GPTStage",
    "Block",
    "stage_layer_ranges",
    "split_gpt",
    "build_stage",
    "init_fill",
    "lm_loss",
    "count_tokens",
]

IGNORE_INDEX = -100
"""Target id of positions that carry no loss (padding); matches ``F.cross_entropy``."""

_INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """GELU feed-forward network: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff_width)
        self.proj = nn.Linear(cfg.ff_width, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --- deterministic construction ---------------------------------------------
#
# Modules are built on the meta device (no storage, no draw from torch's global RNG) and then
# materialised tensor by tensor (rrfp.model.meta): every weight is drawn from its own generator,
# seeded from (seed, the unsplit model's name of that parameter). A stage, a virtual stage or a
# TP rank's full stage therefore holds exactly the values the unsplit GPT holds under the same
# names, whatever the split, and only its own tensors are ever allocated.


def _param_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"rrfp.gpt:{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


_RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


def init_fill(cfg: GPTConfig, seed: int, model_name: Callable[[str], str] = str) -> Fill:
    """The :data:`~rrfp.model.meta.Fill` of a GPT part: LayerNorms 1 and 0, biases 0, every other
    weight ``N(0, 0.02)`` drawn from a generator seeded from ``(seed, model_name(name))``, the
    residual projections (``attn.proj``, ``mlp.proj``) with the GPT-2 scaling
    ``0.02 / sqrt(2 n_layer)`` so the residual stream's variance stays O(1) at initialisation.

    Args:
        cfg: the model configuration (``n_layer`` sets the residual scaling).
        seed: the initialisation seed.
        model_name: a local name -> the unsplit :class:`GPT`'s name of the same parameter.
    """
    resid_std = _INIT_STD / math.sqrt(2 * cfg.n_layer)

    def fill(name: str, owner: nn.Module, meta: torch.Tensor) -> torch.Tensor:
        name = model_name(name)
        if isinstance(owner, nn.LayerNorm) and name.endswith(".weight"):
            return torch.ones(meta.shape, dtype=meta.dtype)
        if name.endswith(".bias"):
            return torch.zeros(meta.shape, dtype=meta.dtype)
        std = resid_std if name.endswith(_RESIDUAL_PROJECTIONS) else _INIT_STD
        return torch.empty(meta.shape, dtype=meta.dtype).normal_(0.0, std, generator=_param_generator(seed, name))

    return fill


def _meta_embeddings(cfg: GPTConfig) -> tuple[nn.Embedding, nn.Embedding]:
    with torch.device("meta"):
        return nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.max_len, cfg.d_model)


def _meta_head(cfg: GPTConfig) -> tuple[nn.LayerNorm, nn.Linear]:
    with torch.device("meta"):
        return nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)


def _meta_block(cfg: GPTConfig) -> Block:
    with torch.device("meta"):
        return Block(cfg)


def _embed(
    tok_emb: nn.Embedding, pos_emb: nn.Embedding, tokens: torch.Tensor
) -> torch.Tensor:
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape [B, T], got {tuple(tokens.shape)}")
    if tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64, got {tokens.dtype}")
    t = tokens.shape[1]
    if t > pos_emb.num_embeddings:
        raise ValueError(
            f"sequence length T={t} exceeds max_len={pos_emb.num_embeddings}"
        )
    pos = torch.arange(t, device=tokens.device)
    return tok_emb(tokens) + pos_emb(pos)


class GPT(nn.Module):
    """Byte-level decoder-only transformer (the single-process reference).

    Args:
        cfg: model configuration.
        seed: initialisation seed; equal ``(cfg, seed)`` give bit-identical
            weights in any process, without touching torch's global RNG.

    Parameters are named ``tok_emb.weight``, ``pos_emb.weight``,
    ``blocks.{i}.…``, ``ln_f.…`` and ``head.weight`` (no bias, not tied).
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.tok_emb, self.pos_emb = _meta_embeddings(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_meta_block(cfg) for _ in range(cfg.n_layer))
        self.ln_f, self.head = _meta_head(cfg)
        materialise(self, init_fill(cfg, seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            tokens: int64 ``[B, T]`` token ids with ``T <= cfg.max_len``.

        Returns:
            float32 logits ``[B, T, vocab_size]``; position ``t`` only sees
            tokens ``0..t`` (causal), so trailing padding does not change the
            logits of real positions.

        Raises:
            ValueError: if ``tokens`` is not a 2-D int64 tensor or ``T > max_len``.
        """
        x = self.drop(_embed(self.tok_emb, self.pos_emb, tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`GPT`: a contiguous range of blocks.

    The first stage also owns the embeddings, the last stage the final norm
    and LM head (a single-stage split owns everything). Build stages with
    :func:`split_gpt` or :func:`build_stage` rather than directly.

    I/O, with ``D = cfg.d_model``:
        * first stage: ``forward(tokens int64 [B, T]) -> hidden float32 [B, T, D]``
        * middle stage: ``forward(hidden [B, T, D]) -> hidden [B, T, D]``
        * last stage: ``forward(hidden [B, T, D]) -> logits [B, T, vocab_size]``
        * only stage: ``forward(tokens [B, T]) -> logits [B, T, vocab_size]``

    Attributes:
        cfg: the model configuration.
        stage_index: position of this stage in the pipeline, ``0..n_stages-1``.
        n_stages: number of stages the model was split into.
        layer_range: indices of the full model's blocks this stage holds.
        is_first, is_last: whether the stage holds the embeddings / the head.
        stage_param_names: maps each of this module's parameter names to the
            name of the same parameter in :class:`GPT` (e.g. ``blocks.0.mlp.fc.weight``
            of stage 1 -> ``blocks.2.mlp.fc.weight``).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        stage_index: int,
        n_stages: int,
        layers: range,
        blocks: list[Block],
        embeddings: tuple[nn.Embedding, nn.Embedding] | None,
        head: tuple[nn.LayerNorm, nn.Linear] | None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.layer_range = layers
        self.is_first = embeddings is not None
        self.is_last = head is not None
        if embeddings is not None:
            self.tok_emb, self.pos_emb = embeddings
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(blocks)
        if head is not None:
            self.ln_f, self.head = head
        self.stage_param_names = {
            name: _full_param_name(name, layers.start) for name, _ in self.named_parameters()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage (shapes in the class docstring).

        Raises:
            ValueError: on a token tensor that is not 2-D int64 or longer than
                ``max_len`` (first stage), or a hidden tensor whose last
                dimension is not ``d_model`` (other stages).
        """
        if self.is_first:
            x = self.drop(_embed(self.tok_emb, self.pos_emb, x))
        elif x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"stage {self.stage_index} expects hidden [B, T, {self.cfg.d_model}], "
                f"got {tuple(x.shape)}"
            )
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x

    def extra_repr(self) -> str:
        return (
            f"stage_index={self.stage_index}, n_stages={self.n_stages}, "
            f"layers={self.layer_range.start}..{self.layer_range.stop - 1}"
        )


def _full_param_name(stage_name: str, first_layer: int, prefix: str = "blocks") -> str:
    # Stage modules reuse the full model's attribute names, so only the layer
    # index inside the ModuleList needs shifting.
    if stage_name.startswith(prefix + "."):
        _, local, rest = stage_name.split(".", 2)
        return f"{prefix}.{first_layer + int(local)}.{rest}"
    return stage_name


def stage_layer_ranges(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous block ranges of each stage, as even as possible.

    Follows ``torch.tensor_split``: the first ``n_layer % n_stages`` stages
    hold one block more than the rest. For an interleaved schedule pass the
    total number of virtual stages (pipeline ranks x virtual stages per rank).

    Args:
        n_layer: number of transformer blocks.
        n_stages: number of pipeline stages.

    Returns:
        ``n_stages`` non-empty ranges that partition ``range(n_layer)`` in order.

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_stages > n_layer``.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages} must be >= 1")
    if n_stages > n_layer:
        raise ValueError(
            f"n_stages={n_stages} exceeds n_layer={n_layer}: "
            "each stage needs at least one transformer block"
        )
    base, extra = divmod(n_layer, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def split_gpt(model: GPT, n_stages: int) -> list[GPTStage]:
    """Split a model into ``n_stages`` pipeline stage modules.

    Each stage holds deep copies of the model's weights (equal values, fresh
    storage), so stages share no parameters with each other or with ``model``.
    Chaining the stages in order computes exactly ``model.forward`` (same ops
    in the same order, so equal bit-for-bit in fp32 on the same device).

    Args:
        model: the full model (left unchanged).
        n_stages: number of stages, ``1 <= n_stages <= cfg.n_layer``.

    Returns:
        The stage modules in pipeline order, in the mode (train/eval) of ``model``.

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_stages > cfg.n_layer``.
    """
    ranges = stage_layer_ranges(model.cfg.n_layer, n_stages)
    stages = []
    for s, layers in enumerate(ranges):
        stage = GPTStage(
            model.cfg,
            s,
            n_stages,
            layers,
            [copy.deepcopy(model.blocks[i]) for i in layers],
            copy.deepcopy((model.tok_emb, model.pos_emb)) if s == 0 else None,
            copy.deepcopy((model.ln_f, model.head)) if s == n_stages - 1 else None,
        )
        stages.append(stage.train(model.training))
    return stages


def build_stage(cfg: GPTConfig, n_stages: int, stage_index: int, seed: int = 0) -> GPTStage:
    """Build only the ``stage_index``-th of ``n_stages`` stages.

    The weights are bit-identical to ``split_gpt(GPT(cfg, seed), n_stages)[stage_index]``
    (each is drawn from a generator seeded from its name in :class:`GPT`), but the stage is
    built on the meta device and only its own parameters are allocated and initialised, so
    each pipeline rank builds its own stages independently, for any split.

    Args:
        cfg: model configuration.
        n_stages: number of stages, ``1 <= n_stages <= cfg.n_layer``.
        stage_index: which stage to build, ``0 <= stage_index < n_stages``.
        seed: initialisation seed, as for :class:`GPT`.

    Returns:
        The stage module (in train mode, on CPU).

    Raises:
        ValueError: on a bad ``n_stages`` or ``stage_index``.
    """
    ranges = stage_layer_ranges(cfg.n_layer, n_stages)
    if not 0 <= stage_index < n_stages:
        raise ValueError(f"stage_index={stage_index} is outside 0..{n_stages - 1}")
    layers = ranges[stage_index]
    stage = GPTStage(
        cfg,
        stage_index,
        n_stages,
        layers,
        [_meta_block(cfg) for _ in layers],
        _meta_embeddings(cfg) if stage_index == 0 else None,
        _meta_head(cfg) if stage_index == n_stages - 1 else None,
    )
    return materialise(stage, init_fill(cfg, seed, stage.stage_param_names.__getitem__))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over real target positions.

    Positions whose target is :data:`IGNORE_INDEX` (padding) are excluded.
    For microbatches ``m`` of one batch, ``sum_m w_m * lm_loss(logits_m, targets_m)``
    with ``w_m = count_tokens(targets_m) / total`` equals the loss of the
    whole batch (the global token mean).

    Args:
        logits: float ``[B, T, V]``.
        targets: int64 ``[B, T]``, ids in ``0..V-1`` or ``IGNORE_INDEX``.

    Returns:
        A scalar tensor in nats per token; ``0.0`` (still attached to the
        graph, with zero gradient) if no position is real, so a weight of 0
        never meets a NaN.

    Raises:
        ValueError: if the shapes disagree or ``targets`` is not int64.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_loss expects logits [B, T, V] and targets [B, T], "
            f"got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64, got {targets.dtype}")
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / max(count_tokens(targets), 1)


def count_tokens(targets: torch.Tensor) -> int:
    """Number of real target positions (``targets != IGNORE_INDEX``) of an int tensor of any shape."""
    return int((targets != IGNORE_INDEX).sum().item())
