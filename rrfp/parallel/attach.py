"""Joins a rank's runtime to its parallel layout: DP/tied step hooks (replicated stages'
all-reduce, or the FSDP2 driver of sharded ones), global loss weights, TP agreement. One
function, used by :class:`~rrfp.runtime.doors.pipeline.Pipeline`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .grads import GradSync, resolve_ties
from .layout import ParallelLayout
from .sharded import ShardedGrads, is_sharded

__all__ = ["attach_layout"]


def attach_layout(runtime, layout: ParallelLayout, stages: Sequence, tied, n_stages: int, rank_of, *,
                  tp_exchange: str = "control", job: str = "rrfp", run=None,
                  join_tp: Callable[[Any], Any] | None = None) -> tuple[GradSync | None, ShardedGrads | None]:
    """Register this rank's :class:`GradSync` (DP reduction, tied sums, global token count),
    the :class:`~rrfp.parallel.sharded.ShardedGrads` driver of its FSDP2 stages (checked by
    :func:`~rrfp.parallel.sharded.check_sharded_stages`; their gradients are reduce-scattered
    by FSDP2, not all-reduced) and, at TP > 1, the TP agreement exchange on ``runtime``.

    Args:
        runtime: the rank's runtime (``add_step_hooks``, ``set_loss_reduction``,
            ``loop.add_observer``).
        layout: the rank's layout.
        stages: its :class:`~rrfp.runtime.engine.stage.PipelineStage` objects, in virtual-stage order.
        tied: ``Pipeline(..., tied=...)`` (see :func:`~rrfp.parallel.grads.resolve_ties`).
        n_stages: the pipeline's stage count; rank_of: ``stage -> pp_rank``.
        tp_exchange: ``control`` (ZeroMQ control messages between the TP ranks) or ``gloo``
            (an all-gather on a gloo group); see :mod:`rrfp.parallel.exchange`.
        job: the job id the TP ranks share (without the DP/TP suffix).
        run: runs a coroutine on the rank's event loop (starts the control transport).
        join_tp: at TP > 1, called with the TP group's exchange (:mod:`.exchange`); the front
            door joins it to the runtime as its TP agreement
            (:func:`rrfp.runtime.features.agreement.attach`).

    Raises:
        ValueError: an unknown ``tp_exchange``; TP > 1 without ``join_tp``.

    Returns:
        ``(grad_sync, sharded)``: the :class:`GradSync` (None when there is nothing to reduce:
        DP 1, no ties) and the sharded stages' driver (None without them).
    """
    ties = resolve_ties(tied, n_stages)
    if len(stages) > 1:
        layout.make_dp_stage_groups(len(stages))
    sync = sharded = None
    mods = {st.stage_index: st.submod for st in stages}
    shard = frozenset(s for s, m in mods.items() if is_sharded(m))
    if shard:
        sharded = ShardedGrads({s: mods[s] for s in sorted(shard)})
        runtime.add_step_hooks(sharded)
        runtime.loop.add_observer(sharded)  # its step_begins starts the step's gathers
    if layout.dp > 1 or ties:
        sync = GradSync(layout, mods, ties, n_stages, rank_of, sharded=shard)
        runtime.add_step_hooks(sync)
        if layout.dp > 1:
            runtime.set_loss_reduction(sync.global_weight_total, sync.global_loss)
    if layout.tp > 1:
        if join_tp is None:
            raise ValueError(f"a layout with tp={layout.tp} needs join_tp, which joins the TP agreement to the runtime")
        join_tp(_exchange(layout, tp_exchange, job, run))
    return sync, sharded


def _exchange(layout: ParallelLayout, kind: str, job: str, run):
    if kind == "gloo":
        from .exchange import GlooExchange

        return GlooExchange(layout.tp_control_group, layout.tp)
    if kind != "control":
        raise ValueError(f"tp_exchange={kind!r}: expected 'control' or 'gloo'")
    from .bootstrap import default_store
    from ..transport.zmq import ZmqTransport
    from .exchange import ControlExchange

    # One namespace per TP group: its ranks address each other by tp_rank.
    t = ZmqTransport(layout.tp_rank, layout.tp, default_store(), f"{job}.agree.pp{layout.pp_rank}.dp{layout.dp_rank}")
    # Its ranks are tp_ranks: a lost peer is logged by global rank and coordinates instead.
    t.rank_name = lambda r: ParallelLayout.name(layout.rank_at(layout.pp_rank, layout.dp_rank, r), layout.dp, layout.tp)
    ex = ControlExchange(t, layout.tp)
    run(ex.start())
    return ex
