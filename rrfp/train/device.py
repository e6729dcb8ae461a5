"""``rrfp train``'s device flags: ``--device``, ``--executor``, ``--launch-ahead``.

Kept apart from the other flags so that the CLI and the worker each add one call.
"""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the ranks compute; not given: cuda when available, else cpu. With cuda, "
                        "rank r uses GPU LOCAL_RANK %% device count")
    p.add_argument("--executor", choices=["inline", "thread", "cuda"], default=None,
                   help="how each rank runs its tasks; not given: cuda on cuda, inline on cpu. thread keeps the "
                        "rank's event loop answering during long tasks, at a thread hop per task")
    p.add_argument("--launch-ahead", type=int, default=1,
                   help="with --executor cuda: tasks queued ahead of the GPU, 1 or 2")


def validate(args: argparse.Namespace) -> None:
    """Raises UsageError (exit 2) for a device or executor this machine cannot use (torch asked;
    ``--launch-ahead`` and ``--executor cuda --device cpu`` are refused earlier, without torch,
    by :mod:`rrfp.train.early`)."""
    if args.device != "cuda" and args.executor != "cuda":
        return  # nothing to ask torch: a cpu run needs no GPU
    import torch  # here, not at import: rrfp train's parser is built before torch loads

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch.cuda.is_available() is False (no CUDA GPU, or a CPU-only torch)")
    if args.executor == "cuda" and resolve_device(args.device).type != "cuda":
        raise UsageError("--executor cuda: needs --device cuda (this run computes on the cpu)")


def resolve_device(name: str | None) -> "torch.device":  # noqa: F821 - torch loads here, not when the parser is built
    """The device a rank computes on: ``cuda:(LOCAL_RANK % GPUs)`` or ``cpu``."""
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def pipeline_kwargs(args: argparse.Namespace) -> dict:
    """``Pipeline``'s device, executor and launch_ahead for this rank (sets the current GPU)."""
    import torch

    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return {"device": device, "executor": args.executor or "auto", "launch_ahead": args.launch_ahead}
