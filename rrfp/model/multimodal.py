"""A small multimodal model: a ViT-style image encoder on the first stage, the GPT decoder after it.

Each sample holds ``k`` images (0-6 here, 8x8 grey digits) and a caption naming them. The
encoder turns every image of the microbatch into one token (a CLS readout after bidirectional
attention over 2x2-pixel patches), so its cost follows the microbatch's image count, as the
paper's multimodal workloads do. The decoder sees ``[image slots..., caption bytes...]``: the
first stage places each sample's image tokens in ``K = max k`` slots (a learned "no image"
vector fills the rest) before the caption's byte embeddings, and the causal GPT blocks and
head of :mod:`rrfp.model.gpt` predict the caption.

Stages: the units are ``[encoder] + decoder blocks``, split contiguously like the GPT's layers
(:func:`~rrfp.model.gpt.stage_layer_ranges`); stage 0 always holds the encoder and the
embeddings, the last stage the final norm and head.

I/O (``b`` samples, ``N`` images in the microbatch, ``T`` caption positions, ``D = d_model``):

- stage 0: ``forward(images float32 [N, 8, 8], counts int64 [b], tokens int64 [b, T])``
  -> hidden ``[b, K + T, D]`` (logits ``[b, K + T, 256]`` if it is also the last stage);
- later stages: hidden -> hidden, the last one -> logits ``[b, K + T, 256]``.

Every weight is drawn from its own generator seeded from its name in the one-stage model (as
:mod:`rrfp.model.gpt`), so any process builds bit-identical stages without building the others.
"""

from __future__ import annotations

import torch
from torch import nn

from .gpt import GPTConfig, _meta_block, _meta_embeddings, _meta_head, init_fill, stage_layer_ranges
from .meta import materialise
from .spec import MULTIMODAL, MultimodalConfig

__all__ = ["MultimodalConfig", "MULTIMODAL", "MultimodalStage", "build_multimodal_stage", "multimodal_units"]

IMAGE_SIDE = 8
PATCH = 2


def multimodal_units(cfg: MultimodalConfig, n_stages: int) -> list[range]:
    """Per stage, the units it holds (unit 0 the encoder, unit ``1 + i`` decoder block ``i``).

    Raises:
        ValueError: ``n_stages`` outside ``1..cfg.n_units``.
    """
    if not 1 <= n_stages <= cfg.n_units:
        raise ValueError(f"multimodal model: {n_stages} stages: expected 1 to {cfg.n_units} (encoder + {cfg.decoder.n_layer} decoder blocks)")
    return stage_layer_ranges(cfg.n_units, n_stages)


class ImageEncoder(nn.Module):
    """ViT-style: 2x2 patches of an 8x8 image, a CLS token, bidirectional blocks, the CLS
    output projected to the decoder width. ``[N, 8, 8] -> [N, D]``."""

    def __init__(self, cfg: MultimodalConfig) -> None:
        super().__init__()
        w, d = cfg.enc_width, cfg.decoder.d_model
        n_patch = (IMAGE_SIDE // PATCH) ** 2
        with torch.device("meta"):  # materialised by the stage, per parameter name
            self.patch = nn.Linear(PATCH * PATCH, w)
            layer = nn.TransformerEncoderLayer(w, cfg.enc_heads, 4 * w, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, cfg.enc_layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(w)
            self.proj = nn.Linear(w, d)
            self.cls = nn.Parameter(torch.empty(1, 1, w))
            self.pos = nn.Parameter(torch.empty(1, n_patch + 1, w))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        p = images.reshape(n, IMAGE_SIDE // PATCH, PATCH, IMAGE_SIDE // PATCH, PATCH).permute(0, 1, 3, 2, 4)
        x = self.patch(p.reshape(n, -1, PATCH * PATCH))
        x = torch.cat([self.cls.expand(n, -1, -1), x], dim=1) + self.pos
        return self.proj(self.norm(self.blocks(x)[:, 0]))


class MultimodalStage(nn.Module):
    """One pipeline stage of the multimodal model (I/O in the module docstring).

    Attributes:
        stage_param_names: this module's parameter names -> the same parameter's name in the
            one-stage model (``build_multimodal_stage(cfg, 1, 0)``).

    Raises (forward):
        ValueError: stage 0 given images that are not ``[N, 8, 8]``, counts that do not sum
            to ``N`` or exceed ``max_images``, or tokens that are not ``[b, T]`` int64; a later
            stage given a hidden tensor that is not ``[b, L, D]``.
    """

    def __init__(self, cfg: MultimodalConfig, stage_index: int, n_stages: int, seed: int = 0) -> None:
        super().__init__()
        units = multimodal_units(cfg, n_stages)[stage_index]
        self.cfg = cfg
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == n_stages - 1
        d = cfg.decoder
        if self.is_first:
            self.encoder = ImageEncoder(cfg)
            self.tok_emb, self.pos_emb = _meta_embeddings(d)
            self.no_image = nn.Parameter(torch.zeros(d.d_model))
        # Unit u >= 1 is decoder block u - 1.
        self.blocks = nn.ModuleList(_meta_block(d) for u in units if u >= 1)
        if self.is_last:
            self.ln_f, self.head = _meta_head(d)
        # This module's parameter names -> the one-stage model's (blocks renumbered).
        first_block = units.start - 1 if units.start >= 1 else 0
        self.stage_param_names = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, j, rest = name.split(".", 2)
                name_full = f"blocks.{first_block + int(j)}.{rest}"
            else:
                name_full = name
            self.stage_param_names[name] = name_full
        materialise(self, init_fill(d, seed, self.stage_param_names.__getitem__))

    def _embed(self, images: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if images.dim() != 3 or tuple(images.shape[1:]) != (IMAGE_SIDE, IMAGE_SIDE):
            raise ValueError(f"images must have shape [N, {IMAGE_SIDE}, {IMAGE_SIDE}], got {tuple(images.shape)}")
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be int64 [b, T], got {tokens.dtype} {tuple(tokens.shape)}")
        b = tokens.shape[0]
        if counts.shape != (b,) or int(counts.sum()) != images.shape[0] or (b and int(counts.max()) > self.cfg.max_images):
            raise ValueError(f"counts {counts.tolist()}: expected {b} counts of 0..{self.cfg.max_images} summing to {images.shape[0]} images")
        k = int(counts.max()) if b else 0
        d = self.cfg.decoder.d_model
        slots = self.no_image.expand(b, k, d)
        if images.shape[0]:
            enc = self.encoder(images)
            # Image j of sample i goes to slot j: a mask over [b, k] in row-major order
            # matches the packed order of `images`.
            mask = torch.arange(k).unsqueeze(0) < counts.unsqueeze(1)
            slots = slots.masked_scatter(mask.unsqueeze(-1), enc)
        x = torch.cat([slots, self.tok_emb(tokens)], dim=1)
        if x.shape[1] > self.pos_emb.num_embeddings:
            raise ValueError(f"{k} image slots + {tokens.shape[1]} tokens exceed max_len={self.pos_emb.num_embeddings}")
        return x + self.pos_emb(torch.arange(x.shape[1]))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self._embed(*inputs)
        else:
            (x,) = inputs
            if x.dim() != 3 or x.shape[-1] != self.cfg.decoder.d_model:
                raise ValueError(f"stage {self.stage_index} expects hidden [b, L, {self.cfg.decoder.d_model}], got {tuple(x.shape)}")
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def build_multimodal_stage(cfg: MultimodalConfig, n_stages: int, stage_index: int, seed: int = 0) -> MultimodalStage:
    """Stage ``stage_index`` of ``n_stages`` (weights independent of the split).

    Raises:
        ValueError: ``n_stages`` outside ``1..cfg.n_units`` or a bad index.
    """
    if not 0 <= stage_index < n_stages:
        raise ValueError(f"stage {stage_index}: expected 0 <= stage < {n_stages}")
    return MultimodalStage(cfg, stage_index, n_stages, seed)
