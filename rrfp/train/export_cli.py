"""``rrfp export CHECKPOINT --out model.pt``: a checkpoint's model as one state dict of the
unsplit model (:func:`rrfp.train.checkpoint.export`): the GPT presets' ``GPT``, or the
``transformers`` model of an ``hf:<model>`` run."""

from __future__ import annotations

import argparse

from .._paths import output_file_problem
from ..errors import UsageError
from .checkpoint import export, export_problem, read_meta


def register(sub: argparse._SubParsersAction) -> None:
    """``rrfp export CHECKPOINT --out model.pt``."""
    p = sub.add_parser("export", help="write a checkpoint's model as one state dict of the unsplit model",
                       description="Write the model of a committed rrfp checkpoint (a step-N folder) as one "
                       "unsplit state dict: for the GPT presets it loads into rrfp.model.gpt.GPT, for hf:<model> "
                       "into the transformers model (rrfp.model.hf.hf_model).")
    p.add_argument("checkpoint", help="a committed checkpoint folder (DIR/step-NNNNNNNN)")
    p.add_argument("--out", required=True, help="the .pt file to write")
    p.set_defaults(func=run_export)


def check(args: argparse.Namespace) -> str | None:
    """The first problem with the checkpoint or ``--out``, found without torch, or None."""
    try:
        meta = read_meta(args.checkpoint)
    except ValueError as e:
        return f"{args.checkpoint!r}: {e}"
    if (problem := export_problem(meta, args.checkpoint)) is not None:
        return f"{args.checkpoint!r}: {problem}"
    if (problem := output_file_problem(args.out)) is not None:
        return f"--out={args.out!r}: {problem}"
    return None


def run_export(args: argparse.Namespace) -> int:
    try:
        meta = export(args.checkpoint, args.out)
    except ValueError as e:
        msg = str(e)
        raise UsageError(msg if msg.startswith("checkpoint ") else f"{args.checkpoint!r}: {msg}") from None
    except OSError as e:
        raise UsageError(f"--out={args.out!r}: {e.strerror or e}") from None
    a = meta["args"]
    if a["model"].startswith("hf:"):
        load = (f"rrfp.model.hf.hf_model({a['model'][3:]!r}, max_len={a['max_len']})"
                ".load_state_dict(torch.load(...))")
    else:
        load = (f"GPT(dataclasses.replace(GPT_PRESETS[{a['model']!r}], max_len={a['max_len']}))"
                ".load_state_dict(torch.load(...))")
    print(f"wrote {args.out}: model {a['model']!r} (max_len {a['max_len']}) after {meta['step']} steps; load with {load}")
    return 0
