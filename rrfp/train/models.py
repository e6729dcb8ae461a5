"""``rrfp train --model``: which models a name gives, checked before any rank starts, and this
rank's text-model stages (the byte-level GPT presets, or ``hf:<name or folder>``,
:mod:`rrfp.model.hf`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UsageError

HF_PREFIX = "hf:"


def add_flags(p: argparse.ArgumentParser) -> None:
    """``--activation-checkpointing``."""
    from ..model.spec import AC_MODES

    p.add_argument("--activation-checkpointing", choices=AC_MODES, default="none",
                   help="recompute each layer's activations in the backward: full (keep each layer's inputs) or "
                   "selective (also keep its matmul and attention outputs); the memory budget counts what is kept")


def check_flags(args: argparse.Namespace) -> None:
    """Raises UsageError: activation checkpointing with the multimodal workload (no layer list)."""
    if getattr(args, "activation_checkpointing", "none") != "none" and args.model == "multimodal":
        raise UsageError(f"--activation-checkpointing={args.activation_checkpointing} with --model multimodal: "
                         "expected none (checkpointing covers the text models' layers)")


def is_hf(model: str) -> bool:
    """Whether ``--model`` names a Hugging Face model (``hf:gpt2``, ``hf:./my-model``)."""
    return model.startswith(HF_PREFIX)


def hf_layers(args: argparse.Namespace) -> int:
    """The decoder layers of ``--model hf:<spec>``, checked without building it.

    Raises:
        UsageError: an unknown name, a folder without a readable ``config.json`` or without
            safetensors weights (:func:`hf_weights_check`), an unsupported model type, positions
            fewer than ``--max-len``, ``--tp`` above 1, or ``transformers`` not installed.
    """
    import importlib.util

    from ..model.spec import FAMILY_NAMES, HF_PRESETS, preset_layers

    spec = args.model[len(HF_PREFIX):]
    flag = f"--model={args.model!r}"
    if importlib.util.find_spec("transformers") is None:  # found, not imported: that takes seconds
        raise UsageError(f"{flag}: needs the transformers package (pip install 'rrfp[hf]')")
    if getattr(args, "tp", 1) > 1:
        raise UsageError(f"{flag} with --tp {args.tp}: tensor parallelism covers the byte-level GPT presets; "
                         "expected --tp 1")
    if spec in HF_PRESETS:
        return preset_layers(spec)
    path = Path(spec)
    if not path.is_dir():
        raise UsageError(f"{flag}: expected one of {', '.join(HF_PREFIX + n for n in HF_PRESETS)}, "
                         f"or {HF_PREFIX}FOLDER holding a saved model (config.json and weights)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: cannot read {path / 'config.json'}: {e}") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in FAMILY_NAMES:
        raise UsageError(f"{flag}: model type {kind!r}, expected one of {', '.join(FAMILY_NAMES)}")
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if isinstance(positions, int) and positions < args.max_len:
        raise UsageError(f"--max-len={args.max_len} exceeds the {positions} positions of {flag}")
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    if not isinstance(layers, int) or layers < 1:
        raise UsageError(f"{flag}: config.json gives no layer count (num_hidden_layers or n_layer)")
    hf_weights_check(path, flag)
    return layers


def hf_weights_check(path: Path, flag: str) -> None:
    """A saved model's weights, as every rank will read its stages' tensors from them: the
    safetensors files (one, or the shards its index names) exist and their headers read.
    Reads no tensor and does not import torch.

    Raises:
        UsageError: one line naming the folder or file and what was expected.
    """
    from ..model.hf_weights import weights_problem

    if (problem := weights_problem(path)) is not None:
        raise UsageError(f"{flag}: {problem}")


def text_stages(args: argparse.Namespace, n_stages: int, stage_ids: list[int]):
    """This rank's stage modules of a text model and the pipeline's ``tied=`` (None when
    no weight is shared across stages). Only these stages are built: on the meta device, then
    materialised alone (a GPT preset's parameters drawn per name, ``hf:`` tensors read from
    the folder's safetensors files), so each holds what the unsplit model holds under the same
    names, whatever ``--pp``, ``--virtual-stages`` or ``--placement``."""
    if is_hf(args.model):
        from ..model.hf import build_hf_stages

        return build_hf_stages(args.model[len(HF_PREFIX):], n_stages, stage_ids, args.seed, args.max_len)
    import dataclasses

    from ..model.gpt import GPT_PRESETS, build_stage

    cfg = dataclasses.replace(GPT_PRESETS[args.model], max_len=args.max_len)
    return [build_stage(cfg, n_stages, s, args.seed) for s in stage_ids], None
