"""Named schedules compiled to per-rank total orders (one source of truth per schedule).

An order is a list of :class:`~rrfp.scheduler.tasks.Task` per rank. Run strictly it is the
fixed-order baseline; run in readiness mode it is a hint (RRFP §4: "any total order is also a
valid hint").

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import Callable

from .tasks import B, F, I, W, PipelineSpec, Task

Order = list[list[Task]]  # per rank


def _expand_backward(spec: PipelineSpec, order: list[Task]) -> list[Task]:
    """In split-backward mode a full ``B`` becomes ``I`` followed at once by ``W``."""
    if not spec.split_backward:
        return order
    out: list[Task] = []
    for t in order:
        if t.kind == B:
            out += [Task(t.stage, I, t.mb), Task(t.stage, W, t.mb)]
        else:
            out.append(t)
    return out


def gpipe(spec: PipelineSpec) -> Order:
    """GPipe (all forwards, then all backwards); with virtual stages, PyTorch's LoopedBFS:
    forwards stage by stage in pipeline order, backwards in reverse stage order."""
    orders = []
    M = spec.n_microbatches
    for r in range(spec.placement.n_ranks):
        stages = spec.placement.stages_of(r)
        order = [Task(s, F, m) for s in stages for m in range(M)]
        order += [Task(s, B, m) for s in reversed(stages) for m in range(M)]
        orders.append(_expand_backward(spec, order))
    return orders


def one_f_one_b(spec: PipelineSpec) -> Order:
    """1F1B (PipeDream-Flush) as in ``torch.distributed.pipelining.Schedule1F1B``: rank ``r`` of
    ``p`` runs ``min(M, p - r)`` warm-up forwards, then alternates one backward and one forward,
    then drains the remaining backwards.

    Raises:
        ValueError: with virtual stages (use ``interleaved-1f1b``).
    """
    if spec.placement.n_virtual != 1:
        raise ValueError(
            f"schedule 1f1b takes 1 virtual stage per rank, got {spec.placement.n_virtual}: "
            "use interleaved-1f1b"
        )
    p, M = spec.placement.n_ranks, spec.n_microbatches
    orders = []
    for r in range(p):
        warm = min(M, p - r)
        order = [Task(r, F, m) for m in range(warm)]
        for i in range(M - warm):
            order += [Task(r, B, i), Task(r, F, warm + i)]
        order += [Task(r, B, m) for m in range(M - warm, M)]
        orders.append(_expand_backward(spec, order))
    return orders


def one_f_one_b_limits(n_ranks: int) -> list[int]:
    """The most microbatches 1F1B keeps in flight on each rank (``p - r``): the in-flight limit
    that matches 1F1B's activation memory."""
    return [n_ranks - r for r in range(n_ranks)]


SCHEDULES: dict[str, Callable[[PipelineSpec], Order]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}
