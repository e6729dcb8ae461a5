"""The held-out split of ``rrfp train --eval-every``: which samples, after which steps, and
the validation loss (forwards only)."""

from __future__ import annotations

import argparse

from ..data.batches import make_microbatches
from ..model.gpt import count_tokens
from ..runtime.doors.pipeline import Pipeline


def eval_steps(args: argparse.Namespace) -> list[int]:
    """The steps (1-based) after which ``--eval-every`` evaluates: every N-th and the last."""
    if not args.eval_every:
        return []
    return sorted({*range(args.eval_every, args.steps + 1, args.eval_every), args.steps})


def split_held_out(samples: list, args: argparse.Namespace) -> tuple[list, list]:
    """``(train, held_out)``: with ``--eval-every``, the last ``--eval-batches`` x
    ``--batch-size`` samples of the (shuffled) pool are held out for validation.

    Raises:
        ValueError: fewer than a batch left to train on.
    """
    if not args.eval_every:
        return samples, []
    held = args.eval_batches * args.batch_size
    if len(samples) - held < args.batch_size:
        raise ValueError(f"holding out {held} of {len(samples)} samples leaves fewer than a batch to train on")
    return samples[:-held], samples[-held:]


def evaluate(pipe: Pipeline, held_out: list, args: argparse.Namespace, first: bool, last: bool) -> float | None:
    """The held-out split's loss (mean over its target tokens), forwards only; on the rank
    holding the last stage, else None."""
    total, tokens = 0.0, 0
    B = args.batch_size
    for b in range(args.eval_batches):
        mbs = make_microbatches(held_out[b * B:(b + 1) * B], args.microbatches) if held_out else None
        pipe.eval(
            microbatches=[(mb.tokens,) for mb in mbs] if first else None,
            targets=[mb.targets for mb in mbs] if last else None,
        )
        if last:
            n = sum(count_tokens(mb.targets) for mb in mbs)
            total += float(pipe.last_loss) * n
            tokens += n
    return total / tokens if last and tokens else None
