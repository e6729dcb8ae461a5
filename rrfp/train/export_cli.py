"""``rrfp export CHECKPOINT --out model.pt``: a checkpoint's model as one state dict for the
single-process GPT (:func:`rrfp.train.checkpoint.export`)."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .checkpoint import export


def register(sub: argparse._SubParsersAction) -> None:
    """``rrfp export CHECKPOINT --out model.pt``."""
    p = sub.add_parser("export", help="write a checkpoint's model as one state dict for the single-process GPT",
                       description="Write the model of a committed rrfp checkpoint (a step-N folder) as one "
                       "unsplit state dict that loads into rrfp.model.gpt.GPT.")
    p.add_argument("checkpoint", help="a committed checkpoint folder (DIR/step-NNNNNNNN)")
    p.add_argument("--out", required=True, help="the .pt file to write")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    try:
        meta = export(args.checkpoint, args.out)
    except ValueError as e:
        raise UsageError(f"{args.checkpoint!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"--out={args.out!r}: {e.strerror or e}") from None
    a = meta["args"]
    print(f"wrote {args.out}: model {a['model']!r} (max_len {a['max_len']}) after {meta['step']} steps; load with "
          f"GPT(dataclasses.replace(GPT_PRESETS[{a['model']!r}], max_len={a['max_len']})).load_state_dict(torch.load(...))")
    return 0
