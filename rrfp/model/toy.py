"""A tiny model whose stages exchange tuples of mixed-dtype tensors.

It exists to test the runtime's handling of stage I/O that is more than one
float tensor: every stage boundary carries

    ``(x, ids, mask, scale)``
    * ``x``     float32 ``[B, d]``, requires grad after stage 0 (the activation),
    * ``ids``   int64   ``[B]`` in ``0..vocab_size-1`` (no grad possible),
    * ``mask``  bool    ``[B]`` (no grad possible),
    * ``scale`` float32 ``[B]``, never requires grad (a float side input),

passed either as four positional arguments (how a runtime calls
``stage(*outputs)``) or as one tuple, and every layer uses all four. ``ids``
and ``mask`` change from layer to layer so a runtime that forwards a stale
tensor gives different results than the reference; ``scale`` is passed
through as the very same tensor.

Each layer computes
``x' = tanh(linear(x)) * scale[:, None] + embedding(ids) * mask[:, None]``,
``ids' = (ids + 1) % vocab_size`` and ``mask' = ~mask``; the last stage ends
with a linear head returning float32 ``[B, n_out]`` scores. All tensors have
the batch dimension first, so a batch splits into microbatches along dim 0.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rrfp.model.gpt import _full_param_name, stage_layer_ranges

__all__ = [
    "ToyConfig",
    "ToyLayer",
    "ToyModel",
    "ToyStage",
    "ToyIO",
    "split_toy",
    "build_toy_stage",
    "toy_loss",
    "toy_batch",
]

ToyIO = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(x float32 [B, d], ids int64 [B], mask bool [B], scale float32 [B])``."""


@dataclass
class ToyConfig:
    """Sizes of :class:`ToyModel`.

    Attributes:
        d: width of ``x``.
        vocab_size: number of distinct ``ids``.
        n_layer: number of layers; the most stages the model splits into.
        n_out: width of the final output (number of classes for :func:`toy_loss`).

    Raises:
        ValueError: if a size is not positive.
    """

    d: int = 8
    vocab_size: int = 16
    n_layer: int = 4
    n_out: int = 4

    def __post_init__(self) -> None:
        for name in ("d", "vocab_size", "n_layer", "n_out"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"ToyConfig.{name}={value} must be >= 1")


class ToyLayer(nn.Module):
    """One layer: :data:`ToyIO` -> :data:`ToyIO` (formula in the module docstring)."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.linear = nn.Linear(cfg.d, cfg.d)
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d)

    def forward(self, io: ToyIO) -> ToyIO:
        x, ids, mask, scale = io
        x = torch.tanh(self.linear(x)) * scale.unsqueeze(-1)
        x = x + self.embedding(ids) * mask.unsqueeze(-1).to(x.dtype)
        return x, (ids + 1) % self.vocab_size, ~mask, scale


def _as_io(args: tuple, d: int) -> ToyIO:
    # The runtime calls stage(*outputs_of_previous_stage) while a direct caller
    # naturally passes the tuple itself; accept both spellings.
    io = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if len(io) != 4 or not all(isinstance(t, torch.Tensor) for t in io):
        raise ValueError(
            "toy stages take (x, ids, mask, scale), as four tensors or one tuple"
        )
    x, ids, mask, scale = io
    b = x.shape[0] if x.dim() else -1
    if (
        x.dtype != torch.float32
        or x.shape != (b, d)
        or ids.dtype != torch.int64
        or ids.shape != (b,)
        or mask.dtype != torch.bool
        or mask.shape != (b,)
        or scale.dtype != torch.float32
        or scale.shape != (b,)
    ):
        raise ValueError(
            f"expected (x float32 [B, {d}], ids int64 [B], mask bool [B], scale float32 [B]), "
            f"got {[(tuple(t.shape), t.dtype) for t in io]}"
        )
    return tuple(io)


class ToyModel(nn.Module):
    """Full reference model: ``forward(x, ids, mask, scale) -> float32 [B, n_out]``.

    Like the stages, ``forward`` takes the four tensors either as separate
    arguments or as one tuple.

    Args:
        cfg: sizes.
        seed: initialisation seed; equal ``(cfg, seed)`` give bit-identical
            weights, without touching torch's global RNG.

    Raises (forward):
        ValueError: if the input is not a :data:`ToyIO` tuple of the documented dtypes/shapes.
    """

    def __init__(self, cfg: ToyConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        cfg = cfg or ToyConfig()
        self.cfg = cfg
        # fork_rng keeps the default nn init from advancing the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(ToyLayer(cfg) for _ in range(cfg.n_layer))
            self.head = nn.Linear(cfg.d, cfg.n_out)

    def forward(self, *io: torch.Tensor | ToyIO) -> torch.Tensor:
        io = _as_io(io, self.cfg.d)
        for layer in self.layers:
            io = layer(io)
        return self.head(io[0])


class ToyStage(nn.Module):
    """A contiguous range of :class:`ToyModel` layers (the last stage adds the head).

    ``forward(x, ids, mask, scale)`` (the runtime's ``stage(*outputs)`` call)
    or ``forward((x, ids, mask, scale))`` returns a :data:`ToyIO` tuple, or
    float32 ``[B, n_out]`` on the last stage.

    Attributes:
        stage_index, n_stages, layer_range, is_first, is_last: as for ``GPTStage``.
        stage_param_names: this module's parameter names -> :class:`ToyModel`'s.

    Raises (forward):
        ValueError: if the input is not a :data:`ToyIO` tuple of the documented dtypes/shapes.
    """

    def __init__(
        self,
        cfg: ToyConfig,
        stage_index: int,
        n_stages: int,
        layers: range,
        modules: list[ToyLayer],
        head: nn.Linear | None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.layer_range = layers
        self.is_first = stage_index == 0
        self.is_last = head is not None
        self.layers = nn.ModuleList(modules)
        if head is not None:
            self.head = head
        self.stage_param_names = {
            name: _full_param_name(name, layers.start, prefix="layers")
            for name, _ in self.named_parameters()
        }

    def forward(self, *io: torch.Tensor | ToyIO) -> ToyIO | torch.Tensor:
        io = _as_io(io, self.cfg.d)
        for layer in self.layers:
            io = layer(io)
        return self.head(io[0]) if self.is_last else io


def split_toy(model: ToyModel, n_stages: int) -> list[ToyStage]:
    """Split a :class:`ToyModel` into stages holding deep copies of its weights.

    Same rules as ``split_gpt``: contiguous, as-even-as-possible layer ranges,
    no shared parameters, chaining the stages equals ``model.forward`` exactly.

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_stages > cfg.n_layer``.
    """
    ranges = stage_layer_ranges(model.cfg.n_layer, n_stages)
    return [
        ToyStage(
            model.cfg,
            s,
            n_stages,
            layers,
            [copy.deepcopy(model.layers[i]) for i in layers],
            copy.deepcopy(model.head) if s == n_stages - 1 else None,
        ).train(model.training)
        for s, layers in enumerate(ranges)
    ]


def build_toy_stage(
    cfg: ToyConfig, n_stages: int, stage_index: int, seed: int = 0
) -> ToyStage:
    """``split_toy(ToyModel(cfg, seed), n_stages)[stage_index]`` (the model is tiny).

    Raises:
        ValueError: on a bad ``n_stages`` or ``stage_index``.
    """
    stage_layer_ranges(cfg.n_layer, n_stages)
    if not 0 <= stage_index < n_stages:
        raise ValueError(f"stage_index={stage_index} is outside 0..{n_stages - 1}")
    return split_toy(ToyModel(cfg, seed), n_stages)[stage_index]


def toy_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of scores ``[B, n_out]`` against int64 class ids ``[B]``.

    Microbatch losses combine to the batch loss with weights ``b_m / B``.
    """
    return F.cross_entropy(output, targets)


def toy_batch(
    cfg: ToyConfig, batch_size: int, seed: int = 0
) -> tuple[ToyIO, torch.Tensor]:
    """A deterministic random batch: ``((x, ids, mask, scale), targets int64 [B])``.

    ``x`` is float32 ``[B, d]`` without grad, ``scale`` lies in ``[0.5, 1.5)``,
    ``mask`` is mixed True/False, ``targets`` are in ``0..n_out-1``.

    Raises:
        ValueError: if ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.d, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (batch_size,), generator=gen)
    mask = torch.rand(batch_size, generator=gen) < 0.5
    scale = torch.rand(batch_size, generator=gen) + 0.5
    targets = torch.randint(0, cfg.n_out, (batch_size,), generator=gen)
    return (x, ids, mask, scale), targets
