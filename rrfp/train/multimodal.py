"""The ``rrfp train --model multimodal`` workload: stage modules and batches.

The model is :mod:`rrfp.model.multimodal` (image encoder on stage 0, GPT decoder after it);
the data :mod:`rrfp.data.digits` (scikit-learn's digits, 0-6 images and a caption per sample).
"""

from __future__ import annotations

from torch import nn

from ..data.batches import BatchSampler
from ..data.digits import DigitMicrobatch, load_digit_images, make_digit_microbatches, make_digit_samples
from ..model.multimodal import MULTIMODAL, build_multimodal_stage
from .early import SAMPLE_POOL


def multimodal_stages(n_stages: int, stage_ids: list[int], seed: int) -> list[nn.Module]:
    """This rank's stage modules.

    Raises:
        ValueError: more stages than the model's units (encoder + decoder blocks).
    """
    return [build_multimodal_stage(MULTIMODAL, n_stages, s, seed) for s in stage_ids]


class DigitBatches:
    """Step ``k``'s microbatches; every process with the same ``(batch_size, seed)`` draws
    the same ones (so the first and last stage agree without communicating).

    Raises:
        ValueError: ``batch_size`` outside ``1..8192``.
    """

    def __init__(self, batch_size: int, seed: int) -> None:
        self.images, labels = load_digit_images()
        self.sampler = BatchSampler(make_digit_samples(labels, SAMPLE_POOL, seed), batch_size, seed)

    def microbatches(self, step: int, n_microbatches: int) -> list[DigitMicrobatch]:
        return make_digit_microbatches(self.sampler.batch(step), self.images, n_microbatches)
