"""The step line's learning rate, gradient norm, TFLOP/s per rank and MFU, and where else they go:
``--tensorboard DIR`` (``torch.utils.tensorboard``) and the Prometheus gauges.

Every rank adds three numbers to the statistics it already sends rank 0 each step
(:func:`rank_fields`): the learning rate it stepped with, its share of the squared global
gradient norm, and the model FLOPs its stages ran (:mod:`rrfp.train.flops`). Rank 0 checks them
like the rest of a peer's statistics (:func:`fields_problem`) and :class:`StepExtras` turns
one step's messages into the line's fields. The memory figures ride in the same messages; their
field, checks and scalars are :mod:`rrfp.train.memory`'s (TensorBoard: ``rank/R/memory/KIND``).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:  # torch is imported where used: the flags are registered before torch loads
    import torch

__all__ = ["grad_norm_share", "rank_fields", "fields_problem", "StepExtras", "add_flags", "check_flags"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """``--peak-tflops`` and ``--tensorboard``."""
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOPS",
                   help="peak TFLOP/s of one rank's device, for the step line's MFU; without it, a table of known "
                   "GPUs by name on CUDA (rrfp/train/flops.py), none on CPU")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="rank 0 writes the step line's values (loss, lr, grad norm, tok/s, TFLOP/s, MFU, bubble, "
                   "memory by kind per rank) as TensorBoard scalars to DIR")


def check_flags(args: argparse.Namespace) -> str | None:
    """One line naming a bad ``--peak-tflops`` or ``--tensorboard``, or None."""
    peak = getattr(args, "peak_tflops", None)
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        return f"--peak-tflops={peak}: expected a positive, finite TFLOP/s"
    if getattr(args, "tensorboard", None) is not None:
        import importlib.util
        import os

        if not args.tensorboard.strip() or (os.path.exists(args.tensorboard) and not os.path.isdir(args.tensorboard)):
            return f"--tensorboard={args.tensorboard!r}: expected a folder for the event files"
        if importlib.util.find_spec("tensorboard") is None:
            return "--tensorboard needs the tensorboard package (pip install 'rrfp[tensorboard]')"
    return None


def grad_norm_share(params: Iterable[torch.Tensor], layout) -> float:
    """This rank's share of the squared global gradient norm: the squares of the gradients it
    counts (:func:`rrfp.parallel.clip.counted`: a replicated or tied copy on one rank only).
    The reporting ranks' shares add up to the global squared norm. With TP, shards live on
    ranks that do not report, as FSDP2 shards do on every DP rank (``--dp-shard full``), so the
    squares are then all-reduced over the world and pipeline rank 0 reports the total (every
    rank must call this then)."""
    import torch

    from ..parallel.clip import counted

    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None and counted(p, layout):
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq += g.detach().to(torch.float64).pow(2).sum().cpu()
    if layout is not None and (layout.tp > 1 or getattr(layout, "dp_shard", "none") != "none"):
        import torch.distributed as dist

        dist.all_reduce(sq)
        return float(sq) if layout.pp_rank == 0 else 0.0
    return float(sq)


def rank_fields(lr: float, grad_sq: float, flops: float) -> dict[str, float]:
    """The keys a rank adds to its statistics message."""
    return {"lr": float(lr), "grad_sq": float(grad_sq), "flops": float(flops)}


def fields_problem(meta: Mapping[str, Any]) -> str | None:
    """Why a peer's :func:`rank_fields` are refused (each a finite, non-negative number), or None."""
    for k in ("lr", "grad_sq", "flops"):
        v = meta.get(k)
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            return f"{k}={v!r} is not a finite non-negative number"
    return None


class StepExtras:
    """Rank 0's side: the step line's extra fields, the TensorBoard writer, rank 0's gauges.

    Args:
        args: ``rrfp train``'s flags (``peak_tflops``, ``tensorboard``).
        device: rank 0's device (its name picks the peak from the table on CUDA).
        metrics: rank 0's :class:`~rrfp.obs.metrics.RankMetrics` (None: no metrics), whose
            gradient-norm gauge gets the global norm.
    """

    def __init__(self, args: argparse.Namespace, device: torch.device | None = None, metrics=None) -> None:
        from .flops import peak_tflops

        self.peak = peak_tflops(getattr(args, "peak_tflops", None), device)
        self.metrics = metrics
        self.writer = None
        if getattr(args, "tensorboard", None):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(args.tensorboard)

    def fields(self, per_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """``lr`` (rank 0's), ``grad_norm`` (global), ``tflops`` (one per rank: its model
        FLOPs over its step's wall seconds, in TFLOP/s) and ``mfu`` (their mean over the peak;
        None without a peak) of one step's messages, one per rank."""
        ranks = sorted(per_rank)
        tflops = [per_rank[r]["flops"] / per_rank[r]["wall"] / 1e12 if per_rank[r]["wall"] > 0 else 0.0 for r in ranks]
        mean = sum(tflops) / len(tflops)
        return {"lr": per_rank[ranks[0]]["lr"], "grad_norm": math.sqrt(sum(per_rank[r]["grad_sq"] for r in ranks)),
                "tflops": tflops, "mfu": mean / self.peak if self.peak else None}

    @staticmethod
    def text(f: Mapping[str, Any]) -> str:
        """The fields as the step line shows them."""
        mean = sum(f["tflops"]) / len(f["tflops"])
        mfu = f"  MFU {100 * f['mfu']:5.2f}%" if f["mfu"] is not None else ""
        return f"lr {f['lr']:.2e}  grad norm {f['grad_norm']:7.4f}  TFLOP/s/rank {mean:7.4f}{mfu}"

    def publish(self, row: Mapping[str, Any]) -> None:
        """One printed step to TensorBoard (step = the 1-based training step) and rank 0's gauges."""
        k = row["step"] + 1
        if self.metrics is not None:
            self.metrics.observe_global(grad_norm=row["grad_norm"])
        if self.writer is None:
            return
        w = self.writer
        for name in ("loss", "lr", "grad_norm", "tok_s", "seconds"):
            if row.get(name) is not None and math.isfinite(row[name]):
                w.add_scalar(f"train/{name}", row[name], k)
        w.add_scalar("train/tflops_per_rank", sum(row["tflops"]) / len(row["tflops"]), k)
        if row.get("mfu") is not None:
            w.add_scalar("train/mfu", row["mfu"], k)
        for r, (t, b) in enumerate(zip(row["tflops"], row["bubble"])):
            w.add_scalar(f"rank/{r}/tflops", t, k)
            w.add_scalar(f"rank/{r}/bubble", b, k)
        if row.get("mem"):
            from .memory import publish

            publish(w, row["mem"], k)

    def evaluation(self, step: int, loss: float) -> None:
        """A validation loss after training step ``step`` (1-based) to TensorBoard."""
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)

    def close(self) -> None:
        """Flush and close the TensorBoard files."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
