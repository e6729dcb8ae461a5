"""Models for rrfp: a byte-level GPT with its pipeline split, and a tiny mixed-I/O toy model."""

from rrfp.model.gpt import (
    GPT,
    GPT_PRESETS,
    IGNORE_INDEX,
    GPTConfig,
    GPTStage,
    build_stage,
    count_tokens,
    lm_loss,
    split_gpt,
    stage_layer_ranges,
)
from rrfp.model.toy import (
    ToyConfig,
    ToyIO,
    ToyModel,
    ToyStage,
    build_toy_stage,
    split_toy,
    toy_batch,
    toy_loss,
)

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "IGNORE_INDEX",
    "GPTConfig",
    "GPTStage",
    "build_stage",
    "count_tokens",
    "lm_loss",
    "split_gpt",
    "stage_layer_ranges",
    "ToyConfig",
    "ToyIO",
    "ToyModel",
    "ToyStage",
    "build_toy_stage",
    "split_toy",
    "toy_batch",
    "toy_loss",
]
