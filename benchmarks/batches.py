"""Batches in the forms each benchmarked system takes, and PyTorch's loss (``benchmarks/compare.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as Fn

from rrfp.data.batches import make_microbatches, microbatch_sizes, pad_batch
from rrfp.data.text import PAD_ID
from rrfp.model.gpt import IGNORE_INDEX, count_tokens



@dataclass
class Batch:
    """One step's data in the forms each system takes.

    ``tokens``/``targets``/``mbid`` are the whole batch padded to the fixed length (what PyTorch's
    pipelining needs: its receive buffers have static shapes). ``rrfp_mbs``/``rrfp_targets`` are
    rrfp's per-microbatch inputs: slices of the fixed batch, or, with variable-length
    microbatches, each microbatch padded only to its own longest sample.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    mbid: torch.Tensor
    rrfp_mbs: list[tuple]
    rrfp_targets: list[torch.Tensor]
    n_tokens: int
    lengths: list[int]
    torch_args: tuple = ()  # PyTorch's stage-0 inputs (default: tokens, mbid)
    step_id: int = -1  # the round's step id (the harness sets it)

    def with_stamps(self) -> "Batch":
        """The same batch with a float64 send-time stamp input after the microbatch id (the
        communication-variability setting; stage 0 ignores its value)."""
        st = torch.zeros(self.mbid.shape[0], dtype=torch.float64)
        parts = own_storage(torch.tensor_split(st, len(self.rrfp_mbs)))
        return Batch(self.tokens, self.targets, self.mbid, [(*x, p) for x, p in zip(self.rrfp_mbs, parts)],
                     self.rrfp_targets, self.n_tokens, self.lengths, (*(self.torch_args or (self.tokens, self.mbid)), st))


def own_storage(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each part copied into its own storage. rrfp's memory budget counts a saved tensor's whole
    storage with each microbatch that saves it, so microbatches (or targets) that are views of
    one batch (``tensor_split``) would each be charged the whole batch's bytes; the meter counts
    a shared storage once. With their own storages both count the same bytes."""
    return [t.clone() for t in parts]


def _pad_to(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return Fn.pad(t, (0, length - t.shape[1]), value=value)


def make_batch(samples: Sequence[bytes], n_microbatches: int, seq_len: int, varlen: bool) -> Batch:
    tokens, targets = pad_batch(samples)
    tokens, targets = _pad_to(tokens, seq_len, PAD_ID), _pad_to(targets, seq_len, IGNORE_INDEX)
    sizes = microbatch_sizes(len(samples), n_microbatches)
    mbid = torch.repeat_interleave(torch.arange(n_microbatches), torch.tensor(sizes))
    ids = torch.tensor_split(mbid, n_microbatches)
    if varlen:
        mbs = make_microbatches(samples, n_microbatches)
        rrfp_mbs = [(mb.tokens, i) for mb, i in zip(mbs, ids)]
        rrfp_targets = [mb.targets for mb in mbs]
    else:
        rrfp_mbs = list(zip(own_storage(torch.tensor_split(tokens, n_microbatches)), ids))
        rrfp_targets = own_storage(torch.tensor_split(targets, n_microbatches))
    return Batch(tokens, targets, mbid, rrfp_mbs, rrfp_targets, count_tokens(targets), [t.shape[1] for t, _ in rrfp_mbs])


class TokenMeanLoss:
    """PyTorch-side loss: each microbatch's summed cross entropy over the batch's token count,
    so that the microbatch losses add up to the global per-token mean (``scale_grads=False``).
    rrfp computes the same with ``lm_loss`` weighted by ``count_tokens``."""

    def __init__(self) -> None:
        self.total = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        return ce / self.total
