"""``rrfp export``: the model of a committed checkpoint as a Hugging Face folder (``config.json``
and safetensors shards) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

* ``hf:<model>`` runs: the ``transformers`` model itself, its configuration as recorded in the
  checkpoint;
* the GPT presets: ``GPT2LMHeadModel``, configured to compute exactly what rrfp's GPT computes
  (:func:`rrfp.model.names.gpt2_config`: exact GELU, a head not tied to the embedding) with
  GPT-2's names and its ``Conv1D`` weights transposed (:func:`rrfp.model.names.gpt_to_gpt2`);
* the multimodal model: refused (no ``transformers`` class computes it; its checkpoint is
  itself keyed by the one-stage model's names).

The tensors are read in one process (DCP's ``no_dist`` load), which reassembles each from the
pieces the ranks wrote: a checkpoint of any layout, ``--tp`` included, exports the same
model. Checkpoints of format 2 (keyed by stage index) written with ``--tp 1`` export too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

from .checkpoint import read_meta


def export_problem(meta: dict, checkpoint: str | os.PathLike) -> str | None:
    """Why :func:`export` cannot write the model of checkpoint ``meta`` (torch-free), or None."""
    a = meta["args"]
    if a.get("model") == "multimodal":
        return ("a --model multimodal checkpoint: no transformers class computes rrfp's multimodal model; export "
                "writes the text models (the GPT presets, as GPT-2, and hf:<model>)")
    if meta["format"] < 3 and a.get("tp", 1) != 1:
        return (f"checkpoint {os.fspath(checkpoint)!r} holds --tp {a['tp']} shards keyed by stage (format "
                f"{meta['format']}): export takes checkpoints of that format written with --tp 1")
    return None


def out_problem(out: str | os.PathLike) -> str | None:
    """Why ``--out`` cannot become the exported folder (torch-free), or None: it must be new
    (in a writable folder) or an empty folder."""
    from .._paths import output_file_problem

    p = Path(out)
    if p.is_dir():
        if any(p.iterdir()):
            return "is a folder that is not empty: expected a new or empty folder for the Hugging Face model"
        return None if os.access(p.parent, os.W_OK) else f"cannot write into its folder {str(p.parent)!r}"
    if p.exists():
        return "is a file: expected a new or empty folder for the Hugging Face model"
    return output_file_problem(os.fspath(p))


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> tuple[dict, str]:
    """Write the model of a committed checkpoint as a Hugging Face folder ``out`` (written
    aside, then renamed into place: never half-written).

    Returns:
        The checkpoint's description (``rrfp.json``) and the ``transformers`` class written.

    Raises:
        ValueError: ``checkpoint`` is not a committed checkpoint, a file is missing, truncated,
            differs from its recorded digest or has none, it holds the multimodal model (or
            ``--tp`` shards keyed by stage), its tensors do not cover the model, or ``out`` is
            not a new or empty folder.
    """
    import torch

    from .ckpt_verify import check_files

    meta = read_meta(checkpoint)
    if (problem := export_problem(meta, checkpoint) or check_files(checkpoint, meta)) is not None:
        raise ValueError(problem)  # the same check as --resume: a damaged shard is one line, not a traceback
    if (problem := out_problem(out)) is not None:
        raise ValueError(f"--out={os.fspath(out)!r}: {problem}")
    unsplit = _unsplit_state(checkpoint, meta)
    config, rename = _target(model_config(meta))
    state = dict(rename(name, t) for name, t in unsplit.items())
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    want = set(model.state_dict())
    if set(state) != want:  # the model's names: nothing missing, nothing extra
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise ValueError(f"checkpoint {os.fspath(checkpoint)!r} does not hold the whole model "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    _check_ties(model, state, checkpoint)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, state_dict=state)
        if out.is_dir():
            out.rmdir()  # empty (out_problem): replaced by the finished folder
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta, type(model).__name__


def _check_ties(model, state: dict, checkpoint) -> None:
    """A weight the model ties (embedding and head) was trained as two copies kept equal:
    refuse copies that differ rather than export one of them silently."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is None or inp.weight is not out.weight:
        return
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if p is inp.weight}
    tensors = [state[n] for n in sorted(names)]
    if any(not t.equal(tensors[0]) for t in tensors[1:]):
        raise ValueError(f"checkpoint {os.fspath(checkpoint)!r}: the tied weights {sorted(names)} differ")


def model_config(meta: dict) -> dict:
    """The model's configuration as :func:`rrfp.train.checkpoint.model_config` records it; for
    checkpoints written before it was recorded, rebuilt from the flags."""
    if meta.get("model_config"):
        return meta["model_config"]
    from .models import HF_PREFIX

    a = meta["args"]
    if a["model"].startswith(HF_PREFIX):
        from ..model.hf import hf_model

        config = hf_model(a["model"][len(HF_PREFIX):], a["seed"], a["max_len"]).config
        return {"kind": "hf", "config": json.loads(config.to_json_string(use_diff=False))}
    from ..model.spec import GPT_PRESETS

    return {"kind": "gpt", "config": dataclasses.asdict(dataclasses.replace(GPT_PRESETS[a["model"]],
                                                                            max_len=a["max_len"]))}


def _target(mc: dict):
    """``(transformers config, rename(name, tensor) -> (name, tensor))`` for a recorded config."""
    import transformers

    from ..model.names import gpt2_config, gpt_to_gpt2

    if mc["kind"] == "gpt":
        from ..model.spec import GPTConfig

        settings = gpt2_config(GPTConfig(**mc["config"]))
        settings.pop("model_type")
        return transformers.GPT2Config(**settings), gpt_to_gpt2
    settings = dict(mc["config"])
    return transformers.AutoConfig.for_model(settings.pop("model_type"), **settings), (lambda n, t: (n, t))


def _unsplit_state(checkpoint, meta: dict) -> dict:
    """The checkpoint's ``model.*`` tensors under the unsplit model's names (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.fspath(checkpoint))
    md = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP notes it loads in one process: the intent
        dcp.load(state, storage_reader=reader, no_dist=True)
    if meta["format"] >= 3:
        return {k.removeprefix("model."): t for k, t in state.items()}
    full_name = _stage_names(meta["args"])
    out = {}
    for key, t in state.items():
        stage, name = key.removeprefix("model.").split(".", 1)
        out[full_name(int(stage.removeprefix("stage")), name)] = t
    return out


def _stage_names(a: dict):
    """``full_name(stage, name)`` for a checkpoint of format 1-2 (keyed by stage index)."""
    from ..model.gpt import GPT_PRESETS, _full_param_name, stage_layer_ranges
    from .models import HF_PREFIX

    n_stages = a["stages"] * a["virtual_stages"]
    if a["model"].startswith(HF_PREFIX):
        from ..model.hf import _family, _full_name, hf_layer_count, hf_model

        config = hf_model(a["model"][len(HF_PREFIX):], a["seed"], a["max_len"]).config
        fam = _family(config)
        ranges = stage_layer_ranges(hf_layer_count(config), n_stages)
        prefix = f"{fam.base}.{fam.layers}."
        return lambda s, name: _full_name(name, prefix, ranges[s].start)
    ranges = stage_layer_ranges(GPT_PRESETS[a["model"]].n_layer, n_stages)
    return lambda s, name: _full_param_name(name, ranges[s].start)
