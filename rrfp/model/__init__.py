"""Models for rrfp: a byte-level GPT with its pipeline split, a tiny mixed-I/O toy model, and
Hugging Face causal LMs split into stages (:mod:`rrfp.model.hf`).

Names are imported on first use, so that reading a table of this package (``rrfp.model.spec``)
does not load torch.
"""

_LAZY = {
    **dict.fromkeys(["GPT", "GPT_PRESETS", "IGNORE_INDEX", "GPTConfig", "GPTStage", "build_stage", "count_tokens",
                     "lm_loss", "split_gpt", "stage_layer_ranges"], "rrfp.model.gpt"),
    **dict.fromkeys(["ToyConfig", "ToyIO", "ToyModel", "ToyStage", "build_toy_stage", "split_toy", "toy_batch",
                     "toy_loss"], "rrfp.model.toy"),
    "materialise": "rrfp.model.meta",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rrfp.model' has no attribute {name!r}")
