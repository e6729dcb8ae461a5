"""Gradient accumulation (``rrfp train --grad-accum N``): N pipeline steps per optimizer step,
whose gradients add up to those of one batch of all their samples.

The optimizer step's batch (``N x --batch-size`` samples, cut into ``N x --microbatches``
microbatches) runs as N pipeline steps of ``--microbatches`` each. Each microbatch's loss is
weighted by its share of the real tokens of the whole batch (of every DP replica), not of its
own pipeline step: the last stage's rank, which holds every target, gives the runtime that
total (``RankRuntime.set_loss_reduction``), so the gradients that reach every stage are
already the whole batch's, and nothing is rescaled afterwards. The step loss is the sum of the
N steps' weighted losses: the whole batch's mean over its tokens.

The N pipeline steps run without ``zero_grad`` between them, as a user's loop accumulates:
the front door keeps gradients of earlier steps in one copy (DP rank 0's, a tie's first
owner's; :mod:`rrfp.parallel.grads`), so the DP all-reduce and the tie sums count them once.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import UsageError

__all__ = ["add_flags", "check_flags", "accumulated_step"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """``--grad-accum``."""
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="pipeline steps per optimizer step: each optimizer step takes N x --batch-size samples, "
                   "its gradients equal to one batch of them all")


def check_flags(args: argparse.Namespace) -> None:
    """Raises UsageError: ``--grad-accum`` below 1, or with the multimodal workload."""
    n = getattr(args, "grad_accum", 1)
    if n < 1:
        raise UsageError(f"--grad-accum={n}: expected a positive integer")
    if n > 1 and args.model == "multimodal":
        raise UsageError(f"--grad-accum={n} with --model multimodal: accumulation covers the text models")


def accumulated_step(pipe, mbs, per_step: int, n: int, first: bool, last: bool):
    """Run ``n`` pipeline steps of ``per_step`` microbatches each over ``mbs``
    (:class:`~rrfp.data.batches.Microbatch`, ``n x per_step`` of them, on the ranks holding the
    first or last stage; None elsewhere). Gradients accumulate into ``.grad``.

    Returns:
        ``(loss, stats)``: the optimizer step's loss (None off the last stage's rank) and
        the steps' :class:`~rrfp.runtime.engine.rank.StepStats` combined (seconds, tasks and input elements added,
        peaks the largest).
    """
    from ..model.gpt import count_tokens

    def run(part) -> None:
        pipe.step(microbatches=[mb.inputs for mb in part] if first else None,
                  targets=[mb.targets for mb in part] if last else None, return_outputs=False)

    if n == 1:
        run(mbs)
        return pipe.last_loss, pipe.last_stats
    rt = pipe.runtime
    saved = rt.loss_reduction
    if last:
        local, reduce_total, total = sum(count_tokens(mb.targets) for mb in mbs), saved[0], []

        def whole_batch(_step_total: float) -> float:
            # The first step asks the replicas once (DP: one collective, as every step did
            # before); the others reuse the answer.
            if not total:
                total.append(reduce_total(local) if reduce_total is not None else local)
            return total[0]

        rt.set_loss_reduction(whole_batch, saved[1])
    stats, loss = [], None
    try:
        for j in range(n):
            run(mbs[j * per_step:(j + 1) * per_step] if mbs is not None else None)
            stats.append(pipe.last_stats)
            if pipe.last_loss is not None:
                loss = float(pipe.last_loss) + (loss or 0.0)
    finally:
        rt.set_loss_reduction(*saved)
    combined = dataclasses.replace(
        stats[-1], wall=sum(s.wall for s in stats), busy=sum(s.busy for s in stats),
        peak_inflight=max(s.peak_inflight for s in stats), peak_mb_inflight=max(s.peak_mb_inflight for s in stats),
        n_tasks=sum(s.n_tasks for s in stats), records=[r for s in stats for r in s.records],
        peak_bytes=max(s.peak_bytes for s in stats), peak_one=max(s.peak_one for s in stats), loss=loss,
        input_elems=sum(s.input_elems for s in stats))  # auto's batch work: every step's batch
    return loss, combined
