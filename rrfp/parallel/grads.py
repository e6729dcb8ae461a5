"""Data-parallel gradient reduction and tied parameters across stages, as step hooks.

:class:`GradSync` follows the runtime's step-hook contract (``rrfp/runtime/engine/hooks.py``):

- ``on_stage_grads_final(s)``: stage ``s``'s gradients are final in this step (its last B or
  W): start the stage's all-reduce over its DP group, one flat bucket, as an asynchronous
  gloo collective. gloo's ``Work.is_completed()`` stays False until ``wait()`` (torch 2.13 CPU,
  docs/architecture.md, "Facts"), so ``wait()`` runs in a helper thread and the loop awaits it: the
  reduction overlaps the rest of the rank's drain.
- ``on_step_end()``: every reduction is done; tied parameters' gradients are summed over the
  ranks that own them (a process group of those ranks), then the step ends and the optimizer
  may run.
- :meth:`GradSync.begin_step` (called by the front door before a training step's first
  backward): see "Accumulation over steps" below.

The loss is the mean over every real token of the **global** batch (all DP replicas):
:meth:`GradSync.global_weight_total` turns a replica's loss-weight total (its token count)
into the sum over replicas, so microbatch ``m`` of replica ``r`` is weighted ``n_m / N`` with
``N`` the global count. Each replica's gradients are then partial sums of the global
gradient, and the DP reduction is a plain SUM, for any per-replica token counts.

Accumulation over steps (``step()`` twice without ``zero_grad``, as PyTorch accumulates): after
a step every copy of a gradient holds the same total (each DP replica's copy of a stage's
gradient, each stage's copy of a tied parameter), and the next step's backward adds to it. A
SUM over copies would then add that earlier total once per copy (the field trial's GPT-2 tie
was off by 6.25e-2). So before a step's first backward one copy, the canonical one, keeps the
earlier total and every other copy's gradient is set to None: the canonical copy is DP rank
0's, and of a tie the first owner's (:func:`tie_copies` puts it first). The step's sums then
count the earlier total exactly once, which is also what PyTorch's DDP (an average) gives for
equal copies, at no extra memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .layout import ParallelLayout

__all__ = ["GradSync", "Tie", "resolve_ties", "tie_copies"]


@dataclasses.dataclass(frozen=True)
class Tie:
    """One parameter shared by several stages (e.g. the token embedding of stage 0 and the LM
    head of the last stage): ``{stage_index: parameter name in that stage's module}``."""

    name: str
    owners: Mapping[int, str]


def resolve_ties(tied, n_stages: int) -> list[Tie]:
    """Normalise ``Pipeline(..., tied=...)``.

    Accepted forms: a list of ``{stage_index: param_name}`` dicts, or a dict
    ``{tie_name: {stage_index: param_name}}``. Stage ``-1`` means the last stage.

    Raises:
        ValueError: a tie with fewer than two stages, or a stage outside ``[0, n_stages)``.
    """
    if not tied:
        return []
    items = tied.items() if isinstance(tied, Mapping) else ((f"tie{i}", t) for i, t in enumerate(tied))
    out = []
    for name, owners in items:
        if not isinstance(owners, Mapping) or len(owners) < 2:
            raise ValueError(f"tied parameter {name!r}: expected {{stage_index: parameter name}} over at least 2 stages, got {owners!r}")
        norm = {}
        for s, p in owners.items():
            s = n_stages - 1 if s == -1 else s
            if not isinstance(s, int) or not 0 <= s < n_stages:
                raise ValueError(f"tied parameter {name!r}: stage {s!r} outside 0..{n_stages - 1}")
            norm[s] = p
        out.append(Tie(str(name), norm))
    return out


def tie_copies(tie: Tie, modules: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """The copies of ``tie`` held in ``modules`` (``{stage_index: module}``, the stages of this
    process), in owner order: the first owner's copy first when it is here (the canonical copy,
    module doc). A parameter two stages share as one object counts once (autograd already sums
    into it).

    Raises:
        ValueError: a stage here without the named parameter.
    """
    out: list[nn.Parameter] = []
    for s in sorted(tie.owners):
        if s not in modules:
            continue
        try:
            p = modules[s].get_parameter(tie.owners[s])
        except AttributeError:
            raise ValueError(f"tied parameter {tie.name!r}: stage {s} has no parameter {tie.owners[s]!r}") from None
        if all(p is not q for q in out):
            out.append(p)
    return out


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


def _grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    # A parameter without a gradient on one replica may have one on another: reduce zeros.
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(_local(p.grad))
    return out


class GradSync:
    """Step hooks for one rank: DP reduction per stage, tied-parameter sums, global loss weights.

    Args:
        layout: this rank's :class:`~rrfp.parallel.layout.ParallelLayout`.
        stages: ``{stage_index: module}`` of this rank's stages, in virtual-stage order.
        ties: :func:`resolve_ties` output (every rank passes the same list).
        n_stages: the pipeline's stage count (virtual stages included).
        stage_rank: ``stage_index -> pp_rank`` holding it.
        sharded: stages whose gradients FSDP2 reduces (:mod:`rrfp.parallel.sharded`): not
            all-reduced here.

    Every rank of the world must build its ``GradSync`` at the same point (tie groups are
    created collectively).
    """

    def __init__(self, layout: ParallelLayout, stages: Mapping[int, nn.Module], ties: Sequence[Tie] = (),
                 n_stages: int | None = None, stage_rank=None, sharded: frozenset = frozenset()) -> None:
        self.layout = layout
        self.stages = dict(stages)
        self._vidx = {s: i for i, s in enumerate(self.stages)}
        self._params = {s: [] if s in sharded else [p for p in m.parameters() if p.requires_grad]
                        for s, m in self.stages.items()}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.ties = list(ties)
        self._tie_groups: list = []
        self._tie_params: list[list[nn.Parameter]] = []
        stage_rank = stage_rank or (lambda s: s)
        # Copies that give up their gradient before a step (the module doc's accumulation).
        aside = [p for ps in self._params.values() for p in ps] if layout.dp_rank != 0 else []
        for tie in self.ties:
            mine = tie_copies(tie, self.stages)
            copies = mine[1:] if min(tie.owners) in self.stages else mine
            aside += copies
            owners = sorted({stage_rank(s) for s in tie.owners})
            group = None
            if len(owners) > 1 and dist.is_initialized():
                # Collective over the world: one group per (dp, tp) pipeline, in the same order everywhere.
                for d in range(layout.dp):
                    for t in range(layout.tp):
                        ranks = [layout.global_rank(layout.pp, layout.dp, layout.tp, p, d, t) for p in owners]
                        g = dist.new_group(ranks, backend="gloo")
                        if layout.rank in ranks:
                            group = g
            self._tie_groups.append(group)
            self._tie_params.append(mine)
            # The first owner counts the tied parameter in the global norm; the others hold copies.
            for p in copies:
                p._rrfp_tied_copy = True
        self._aside = list({id(p): p for p in aside}.values())
        self.reduced = 0  # stage reductions completed (tests, benchmarks)

    def begin_step(self) -> None:
        """Before a training step's first backward: every copy but the canonical one drops the
        gradient earlier steps left (module doc), so the step's sums count it once."""
        for p in self._aside:
            p.grad = None

    # ------------------------------------------------------------ step hooks
    def on_stage_grads_final(self, stage_index: int):
        """Start stage ``stage_index``'s DP all-reduce; returns its awaitable (None at DP 1)."""
        if self.layout.dp == 1:
            return None
        grads = _grads(self._params[stage_index])
        if not grads:
            return None
        flat = torch._utils._flatten_dense_tensors(grads)
        group = self.layout.dp_stage_group(self._vidx[stage_index])
        work = dist.all_reduce(flat, group=group, async_op=True)
        return self._finish_reduce(work, flat, grads)

    async def _finish_reduce(self, work, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        await self._wait(work)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)
        self.reduced += 1

    def on_step_end(self):
        """Sum tied parameters' gradients over their owners (after every DP reduction)."""
        if not self.ties:
            return None
        return self._sum_ties()

    async def _sum_ties(self) -> None:
        for params, group in zip(self._tie_params, self._tie_groups):
            if not params:
                continue
            grads = _grads(params)
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                total = total.clone() if len(grads) == 1 else total
                await self._wait(dist.all_reduce(total, group=group, async_op=True))
            for g in grads:
                g.copy_(total)

    async def _wait(self, work) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(self.stages) + 1, thread_name_prefix="rrfp-dp")
        await asyncio.get_running_loop().run_in_executor(self._pool, work.wait)

    # ------------------------------------------------------------ loss weights
    def global_weight_total(self, local_total: float) -> float:
        """The sum over DP replicas of the loss-weight totals (token counts), float64.

        Called once per step on the rank holding the last stage, before its first task
        (every replica's last-stage rank calls it in the same step)."""
        if self.layout.dp == 1:
            return local_total
        t = torch.tensor([local_total], dtype=torch.float64)
        dist.all_reduce(t, group=self.layout.dp_stage_group(self._vidx[max(self.stages)]))
        return float(t.item())

    def global_loss(self, local_loss: float) -> float:
        """The global step loss from this replica's partial sum (last stage, step end)."""
        if self.layout.dp == 1:
            return local_loss
        t = torch.tensor([local_loss], dtype=torch.float64)
        dist.all_reduce(t, group=self.layout.dp_stage_group(self._vidx[max(self.stages)]))
        return float(t.item())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
