"""Batches of byte samples, microbatch splitting and padding.

A batch is a list of samples (``bytes``); the pipeline splits it into
contiguous microbatches and pads each only to its own longest sample, so
microbatches have different sequence lengths ``T_m`` (and hence different
compute costs). The single-process reference instead pads the whole batch
with :func:`pad_batch`; because the model is causal and padded targets are
ignored, both give the same loss when microbatch losses are weighted by their
token counts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from rrfp.data.text import PAD_ID
from rrfp.model.gpt import IGNORE_INDEX, count_tokens

__all__ = ["Microbatch", "make_microbatches", "pad_batch", "microbatch_sizes", "BatchSampler"]


@dataclass
class Microbatch:
    """One microbatch of ``b`` samples padded to its own length ``T_m``.

    ``T_m`` is the length of its longest sample minus one. Sample ``i`` of
    length ``L`` fills ``tokens[i, :L-1] = sample[:-1]`` and
    ``targets[i, :L-1] = sample[1:]``; the rest is :data:`PAD_ID` in tokens
    and ``IGNORE_INDEX`` (-100) in targets.

    Attributes:
        tokens: int64 ``[b, T_m]`` model input.
        targets: int64 ``[b, T_m]`` next-token targets.
    """

    tokens: torch.Tensor
    targets: torch.Tensor

    @property
    def inputs(self) -> tuple[torch.Tensor]:
        """Stage 0's inputs: ``(tokens,)``."""
        return (self.tokens,)

    @property
    def n_tokens(self) -> int:
        """Number of real (non-padding) target positions."""
        return count_tokens(self.targets)

    @property
    def size(self) -> int:
        """Number of samples ``b``."""
        return self.tokens.shape[0]


def _check_samples(samples: Sequence[bytes]) -> None:
    if len(samples) == 0:
        raise ValueError("the batch is empty: need at least one sample")
    for i, s in enumerate(samples):
        if len(s) < 2:
            raise ValueError(
                f"sample {i} has {len(s)} byte(s): each sample needs at least 2 "
                "(one input and one target position)"
            )


def pad_batch(samples: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a whole batch to its longest sample.

    Args:
        samples: ``B`` samples of at least 2 bytes each.

    Returns:
        ``(tokens, targets)``, both int64 ``[B, T]`` with ``T`` = longest
        sample length - 1; padding is :data:`PAD_ID` / ``IGNORE_INDEX``.

    Raises:
        ValueError: if ``samples`` is empty or a sample is shorter than 2 bytes.
    """
    _check_samples(samples)
    t = max(len(s) for s in samples) - 1
    tokens = torch.full((len(samples), t), PAD_ID, dtype=torch.int64)
    targets = torch.full((len(samples), t), IGNORE_INDEX, dtype=torch.int64)
    for i, s in enumerate(samples):
        row = torch.frombuffer(bytearray(s), dtype=torch.uint8).to(torch.int64)
        tokens[i, : len(s) - 1] = row[:-1]
        targets[i, : len(s) - 1] = row[1:]
    return tokens, targets


def microbatch_sizes(batch_size: int, n_microbatches: int) -> list[int]:
    """Sizes of ``n_microbatches`` contiguous microbatches, like ``torch.tensor_split``.

    The first ``batch_size % n_microbatches`` microbatches get one sample more.

    Raises:
        ValueError: if ``n_microbatches < 1`` or ``n_microbatches > batch_size``.
    """
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1")
    if n_microbatches > batch_size:
        raise ValueError(
            f"n_microbatches={n_microbatches} exceeds the batch size {batch_size}: "
            "each microbatch needs at least one sample"
        )
    base, extra = divmod(batch_size, n_microbatches)
    return [base + (1 if m < extra else 0) for m in range(n_microbatches)]


def make_microbatches(samples: Sequence[bytes], n_microbatches: int) -> list[Microbatch]:
    """Split a batch into contiguous microbatches, each padded to its own longest sample.

    Microbatch ``m`` holds the samples ``torch.tensor_split`` would give it,
    in order. Weighting each microbatch's ``lm_loss`` by
    ``mb.n_tokens / sum(mb.n_tokens)`` reproduces the loss of
    :func:`pad_batch` on the whole batch.

    Args:
        samples: ``B`` samples of at least 2 bytes each.
        n_microbatches: number of microbatches, ``1 <= n_microbatches <= B``.

    Returns:
        ``n_microbatches`` :class:`Microbatch` objects.

    Raises:
        ValueError: if ``samples`` is empty, a sample is shorter than 2 bytes,
            or ``n_microbatches`` is outside ``1..B``.
    """
    _check_samples(samples)
    microbatches, start = [], 0
    for size in microbatch_sizes(len(samples), n_microbatches):
        microbatches.append(Microbatch(*pad_batch(samples[start : start + size])))
        start += size
    return microbatches


class BatchSampler:
    """Endless, deterministic stream of batches drawn from a sample list.

    Every epoch visits the samples in a fresh order that depends only on
    ``(seed, epoch)``; each epoch yields ``len(samples) // batch_size``
    batches and drops its remainder, so all batches have ``batch_size``
    samples and no batch mixes two epochs. Iterating starts at step 0 every
    time; :meth:`batch` gives random access, so processes that share
    ``(samples, batch_size, seed)`` (e.g. the first and last pipeline stage)
    agree on every step's batch without communicating.

    Args:
        samples: the sample pool (not copied; do not mutate it while sampling).
        batch_size: samples per batch, ``1 <= batch_size <= len(samples)``.
        seed: shuffling seed.

    Raises:
        ValueError: if ``batch_size`` is outside ``1..len(samples)``.
    """

    def __init__(self, samples: Sequence[bytes], batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if batch_size > len(samples):
            raise ValueError(
                f"batch_size={batch_size} exceeds the number of samples {len(samples)}"
            )
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = -1
        self._order: list[int] = []

    @property
    def batches_per_epoch(self) -> int:
        """Batches per epoch: ``len(samples) // batch_size``."""
        return len(self.samples) // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            # A string seed is hashed with SHA-512 by random.Random, so the
            # order is the same in every process and Python run.
            order = list(range(len(self.samples)))
            random.Random(f"rrfp.BatchSampler:{self.seed}:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def batch(self, step: int) -> list[bytes]:
        """The batch of global step ``step`` (0-based).

        Raises:
            ValueError: if ``step < 0``.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, index = divmod(step, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        start = index * self.batch_size
        return [self.samples[i] for i in order[start : start + self.batch_size]]

    def __iter__(self) -> Iterator[list[bytes]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
