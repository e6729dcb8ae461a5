"""``rrfp train --model``: which models a name gives, checked before any rank starts, and this
rank's text-model stages (the byte-level GPT presets, or ``hf:<name or folder>``,
:mod:`rrfp.model.hf`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..errors import UsageError

HF_PREFIX = "hf:"


def hf_missing() -> str | None:
    """What is missing for a Hugging Face model (``rrfp[hf]``: transformers and safetensors),
    one phrase, or None when both are installed. Found, not imported: that takes seconds."""
    import importlib.util

    for name in ("transformers", "safetensors"):
        if importlib.util.find_spec(name) is None:
            return f"needs the {name} package (pip install 'rrfp[hf]')"
    return None


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
            fewer than ``--max-len``, ``--tp`` above 1, or ``transformers`` or ``safetensors`` not
            installed (:func:`hf_missing`).
    """
    from ..model.spec import FAMILY_NAMES, HF_PRESETS, preset_layers

    spec = args.model[len(HF_PREFIX):]
    flag = f"--model={args.model!r}"
    if (missing := hf_missing()) is not None:
        raise UsageError(f"{flag}: {missing}")
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
        raise UsageError(f"--max-len={args.max_len} exceeds the {positions} positions of {flag}: expected "
                         f"--max-len {positions} or less")
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    if not isinstance(layers, int) or layers < 1:
        raise UsageError(f"{flag}: config.json gives no layer count (num_hidden_layers or n_layer)")
    hf_weights_check(path, flag)
    return layers


_NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version",  # where and how it was saved
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",  # what a forward returns
})
"""``config.json`` entries that do not change the model rrfp trains: a checkpoint's parameters
fit a model that differs only in these (rrfp trains float32, without a cache, whatever the folder says)."""


def model_difference(recorded: str, recorded_config: dict | None, args: argparse.Namespace) -> str | None:
    """Why ``--model args.model`` is not the model a checkpoint was written with, or None.

    The same ``--model`` text is the same model. Two ``hf:`` spellings are the same model when the
    configuration the checkpoint records (``rrfp.json``'s ``model_config``) equals the one
    ``args.model`` gives, but for :data:`_NOT_ARCHITECTURE`: ``hf:qx``, ``hf:/abs/qx``,
    ``hf:./qx/`` and a copy of the folder elsewhere all resume a checkpoint written with any one
    of them. A checkpoint without a recorded configuration resumes from the same folder only
    (the resolved path; a relative one resolves against the current folder).

    Args:
        recorded: the checkpoint's ``--model``.
        recorded_config: its ``model_config`` (``{"kind": "hf", "config": {...}}``), or None.
        args: this run's flags (``model``, ``max_len``).

    Returns:
        None, "" (another model, nothing more to say), or ``" (...)"`` naming the first
        configuration entries that differ, to append to the caller's one line.
    """
    want = args.model
    if recorded == want:
        return None
    if not (is_hf(recorded) and is_hf(want)):
        return ""
    spec, old = want[len(HF_PREFIX):], recorded[len(HF_PREFIX):]
    if recorded_config is None or recorded_config.get("kind") != "hf":
        same = Path(spec).is_dir() and Path(old).is_dir() and os.path.samefile(spec, old)
        return None if same else " (the checkpoint records no model configuration to compare: expected the same folder)"
    from ..model.hf import hf_config

    try:
        config = json.loads(hf_config(spec, args.max_len).to_json_string(use_diff=False))
    except (OSError, ValueError) as e:
        return f" (cannot read this run's model configuration: {e})"
    have = recorded_config["config"]
    keys = sorted((k != "model_type", k) for k in set(have) | set(config)
                  if k not in _NOT_ARCHITECTURE and have.get(k) != config.get(k))
    if not keys:
        return None
    shown = "; ".join(f"{k}: {have.get(k)!r} in the checkpoint, {config.get(k)!r} here" for _, k in keys[:3])
    return f" model configuration ({shown}{', ...' if len(keys) > 3 else ''})"


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
