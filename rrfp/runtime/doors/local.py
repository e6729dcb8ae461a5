"""In-process pipelines: every rank of a pipeline in one process over an in-process transport.

:class:`LocalPipeline` is :class:`~rrfp.runtime.doors.pipeline.Pipeline` with another process
model: it builds every rank through the same path (:mod:`rrfp.runtime.doors.front`) and runs the
ranks' steps concurrently on one event loop, for users' own unit tests and for ours.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from .config import RuntimeConfig, plan
from .front import FrontDoor, build_runtime, check_rank, new_event_loop
from ..engine.rank import LossFn, StepStats
from ..engine.stage import PipelineStage


class LocalPipeline(FrontDoor):
    """Every rank of a pipeline in this process, over an in-process transport (the fake network).

    For users' unit tests and for ours: the same :class:`RankRuntime` as a real job, with
    seeded per-message delays so messages overtake each other. Steps, returns, defaults and
    closing are :class:`~rrfp.runtime.doors.pipeline.Pipeline`'s, except that :meth:`step` returns
    the step loss by default (``return_outputs=False``). Under the default ``hint="auto"``
    (:class:`Pipeline`'s ``auto``, ``hint_name``) every rank's task records are in this
    process, so the choice needs no process group.

    Args:
        modules: one ``nn.Module`` per stage, in pipeline order (``n_ranks * n_virtual``).
        n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
            scale_grads, config, ``**options``: as :class:`Pipeline` (every rank on the one
            device; each rank its own executor, so with ``cuda`` its own stream). ``tied``
            sums the named parameters' gradients over their stages after each step (modules
            that share one ``nn.Parameter`` need no tie). ``layout`` may only be PP-only.
        n_virtual: virtual stages per rank.
        transport: a name of :mod:`rrfp.transport.registry` that runs within one process
            (``config.transport``; None: ``fake``, tensors ride the fake network): ``fake-plane``
            or ``fake-nccl`` put announcements on the fake network and tensors on an in-process
            data plane (``fake-nccl``: matched by order alone, like NCCL) with the same seeded
            ``delay``, see :attr:`wire`; or one registered from outside.
        delay: ``(low, high)`` seconds of uniform random delay per message.
        seed: seeds the message delays.
        encode: pass every message through the codec, as between processes.
        dw_builders: one per stage (None for none): that stage's ``PipelineStage(dw_builder=)``.

    Raises:
        ValueError: as :class:`Pipeline`; a transport that is not a name of an in-process one,
            a layout with DP or TP, or a stage sharded with FSDP2's ``fully_shard``.
        TypeError: an unknown option.
    """

    RETURN_OUTPUTS = False

    def __init__(
        self,
        modules: Sequence[nn.Module],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        n_virtual: int = 1,
        delay: tuple[float, float] = (0.0, 0.0),
        seed: int = 0,
        encode: bool = True,
        dw_builders: Sequence[Callable[[], Callable[[], None]] | None] | None = None,
        config: RuntimeConfig | None = None,
        **options: Any,
    ) -> None:
        config = RuntimeConfig.merge(config, options)
        n_stages = len(modules)
        if dw_builders is not None and len(dw_builders) != n_stages:
            raise ValueError(f"dw_builders: {len(dw_builders)} given, expected one per stage ({n_stages}, None for none)")
        if n_virtual < 1 or n_stages % n_virtual:
            raise ValueError(f"{n_stages} stage modules do not split into ranks of {n_virtual} virtual stages")
        from ...transport import registry

        transport = "fake" if config.transport is None else config.transport
        if not isinstance(transport, str):
            raise ValueError(f"transport={transport!r}: LocalPipeline builds its ranks' transports by name, expected "
                             f"one of {', '.join(registry.names(registry.LOCAL))}")
        n_ranks = n_stages // n_virtual
        _check_local_layout(config.layout, n_ranks)
        _check_unsharded(modules)
        the_plan = plan(config, n_ranks, n_virtual, n_microbatches)
        ranks = [[PipelineStage(modules[s], s, n_stages, dw_builder=dw_builders[s] if dw_builders else None)
                  for s in the_plan.placement.stages_of(r)] for r in range(n_ranks)]
        for r, stages in enumerate(ranks):
            check_rank(the_plan, r, stages, config)
        job = config.job if config.job is not None else "rrfp-local"
        group = registry.build_local(transport, registry.LocalContext(n_ranks, seed=seed, delay=delay, encode=encode,
                                                                      job=job))
        self._setup(new_event_loop(), the_plan, config, n_microbatches, loss_fn, args_chunk_spec,
                    kwargs_chunk_spec, output_merge_spec, scale_grads)
        self.modules = self._modules = list(modules)
        self.n_ranks = n_ranks
        self._ties = _local_ties(config.tied, self.modules)
        self._group = group
        self.net, self.wire = self._group.network, self._group.wire
        self.transports = self._transports = list(self._group.transports)

        async def build():
            for t in self.transports:
                await t.start()
            return [await build_runtime(the_plan, config, r, ranks[r], self.transports[r], self._io, job)
                    for r in range(n_ranks)]

        self.runtimes = self.run(build())
        self.last_stats: list[StepStats] = []
        if the_plan.auto:
            from ..features.share import LocalShare
            from .front import log

            self._start_auto(LocalShare(), log.info)  # every rank's records are here

    def _abort_transports(self) -> None:
        # All ranks are in this process and end together: none reports the others lost (the
        # user's own error is the one thing to say).
        if self._group.abort_all is not None:
            self._group.abort_all()
        for t in self._transports:
            t.abort()

    def _before_backward(self) -> None:
        # Gradients left by a step without zero_grad stay in a tie's first copy only, so the
        # sum below counts them once (as Pipeline's GradSync: rrfp/parallel/grads.py).
        for params in self._ties:
            for p in params[1:]:
                p.grad = None

    def _after_backward(self) -> None:
        # Tied copies: each owner's gradient becomes the sum over the tie, as Pipeline's
        # GradSync does across processes.
        for params in self._ties:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            total = sum(grads[1:], grads[0].clone())
            for p in params:
                p.grad = total.clone()


def _check_local_layout(layout: Any, n_ranks: int) -> None:
    """A layout in one process can only be the pipeline itself (no DP or TP peers).

    Raises:
        ValueError: a layout with DP or TP, or another PP degree.
    """
    if layout is None:
        return
    degrees = {k: getattr(layout, k, None) for k in ("pp", "dp", "tp")}
    if degrees != {"pp": n_ranks, "dp": 1, "tp": 1}:
        raise ValueError(f"layout {degrees}: LocalPipeline runs one pipeline of {n_ranks} ranks in this process, "
                         f"expected pp={n_ranks}, dp=1, tp=1")


def _check_unsharded(modules: Sequence[nn.Module]) -> None:
    """Raises ValueError: a stage sharded with FSDP2 (one process has no DP peers to shard over)."""
    from ...parallel.sharded import is_sharded

    for s, m in enumerate(modules):
        if is_sharded(m):
            raise ValueError(f"stage {s}'s module is sharded with fully_shard (FSDP2): LocalPipeline runs one pipeline "
                             "in this process, with no data-parallel peers; expected plain modules (sharded stages run "
                             "in Pipeline(..., layout=...) across processes)")


def _local_ties(tied: Any, modules: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """The parameters of each tie, as distinct objects (a shared ``nn.Parameter`` is summed
    by autograd already), the first owner's first (:func:`~rrfp.parallel.grads.tie_copies`).

    Raises:
        ValueError: a bad tie (see :func:`~rrfp.parallel.grads.resolve_ties`) or a parameter
            name a stage does not have.
    """
    if not tied:
        return []
    from ...parallel.grads import resolve_ties, tie_copies

    by_stage = dict(enumerate(modules))
    ties = (tie_copies(tie, by_stage) for tie in resolve_ties(tied, len(modules)))
    return [params for params in ties if len(params) > 1]
