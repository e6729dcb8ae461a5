"""Multimodal samples from scikit-learn's handwritten digits (1797 grey 8x8 images, shipped
with the package: ``sklearn.datasets.load_digits``, no download).

A sample holds ``k`` images (``k`` uniform in ``0..max_images``) drawn at random from the set
and a caption naming them in order: ``b">3 7 1."`` (``b">."`` for none). The model reads the
images and ``caption[:-1]`` and predicts ``caption[1:]``; image slots carry no loss. Image
counts differ per sample, so the encoder's work differs per microbatch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from rrfp.model.gpt import IGNORE_INDEX, count_tokens

__all__ = ["DigitSample", "DigitMicrobatch", "load_digit_images", "make_digit_samples", "make_digit_microbatches"]

PAD_ID = 0


def load_digit_images() -> tuple[torch.Tensor, list[int]]:
    """The 1797 images as float32 ``[1797, 8, 8]`` in ``[0, 1]`` and their labels 0-9."""
    from sklearn.datasets import load_digits  # deferred: only the multimodal workload needs it

    d = load_digits()
    return torch.tensor(d.images, dtype=torch.float32) / 16.0, [int(x) for x in d.target]


@dataclass(frozen=True)
class DigitSample:
    """Indices of the sample's images in the set, and its caption bytes."""

    images: tuple[int, ...]
    caption: bytes


def make_digit_samples(labels: Sequence[int], n: int, seed: int = 0, max_images: int = 6) -> list[DigitSample]:
    """``n`` samples, each ``0..max_images`` images drawn with ``random.Random(seed)``.

    Raises:
        ValueError: ``n < 1`` or ``max_images < 0``.
    """
    if n < 1 or max_images < 0:
        raise ValueError(f"digit samples: n={n}, max_images={max_images}: expected n >= 1, max_images >= 0")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        idx = tuple(rng.randrange(len(labels)) for _ in range(rng.randint(0, max_images)))
        out.append(DigitSample(idx, b">" + " ".join(str(labels[i]) for i in idx).encode() + b"."))
    return out


@dataclass
class DigitMicrobatch:
    """One microbatch: stage 0's inputs and the last stage's targets.

    Attributes:
        images: float32 ``[N, 8, 8]``, the samples' images packed in order.
        counts: int64 ``[b]``, images per sample.
        tokens: int64 ``[b, T]``, ``caption[:-1]`` padded with 0.
        targets: int64 ``[b, K + T]``: ``IGNORE_INDEX`` on the ``K = max(counts)`` image
            slots and on padding, ``caption[1:]`` after them.
    """

    images: torch.Tensor
    counts: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.images, self.counts, self.tokens

    @property
    def n_tokens(self) -> int:
        return count_tokens(self.targets)


def collate(samples: Sequence[DigitSample], images: torch.Tensor) -> DigitMicrobatch:
    """Pack ``samples`` (their image indices into ``images``) into one microbatch."""
    b = len(samples)
    k = max(len(s.images) for s in samples)
    t = max(len(s.caption) for s in samples) - 1
    tokens = torch.full((b, t), PAD_ID, dtype=torch.int64)
    targets = torch.full((b, k + t), IGNORE_INDEX, dtype=torch.int64)
    for i, s in enumerate(samples):
        c = torch.tensor(list(s.caption), dtype=torch.int64)
        tokens[i, : len(c) - 1] = c[:-1]
        targets[i, k : k + len(c) - 1] = c[1:]
    idx = [j for s in samples for j in s.images]
    imgs = images[idx] if idx else images.new_zeros((0,) + tuple(images.shape[1:]))
    counts = torch.tensor([len(s.images) for s in samples], dtype=torch.int64)
    return DigitMicrobatch(imgs, counts, tokens, targets)


def make_digit_microbatches(samples: Sequence[DigitSample], images: torch.Tensor, n_microbatches: int) -> list[DigitMicrobatch]:
    """Split a batch into ``n_microbatches`` contiguous microbatches (sizes differ by at most 1).

    Raises:
        ValueError: more microbatches than samples.
    """
    from rrfp.data.batches import microbatch_sizes

    out, start = [], 0
    for size in microbatch_sizes(len(samples), n_microbatches):
        out.append(collate(samples[start : start + size], images))
        start += size
    return out
