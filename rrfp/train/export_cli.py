"""``rrfp export CHECKPOINT --out FOLDER``: a checkpoint's model as a Hugging Face folder that
``transformers.AutoModelForCausalLM.from_pretrained(FOLDER)`` loads (:mod:`rrfp.train.export`)."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .checkpoint import read_meta
from .export import export, export_problem, out_problem
from .models import hf_missing


def register(sub: argparse._SubParsersAction) -> None:
    """``rrfp export CHECKPOINT --out FOLDER``."""
    p = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face folder (from_pretrained)",
                       description="Write the model of a committed rrfp checkpoint (a step-N folder, of any layout) "
                       "as a Hugging Face folder, config.json and safetensors, that "
                       "transformers.AutoModelForCausalLM.from_pretrained loads: hf:<model> as itself, the GPT "
                       "presets as GPT2LMHeadModel configured to compute exactly what rrfp's GPT computes.")
    p.add_argument("checkpoint", help="a committed checkpoint folder (DIR/step-NNNNNNNN)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write (new, or empty)")
    p.set_defaults(func=run_export)


def check(args: argparse.Namespace) -> str | None:
    """The first problem with the checkpoint or ``--out``, found without torch, or None."""
    try:
        meta = read_meta(args.checkpoint)
    except ValueError as e:
        return f"{args.checkpoint!r}: {e}"
    if (problem := export_problem(meta, args.checkpoint)) is not None:
        return f"{args.checkpoint!r}: {problem}"
    if (missing := hf_missing()) is not None:  # it writes with transformers' save_pretrained
        return f"rrfp export {missing}"
    if (problem := out_problem(args.out)) is not None:
        return f"--out={args.out!r}: {problem}"
    return None


def run_export(args: argparse.Namespace) -> int:
    try:
        meta, cls = export(args.checkpoint, args.out)
    except ValueError as e:
        msg = str(e)
        raise UsageError(msg if msg.startswith(("checkpoint ", "--out=")) else f"{args.checkpoint!r}: {msg}") from None
    except OSError as e:
        raise UsageError(f"--out={args.out!r}: {e.strerror or e}") from None
    a = meta["args"]
    print(f"wrote {args.out}: model {a['model']!r} (max_len {a['max_len']}) after {meta['step']} steps as {cls}; "
          f"load with transformers.AutoModelForCausalLM.from_pretrained({args.out!r})")
    return 0
