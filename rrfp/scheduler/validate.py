"""Static checks of per-rank orders before any process starts.

A strict (fixed-order) schedule is possible only if every rank's order holds exactly that
rank's tasks, no task precedes a dependency on its own rank, and the ranks cannot wait on each
other in a cycle. :func:`validate_schedule` checks all three and names the first offending
action; it is what lets a user-written order (text or CSV) fail in one line instead of hanging
a pipeline.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import Sequence

from .tasks import IN_FLIGHT_END, F, KINDS, PipelineSpec, Task


class ScheduleError(ValueError):
    """An impossible schedule, found before running it.

    Attributes:
        rank: the rank whose order holds the offending action (None for a whole-schedule error).
        position: the action's index in that rank's order (None for a missing task).
        action: the offending task (None for a whole-schedule error).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        position: int | None = None,
        action: Task | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.position = position
        self.action = action


def _foreign_reason(spec: PipelineSpec, rank: int, t: Task) -> str | None:
    pl = spec.placement
    if not 0 <= t.stage < pl.n_stages:
        return f"stage {t.stage} does not exist (the pipeline has stages 0..{pl.n_stages - 1})"
    owner = pl.rank_of(t.stage)
    if owner != rank:
        return f"stage {t.stage} is on rank {owner}"
    if not 0 <= t.mb < spec.n_microbatches:
        return f"microbatch {t.mb} does not exist (the step has microbatches 0..{spec.n_microbatches - 1})"
    if KINDS[t.kind].split not in (None, spec.split_backward):
        if spec.split_backward:
            return "the backward is split: use I (input gradient) and W (weight gradient) instead of B"
        return "the backward is not split: use B instead of I and W"
    return None


def _task_sort_key(spec: PipelineSpec, t: Task) -> tuple[int, int, int]:
    # Missing tasks are reported in the order a 1F1B-like step would reach them.
    # Kinds in ready-set code order: F, then B or I, then W.
    v = spec.placement.virtual_index(t.stage)
    return (t.mb, KINDS[t.kind].code, v if t.kind == F else -v)


def validate_schedule(
    spec: PipelineSpec, orders: Sequence[Sequence[Task]], *, strict: bool = True
) -> None:
    """Reject per-rank orders that cannot run, naming the first offending action.

    Checks, in this order (each reports the first offender, scanning ranks in ascending order
    and each rank's order from the start):

    1. one order per rank;
    2. every action is a task of its rank (right stage, existing microbatch, ``B`` or
       ``I``/``W`` as ``spec.split_backward`` says) and appears once;
    3. no task of the rank is missing;
    4. with ``strict``: no action precedes one of its dependencies held by the same rank
       (``spec.dependencies``);
    5. with ``strict``: the ranks cannot block each other. The orders are run strictly in
       dependency order (equivalent to unit durations and zero message delay: whether a strict
       schedule completes does not depend on timing); when no rank can advance, each blocked
       rank waits on another blocked rank, and the error names the cycle, starting with the
       lowest blocked rank in it.

    A readiness-mode hint needs only checks 1-3 (``strict=False``): the arbiter skips unready
    tasks, so any permutation of a rank's tasks is a valid hint.

    Args:
        spec: the pipeline's shape (placement, microbatches, split backward).
        orders: per rank, its tasks in order (``len(orders) == spec.placement.n_ranks``).
        strict: also check dependency order and cross-rank cycles (4-5).

    Raises:
        ScheduleError: (a ``ValueError``) one line naming the rank, position and action.
    """
    P = spec.placement.n_ranks
    if len(orders) != P:
        raise ScheduleError(f"schedule has {len(orders)} rank orders, the placement has {P} ranks")
    positions: list[dict[Task, int]] = []
    for r, order in enumerate(orders):
        pos: dict[Task, int] = {}
        for i, t in enumerate(order):
            why = _foreign_reason(spec, r, t)
            if why is not None:
                raise ScheduleError(
                    f"rank {r}, position {i}: action {t} is not a task of rank {r}: {why}",
                    rank=r, position=i, action=t,
                )
            if t in pos:
                raise ScheduleError(
                    f"rank {r}, position {i}: action {t} repeats position {pos[t]}",
                    rank=r, position=i, action=t,
                )
            pos[t] = i
        positions.append(pos)
    for r in range(P):
        expected = spec.tasks_of(r)
        if len(positions[r]) != len(expected):
            missing = sorted((t for t in expected if t not in positions[r]), key=lambda t: _task_sort_key(spec, t))
            raise ScheduleError(
                f"rank {r}: action {missing[0]} is missing ({len(missing)} of the rank's "
                f"{len(expected)} tasks are absent)",
                rank=r, action=missing[0],
            )
    if not strict:
        return
    rank_of = spec.placement.rank_of
    for r, order in enumerate(orders):
        for i, t in enumerate(order):
            for d in spec.dependencies(t):
                if rank_of(d.stage) == r and positions[r][d] > i:
                    raise ScheduleError(
                        f"rank {r}, position {i}: action {t} comes before its dependency {d} "
                        f"(position {positions[r][d]}) on the same rank",
                        rank=r, position=i, action=t,
                    )
    _check_cycles(spec, orders, positions)


def _check_cycles(
    spec: PipelineSpec, orders: Sequence[Sequence[Task]], positions: list[dict[Task, int]]
) -> None:
    P = spec.placement.n_ranks
    rank_of = spec.placement.rank_of
    head = [0] * P
    done: set[Task] = set()
    # Dependency-driven sweep: a rank advances while its next action's dependencies are done;
    # only a rank whose producer advanced needs another look.
    pending = list(range(P))
    waiting_on: dict[Task, list[int]] = {}
    while pending:
        r = pending.pop()
        order = orders[r]
        while head[r] < len(order):
            t = order[head[r]]
            blocker = next((d for d in spec.dependencies(t) if d not in done), None)
            if blocker is not None:
                waiting_on.setdefault(blocker, []).append(r)
                break
            done.add(t)
            head[r] += 1
            pending += waiting_on.pop(t, ())
    blocked = [r for r in range(P) if head[r] < len(orders[r])]
    if not blocked:
        return

    def needs(r: int) -> Task:
        t = orders[r][head[r]]
        return next(d for d in spec.dependencies(t) if d not in done)

    # Each blocked rank waits on exactly one other blocked rank (same-rank dependencies were
    # checked to come first), so following the waits from any blocked rank reaches a cycle.
    seen: list[int] = []
    r = blocked[0]
    while r not in seen:
        seen.append(r)
        r = rank_of(needs(r).stage)
    cycle = seen[seen.index(r):]
    k = cycle.index(min(cycle))
    cycle = cycle[k:] + cycle[:k]
    parts = []
    for r in cycle:
        t, d = orders[r][head[r]], needs(r)
        owner = rank_of(d.stage)
        parts.append(
            f"rank {r} blocks at position {head[r]} on {t}, which needs {d} "
            f"(rank {owner}, position {positions[owner][d]})"
        )
    first = cycle[0]
    t0 = orders[first][head[first]]
    raise ScheduleError(
        f"rank {first}, position {head[first]}: action {t0} is in a cross-rank wait cycle "
        f"({' -> '.join(f'rank {r}' for r in cycle + [first])}): " + "; ".join(parts),
        rank=first, position=head[first], action=t0,
    )


def order_limits(spec: PipelineSpec, orders: Sequence[Sequence[Task]], backpressure: str = "admission") -> list[int]:
    """Per rank, the in-flight limit that holds a strict run of ``orders`` to its own peak, as
    the rank's guard counts (:mod:`rrfp.scheduler.guards`): with one stage per rank, or with
    ``completion-order`` backpressure (which counts activations), the peak of
    ``#F - #(B or W)`` over the order (:func:`order_peak_inflight`; 1F1B: ``p - r``); with
    virtual stages and ``admission`` backpressure (which counts microbatches), the peak of
    microbatches whose first local stage's forward ran and whose ``B`` (or ``W``) there did not
    (RRFP App. C). At least 1 per rank."""
    if spec.placement.n_virtual == 1 or backpressure != "admission":
        return [max(1, p) for p in order_peak_inflight(spec, orders)]
    limits = []
    for rank, order in enumerate(orders):
        first = spec.placement.stages_of(rank)[0]
        held = peak = 0
        for t in order:
            if t.stage != first:
                continue
            if t.kind == F:
                held += 1
                peak = max(peak, held)
            elif t.kind in IN_FLIGHT_END:
                held -= 1
        limits.append(max(1, peak))
    return limits


def order_peak_inflight(spec: PipelineSpec, orders: Sequence[Sequence[Task]]) -> list[int]:
    """Per rank, the most activations a strict run of ``orders`` holds at once: the peak of
    ``D = #F - #(B or W)`` over the order's prefixes (RRFP App. C's ``D``, a split backward's
    microbatch counted until its ``W``: :data:`~rrfp.scheduler.tasks.IN_FLIGHT_END`; 1F1B
    gives ``p - r`` for ``M >= p``)."""
    peaks = []
    for order in orders:
        d = peak = 0
        for t in order:
            if t.kind == F:
                d += 1
                peak = max(peak, d)
            elif t.kind in IN_FLIGHT_END:
                d -= 1
        peaks.append(peak)
    return peaks
