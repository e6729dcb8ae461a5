"""Data for rrfp: real byte-level text samples, batching and microbatch padding."""

from rrfp.data.batches import (
    BatchSampler,
    Microbatch,
    make_microbatches,
    microbatch_sizes,
    pad_batch,
)
from rrfp.data.text import (
    IGNORE_INDEX,
    PAD_ID,
    default_corpus_paths,
    load_samples,
    split_paragraphs,
    split_top_level_blocks,
)

__all__ = [
    "BatchSampler",
    "Microbatch",
    "make_microbatches",
    "microbatch_sizes",
    "pad_batch",
    "IGNORE_INDEX",
    "PAD_ID",
    "default_corpus_paths",
    "load_samples",
    "split_paragraphs",
    "split_top_level_blocks",
]
