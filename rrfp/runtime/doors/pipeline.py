"""The public API: a pipeline schedule object in the shape of ``torch.distributed.pipelining``.

Switching from PyTorch is a one-line change::

    # schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule = rrfp.Pipeline(stage, n_microbatches=8, loss_fn=loss_fn)   # hint="auto"
    schedule.step(x, target=y, losses=losses)   # then optimizer.step() as usual

Several stages per rank, as torch's multi-stage schedules take them: this rank's
:class:`PipelineStage` objects in placement order, ``placement="loop"`` (interleaved, rank ``r``
of ``p`` holds ``r, r + p, ...``) or ``"v"`` (rank ``r`` holds ``r`` and ``2p - 1 - r``)::

    ids = Placement(p, 2, "loop").stages_of(rank)          # p = 2: rank 0 [0, 2], rank 1 [1, 3]
    schedule = rrfp.Pipeline([PipelineStage(mods[s], s, 2 * p) for s in ids], 8, loss_fn)
    ids = Placement(p, 2, "v").stages_of(rank)             # p = 2: rank 0 [0, 3], rank 1 [1, 2]
    schedule = rrfp.Pipeline([PipelineStage(mods[s], s, 2 * p) for s in ids], 8, loss_fn, placement="v")

:class:`Pipeline` is one process's rank of a multi-process pipeline;
:class:`~rrfp.runtime.doors.local.LocalPipeline` runs every rank in one process over the fake
transport. Both take a :class:`~rrfp.runtime.doors.config.RuntimeConfig` (or its fields as keyword
arguments) and share construction, stepping and closing (:mod:`rrfp.runtime.doors.front`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .compat import new_job_id
from ...transport.base import START_TIMEOUT_S
from .config import RuntimeConfig, plan
from .front import FrontDoor, build_runtime, check_rank
from .front import new_event_loop  # called through this module's name: tests replace it
from ..engine.rank import LossFn, StepStats
from ..engine.stage import PipelineStage

# Errors one rank finds at construction that every rank re-raises with the same type and text.
_AGREED_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}
_MAX_ERROR_CHARS = 2000


class Pipeline(FrontDoor):
    """This rank's part of a multi-process pipeline (one process per pipeline rank).

    Args:
        stages: this rank's :class:`PipelineStage`, or a list of them: its virtual stages, in
            the order the placement puts them on this rank (``Placement(n_ranks, len(stages),
            placement).stages_of(rank)``); every stage's ``num_stages`` is ``n_ranks *
            len(stages)``.
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target, **loss_kwargs) -> scalar tensor`` on the last
            stage; None: every step runs forwards only (as PyTorch's schedules).
        args_chunk_spec, kwargs_chunk_spec: how ``step``'s positional and keyword inputs
            split into microbatches (``torch.distributed.pipelining``'s ``TensorChunkSpec``;
            default: tensors along dim 0, other values replicated).
        output_merge_spec: how the last stage's outputs merge (torch's ``merge_chunks``).
        scale_grads: True (default): microbatch losses weighted by their share of the batch
            (``loss_weight_fn`` overrides); False: summed, as PyTorch's ``scale_grads=False``.
        rank, n_ranks: this rank's pipeline index and the pipeline's rank count (default: the
            layout's ``pp_rank`` and ``pp``, else the rank and size of ``group``).
        group: the pipeline's process group (default: the stage's ``group``, else the world).
        config: a :class:`~rrfp.runtime.doors.config.RuntimeConfig`; ``**options`` set its fields
            (``hint``, ``inflight_limit``, ``memory_budget``, ``watchdog``, ``layout``,
            ``tied``, ``transport``, ``device``, ``executor``... documented there).

    With a ``layout`` (a :class:`~rrfp.parallel.layout.ParallelLayout` or a torch
    ``DeviceMesh`` with dimensions named ``pp``, ``dp``, ``tp``), this rank runs pipeline rank
    ``pp_rank`` at its ``(dp_rank, tp_rank)``: its stages' gradients are all-reduced over DP
    as soon as they are final, the loss is the mean over the global batch's tokens, and TP
    ranks agree before each F and B. The default transport is ZeroMQ with endpoints exchanged
    through torch.distributed's store (initialised from the torchrun environment if needed).
    Stages whose modules are wrapped in FSDP2's ``fully_shard`` over the layout's ``dp`` mesh
    (each block, then the stage, as torchtitan does) are sharded instead: their parameters are
    gathered once per step, their gradients reduce-scattered once they are final
    (:mod:`rrfp.parallel.sharded`; :attr:`sharded` is the driver).

    Every rank checks its own part (stage indices against the placement, hint, limits,
    executor, device) before contacting a peer, and the ranks then agree through the store:
    an error found on any rank is raised on every rank, with that rank's type and text.

    The default ``hint="auto"`` (:mod:`rrfp.runtime.features.auto`) starts with the placement's strict
    schedule, measures the first training steps, simulates the candidates on what it
    measured, tries the best two against the strict schedule on real steps and keeps the
    fastest, never one measured slower than the strict schedule. Every rank must call
    :meth:`step` for every training step (they share step times, seconds, and task records):
    through the process group where torch.distributed is initialised (``group``, else every
    process of the job; with a ``layout``, every process), else over this pipeline's own
    control plane (``auto``'s figures go to its own handler, :meth:`Inbox.on_control
    <rrfp.runtime.engine.inbox.Inbox.on_control>`: other control messages stay for
    ``runtime.control()``). Its lines go to the ``rrfp`` logger at INFO from one rank.

    Attributes:
        auto: the :class:`~rrfp.runtime.features.auto.AutoHint` under ``hint="auto"`` (else None):
            ``auto.chosen`` is the hint kept (None before its trial ends), ``auto.run_length(n)``
            keeps the strict schedule throughout a run of ``n`` steps too short to choose.
        hint_name: the hint the last step ran (text).
        tp_agreement: the rank's :class:`~rrfp.runtime.features.agreement.AgreementDriver` with
            a layout of TP > 1 (else None).
        drive_auto: False: the caller calls ``auto.before_step`` / ``auto.after_step`` itself
            (``rrfp train`` does, once per optimizer step).
        sharded: the :class:`~rrfp.parallel.sharded.ShardedGrads` driving this rank's FSDP2
            stages (None without them): ``reduced``, ``gathered`` bytes, for
            :func:`rrfp.parallel.footprint.footprint`.

    An autocast around :meth:`step` (``with torch.autocast(...)``) holds with every executor:
    the ``thread`` executor re-enters the caller's autocast on its worker for each task
    (:mod:`rrfp.runtime.engine.autocast`).

    Raises:
        ValueError: one line naming a bad argument (unknown hint, stage/rank mismatch, stages
            that are not ``n_ranks`` x ``len(stages)``, a sharded stage it cannot drive:
            :func:`~rrfp.parallel.sharded.check_sharded_stages`...);
            ``auto`` where none of its candidates fits the shape.
        TypeError: an unknown option, naming it and the known ones.
        TimeoutError: (from :meth:`step`, ``auto`` over the control plane) a peer's figures
            did not arrive within ``watchdog`` seconds.
    """

    RETURN_OUTPUTS = True

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        rank: int | None = None,
        n_ranks: int | None = None,
        group: Any = None,
        config: RuntimeConfig | None = None,
        **options: Any,
    ) -> None:
        config = RuntimeConfig.merge(config, options)
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages:
            raise ValueError("a pipeline rank needs at least one stage")
        group = group if group is not None else stages[0].group
        layout = _as_layout(config.layout)
        base_job = config.job if config.job is not None else new_job_id(group)
        job = base_job
        if layout is not None:
            rank = layout.pp_rank if rank is None else rank
            n_ranks = layout.pp if n_ranks is None else n_ranks
            job = layout.job(job)
        if rank is None or n_ranks is None:
            import torch.distributed as dist

            from ...parallel.bootstrap import init_distributed

            init_distributed()
            rank = dist.get_rank(group) if rank is None else rank
            n_ranks = dist.get_world_size(group) if n_ranks is None else n_ranks
        error = None
        try:
            n_stages = stages[0].num_stages
            if n_stages != n_ranks * len(stages):
                raise ValueError(
                    f"{n_stages} stages do not fit {n_ranks} ranks x {len(stages)} virtual stages per rank")
            the_plan = plan(config, n_ranks, len(stages), n_microbatches)
            check_rank(the_plan, rank, stages, config)
            from ...parallel.sharded import check_sharded_stages

            check_sharded_stages({st.stage_index: st.submod for st in stages}, layout, config.deterministic)
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        _agree_on_construction(job, rank, n_ranks, error, START_TIMEOUT_S)
        self._setup(new_event_loop(), the_plan, config, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                    output_merge_spec, scale_grads)
        self.rank, self.group, self.stages, self.job = rank, group, stages, job
        self._modules = [st.submod for st in stages]
        self.transport = _transport(config.transport, rank, n_ranks, job, config.device, stages)
        self._transports = [self.transport]
        self.run(self.transport.start())
        self.runtime = self.run(build_runtime(the_plan, config, rank, stages, self.transport, self._io, job))
        self.runtimes = [self.runtime]
        self.grad_sync = self.sharded = None
        self.tp_agreement = None
        if layout is not None or config.tied:
            from ...parallel.attach import attach_layout
            from ...parallel.layout import ParallelLayout

            self.grad_sync, self.sharded = attach_layout(
                self.runtime, layout or ParallelLayout.build(n_ranks), stages, config.tied, n_stages,
                the_plan.placement.rank_of, tp_exchange=config.tp_exchange, job=base_job, run=self.run,
                join_tp=self._join_tp)
        self.last_stats: StepStats | None = None
        if the_plan.auto:
            self._start_auto(*_auto_share(self.runtime, rank, n_ranks, None if layout is not None else group,
                                          config.watchdog))

    def _join_tp(self, exchange) -> None:
        from ..features import agreement

        self.tp_agreement = agreement.attach(self.runtime, exchange)

    def _book_stats(self, stats: list[StepStats]) -> None:
        self.last_stats = stats[0]

    def _before_backward(self) -> None:
        # Gradients left by a step without zero_grad: one copy keeps them (DP rank 0's, a
        # tie's first owner's), so the DP and tie sums count them once.
        if self.grad_sync is not None:
            self.grad_sync.begin_step()

    def _end_step(self, stats: list[StepStats], mb_losses, losses, forward_only: bool) -> None:
        super()._end_step(stats, mb_losses, losses, forward_only)
        if forward_only and self.sharded is not None:
            self.sharded.reshard()  # a training step reshards after its reduction; this one has none

    async def _aclose(self) -> None:
        await super()._aclose()
        if self.tp_agreement is not None:  # the TP agreement's control transport: say goodbye too
            await self.tp_agreement.aclose()

    def _close_parts(self) -> None:
        # The DP reduction's and TP agreement's helper threads (rrfp.parallel).
        if getattr(self, "grad_sync", None) is not None:
            self.grad_sync.close()
        if getattr(self, "sharded", None) is not None:
            self.sharded.close()
        if getattr(self, "tp_agreement", None) is not None:
            self.tp_agreement.close()


def _auto_share(runtime, rank: int, n_ranks: int, group: Any, timeout_s: float):
    """``(share, say)`` of ``auto`` on this rank: the process group's collectives where
    torch.distributed is initialised (``group``, else every process of the job), else rrfp's
    own control plane; its lines logged by the group's rank 0 only."""
    import torch.distributed as dist

    from ..features.share import ControlShare, DistShare
    from .front import log

    if dist.is_available() and dist.is_initialized():
        return DistShare(group), log.info if dist.get_rank(group) == 0 else None
    return ControlShare(runtime, n_ranks, timeout_s), log.info if rank == 0 else None


def _as_layout(layout: Any):
    """A :class:`~rrfp.parallel.layout.ParallelLayout` from ``layout=`` (None stays None).

    Raises:
        TypeError: neither a ParallelLayout nor a DeviceMesh.
    """
    if layout is None:
        return None
    from ...parallel.layout import ParallelLayout

    if isinstance(layout, ParallelLayout):
        return layout
    if hasattr(layout, "mesh_dim_names"):
        from ...parallel.mesh import layout_from_mesh

        return layout_from_mesh(layout)
    raise TypeError(f"layout={layout!r}: expected a ParallelLayout or a torch DeviceMesh")


def _transport(transport: Any, rank: int, n_ranks: int, job: str, device: Any, stages: Sequence[PipelineStage]):
    """The rank's transport: the caller's, or the registry's by name (default ``zmq``) through
    the store, receiving on the device the stages will compute on."""
    if transport is not None and not isinstance(transport, str):
        return transport
    from ...parallel.bootstrap import default_transport

    if transport is None:
        return default_transport(rank, n_ranks, job)
    plane_device = torch.device(device) if device is not None else stages[0].device
    return default_transport(rank, n_ranks, job, transport, device=plane_device)


def _agree_on_construction(job: str, rank: int, n_ranks: int, error: BaseException | None, timeout_s: float) -> None:
    """Every rank of the pipeline publishes what its own checks found and raises the error of
    the lowest rank that found one, so no rank is left with a bare lost-peer error. Without
    torch.distributed (a caller-made transport), the rank raises its own error alone.

    Raises:
        ValueError, TypeError, RuntimeError: the first failing rank's error, same type and text.
        RuntimeError: a peer that did not publish within ``timeout_s``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    from ...parallel.bootstrap import default_store, wait_for_keys

    store = default_store()
    key = f"rrfp/{job}/constructed/"
    kind = "" if error is None else next((n for n, c in _AGREED_ERRORS.items() if isinstance(error, c)), "RuntimeError")
    text = "" if error is None else f"{kind}:{' '.join(str(error).split())}"[:_MAX_ERROR_CHARS]
    store.set(f"{key}{rank}", text)
    keys = [f"{key}{r}" for r in range(n_ranks)]
    try:
        wait_for_keys(store, keys, timeout_s)
    except Exception as e:  # TimeoutError, or the store's DistStoreError / RuntimeError
        if error is not None:
            raise error
        raise RuntimeError(f"rank {rank}: a peer did not finish building its pipeline within {timeout_s:g} s "
                           f"({type(e).__name__})") from None
    for r in range(n_ranks):
        found = store.get(keys[r]).decode("utf-8", errors="replace")
        if not found:
            continue
        if r == rank and error is not None:
            raise error
        kind, _, message = found.partition(":")
        raise _AGREED_ERRORS.get(kind, RuntimeError)(message)
