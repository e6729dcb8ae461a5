"""The public API: a pipeline schedule object in the shape of ``torch.distributed.pipelining``.

Switching from PyTorch is a one-line change::

    # schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule = rrfp.Pipeline(stage, n_microbatches=8, loss_fn=loss_fn, hint="bf")
    schedule.step(x, target=y, losses=losses)   # then optimizer.step() as usual

:class:`~rrfp.runtime.local.LocalPipeline` (``rrfp/runtime/local.py``) runs every rank of a
pipeline inside one process over the in-process fake transport, for users' own unit tests.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch

from ..scheduler.hints import DEFAULT_HINT, resolve_hint
from .memory import budget_bytes
from ..scheduler.tasks import Placement
from ..transport.base import Transport
from .executor import make_executor
from .compat import StepIO as _StepIO, check_grad_mode as _check_grad_mode, hint_text, merge_outputs, new_job_id
from .compat import prepare_inputs as _prepare_inputs
from .compat import split_microbatches  # noqa: F401 - public here, as before
from .rank import DelayFn, LossFn, RankRuntime, StepStats
from .split import disable_split_backward
from .stage import PipelineStage


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop where uvloop is installed, else asyncio's default."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()


def _limits(inflight_limit: int | Sequence[int], n_ranks: int) -> list[int]:
    """One in-flight limit per rank.

    Raises:
        ValueError: for a limit that is not an integer >= 1, or a list of the wrong length.
    """
    if isinstance(inflight_limit, int) and not isinstance(inflight_limit, bool):
        limits = [inflight_limit] * n_ranks
    elif isinstance(inflight_limit, (list, tuple)):
        limits = list(inflight_limit)
    else:
        raise ValueError(f"in-flight limit {inflight_limit!r}: expected an integer >= 1 or one per rank")
    if len(limits) != n_ranks or not all(isinstance(x, int) and x >= 1 for x in limits):
        raise ValueError(f"in-flight limits {inflight_limit!r}: expected {n_ranks} integers >= 1, one per rank")
    return limits


def _check_stages(stages: Sequence[PipelineStage], n_stages: int) -> None:
    for s in stages:
        if s.num_stages != n_stages:
            raise ValueError(
                f"stage {s.stage_index} says num_stages={s.num_stages}, but the pipeline has {n_stages} stages"
            )


class Pipeline:
    """This rank's part of a multi-process pipeline (one process per pipeline rank).

    Args:
        stages: this rank's :class:`PipelineStage` (or its virtual stages, in placement order).
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target, **loss_kwargs) -> scalar tensor`` on the last
            stage; None: every step runs forwards only (as PyTorch's schedules).
        args_chunk_spec, kwargs_chunk_spec: how ``step``'s positional and keyword inputs
            split into microbatches (``torch.distributed.pipelining``'s ``TensorChunkSpec``;
            default: tensors along dim 0, other values replicated).
        output_merge_spec: how the last stage's outputs merge (torch's ``merge_chunks``).
        scale_grads: True (default): microbatch losses weighted by their share of the batch
            (``loss_weight_fn`` overrides); False: summed, as PyTorch's ``scale_grads=False``.
        hint: the default hint (``rrfp.scheduler.hints.DEFAULT_HINT``, ``bf``), ``bfw``, ``fb``, ``b-priority``, ``f-priority``, a schedule
            name (``1f1b``, ``gpipe``...; PyTorch's names and classes too: ``Interleaved1F1B``,
            ``Schedule1F1B``) used as a hint, or ``strict-<schedule>`` for the fixed-order
            baseline (RRFP §4).
        inflight_limit: the in-flight limit (RRFP §6, default 32); a sequence gives one per rank.
        placement: ``loop`` or ``v`` for virtual stages.
        loss_weight_fn: ``fn(target) -> float`` weighting microbatch losses (e.g. token counts,
            so the step loss is the mean over all tokens); None: the microbatch's samples
            (dim 0 of its target), so the step loss is the unpipelined batch mean.
        transport: a started-or-not :class:`~rrfp.transport.base.Transport`; default: ZeroMQ
            with endpoints exchanged through torch.distributed's store (initialised from the
            torchrun environment if needed).
            A name picks the data plane of that default: ``"zmq"`` or ``"torch"``
            (torch.distributed point-to-point, NCCL on CUDA stages, gloo on CPU).
        rank, n_ranks: this rank's pipeline index and the pipeline's rank count (default: the
            rank and size of ``group``).
        job: job id in every message key and store entry; default: one per Pipeline built in
            this process (the ranks build theirs in the same order), so pipelines never mix.
        group: the pipeline's process group (default: the stage's ``group``, else the world).
        watchdog: seconds without progress before an error naming what the rank waits for.
        record: keep per-task timestamps in :attr:`last_stats` (for traces).
        task_delay: ``fn(step, rank, task) -> seconds`` of injected delay (experiments).
        deterministic: accumulate weight gradients in microbatch order, so that runs are
            bitwise reproducible whatever order tasks ran in.
        backpressure: with virtual stages, ``admission`` (default: the limit counts
            microbatches in flight per rank) or ``completion-order`` (RRFP App. C.2).
        layout: a :class:`~rrfp.parallel.layout.ParallelLayout` (PP x DP x TP): this rank runs
            pipeline rank ``layout.pp_rank`` of the pipeline at its ``(dp_rank, tp_rank)``; its
            stages' gradients are all-reduced over DP as soon as they are final, the loss is the
            mean over the global batch's tokens, and TP ranks agree before each F and B.
        tied: parameters shared by stages, ``{name: {stage_index: parameter name}}`` (stage -1:
            the last), e.g. ``{"wte": {0: "tok_emb.weight", -1: "head.weight"}}``: their
            gradients are summed over the owning ranks before the step returns. Every rank
            passes the same value.
        tp_exchange: how TP ranks all-gather their proposals: ``control`` (ZeroMQ control
            messages, the default: measured faster here, BENCHMARKS.md) or ``gloo``.
        memory_budget: activation bytes per rank (``64MiB``, ``1.5GB``, an int; None: none):
            a microbatch is admitted only if its measured-size estimate fits
            (:mod:`rrfp.scheduler.memory`, :mod:`rrfp.runtime.memory`).
        device: where the stages compute (``"cpu"``, ``"cuda"``, ``"cuda:1"``); the stage
            modules are moved there. None: where their parameters already are.
        executor: ``auto`` (``cuda`` on a CUDA device, else ``inline``), ``inline``, ``thread``
            or ``cuda`` (see :mod:`rrfp.runtime.executor`).
        launch_ahead: the CUDA executor's launch-ahead window, 1 or 2 tasks.

    Raises:
        ValueError: one line naming a bad argument (unknown hint, stage/rank mismatch...).
    """

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
        hint: Any = DEFAULT_HINT,
        inflight_limit: int | Sequence[int] = 32,
        placement: str = "loop",
        loss_weight_fn: Callable[[Any], float] | None = None,
        transport: Transport | str | None = None,
        rank: int | None = None,
        n_ranks: int | None = None,
        job: str | None = None,
        group: Any = None,
        watchdog: float = 300.0,
        record: bool = False,
        task_delay: DelayFn | None = None,
        deterministic: bool = False,
        backpressure: str = "admission",
        layout=None,
        tied=None,
        tp_exchange: str = "control",
        memory_budget: int | str | None = None,
        device: torch.device | str | None = None,
        executor: str = "auto",
        launch_ahead: int = 1,
    ) -> None:
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages:
            raise ValueError("a pipeline rank needs at least one stage")
        group = group if group is not None else stages[0].group
        job = job if job is not None else new_job_id(group)
        base_job = job
        if layout is not None:
            rank = layout.pp_rank if rank is None else rank
            n_ranks = layout.pp if n_ranks is None else n_ranks
            job = layout.job(job)
        if rank is None or n_ranks is None:
            import torch.distributed as dist

            from .dist import init_distributed

            init_distributed()
            rank = dist.get_rank(group) if rank is None else rank
            n_ranks = dist.get_world_size(group) if n_ranks is None else n_ranks
        n_stages = stages[0].num_stages
        _check_stages(stages, n_stages)
        if n_stages != n_ranks * len(stages):
            raise ValueError(
                f"{n_stages} stages do not fit {n_ranks} ranks x {len(stages)} virtual stages per rank"
            )
        place = Placement(n_ranks, len(stages), placement)
        limits = _limits(inflight_limit, n_ranks)
        self.spec, self.hint, self.strict = resolve_hint(
            hint_text(hint), place, n_microbatches, inflight_limit=limits, backpressure=backpressure
        )
        limit = limits[rank]
        self.rank = rank
        self.group = group
        self.stages = stages
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self.job = job
        self._io = _StepIO(loss_fn, loss_weight_fn)
        self._loop = new_event_loop()
        if transport is None:
            from .dist import default_transport

            transport = default_transport(rank, n_ranks, self.job)
        elif isinstance(transport, str):
            from .dist import default_transport

            # The data plane receives on the device the stages will compute on (device= moves them).
            plane_device = torch.device(device) if device is not None else stages[0].device
            transport = default_transport(rank, n_ranks, self.job, data_plane=transport, device=plane_device)
        self.transport = transport
        self._loop.run_until_complete(self.transport.start())
        self.runtime = self._loop.run_until_complete(
            _make_runtime(
                rank, stages, self.spec, self.hint, transport, strict=self.strict, inflight_limit=limit, job=self.job,
                loss_fn=self._io.loss if loss_fn is not None else None,
                loss_weight_fn=self._io.weight, watchdog=watchdog, task_delay=task_delay, record=record,
                deterministic=deterministic, memory_budget=budget_bytes(memory_budget),
                device=device, executor=executor, launch_ahead=launch_ahead,
            )
        )
        self.grad_sync = None
        if layout is not None or tied:
            from ..parallel.attach import attach_layout
            from ..parallel.layout import ParallelLayout

            self.grad_sync = attach_layout(
                self.runtime, layout or ParallelLayout.build(n_ranks), stages, tied, n_stages, place.rank_of,
                tp_exchange=tp_exchange, job=base_job, run=self._loop.run_until_complete)
        self._step = 0
        self.last_stats: StepStats | None = None
        self.last_loss: torch.Tensor | None = None

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        microbatches: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step's forwards and backwards on this rank (then call ``optimizer.step()``).

        As ``torch.distributed.pipelining``'s ``step``: the rank holding stage 0 passes the
        whole batch as ``*args``/``**kwargs``, split into ``n_microbatches`` by torch's
        ``split_args_kwargs_into_chunks`` under ``args_chunk_spec``/``kwargs_chunk_spec``
        (default: tensors along dim 0, ``torch.tensor_split`` sizes; other values replicated);
        keyword inputs given on any rank reach that rank's stage forwards. The last stage's
        rank passes ``target`` (split along dim 0). Gradients accumulate into ``.grad``.
        rrfp extension: ``microbatches`` (one tuple per microbatch, e.g. each padded to its
        own length) and ``targets`` pass pre-split inputs.

        Args:
            losses: a list, cleared and filled with the ``n_microbatches`` unweighted
                microbatch losses (last stage).
            return_outputs: return the last stage's outputs.
            loss_kwargs: extra keyword arguments of ``loss_fn``.

        Returns:
            on the rank holding the last stage, its microbatch outputs in microbatch order,
            merged by torch's ``merge_chunks`` under ``output_merge_spec`` (detached), or
            their list with pre-split ``microbatches``; else None. The step loss (microbatch
            losses weighted by their share of the batch, or summed without ``scale_grads``)
            is in :attr:`last_loss`.

        Raises:
            RuntimeError: called under ``torch.no_grad()`` (use :meth:`eval`), or after close.
            ValueError: inputs that do not split into ``n_microbatches``.
        """
        _check_grad_mode(self)
        return self._run(args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches, targets, False)

    def eval(self, *args: Any, target: Any = None, losses: list | None = None,
             microbatches: Sequence[tuple] | None = None, targets: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Forwards only (no autograd graph kept, no gradients): as :meth:`step` otherwise.
        The last stage's rank gets its merged outputs; with a target and a ``loss_fn``,
        ``losses`` is filled and :attr:`last_loss` set."""
        return self._run(args, kwargs, target, losses, True, None, microbatches, targets, True)

    def _run(self, args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches, targets, forward_only):
        if self._loop.is_closed():
            raise RuntimeError("this pipeline is closed: build a new one to run more steps")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
        has_first = 0 in self.runtime.stages
        has_last = self.spec.n_stages - 1 in self.runtime.stages
        presplit = microbatches is not None or targets is not None
        mbs, kwarg_mbs, targets = _prepare_inputs(self, args, kwargs, microbatches, target, targets, has_first, has_last)
        keep = has_last and return_outputs
        self._io.loss_kwargs = dict(loss_kwargs or {})
        outputs: dict | None = {} if keep else None
        mb_losses: list | None = [] if has_last else None
        stats = self._loop.run_until_complete(_run_step(
            self.runtime, self._step, mbs, kwarg_mbs, targets, mb_losses, outputs,
            forward_only or self.loss_fn is None, self.scale_grads,
        ))
        self._end_step(stats, mb_losses, losses)
        return _result(outputs, self.n_microbatches, self.output_merge_spec, presplit) if keep else None

    def _end_step(self, stats: StepStats, mb_losses: list | None, losses: list | None) -> None:
        """Book a finished step: its stats, its loss, and ``losses`` filled with one entry per
        microbatch (on the last stage's rank, where ``mb_losses`` is a list)."""
        self._step += 1
        self.last_stats = stats
        self.last_loss = None if stats.loss is None else torch.tensor(stats.loss)
        if losses is not None and mb_losses is not None:
            losses.clear()
            losses.extend(mb_losses)

    async def astep(self, *args, target=None, losses=None, microbatches=None, targets=None, **kwargs):
        """Coroutine form of :meth:`step` (for callers that run their own event loop);
        returns the step loss on the last stage's rank, else None."""
        _check_grad_mode(self)
        has_first = 0 in self.runtime.stages
        has_last = self.spec.n_stages - 1 in self.runtime.stages
        mbs, kwarg_mbs, targets = _prepare_inputs(self, args, kwargs, microbatches, target, targets, has_first, has_last)
        self._io.loss_kwargs = {}
        mb_losses: list | None = [] if has_last else None
        stats = await _run_step(self.runtime, self._step, mbs, kwarg_mbs, targets, mb_losses, None,
                                self.loss_fn is None, self.scale_grads)
        self._end_step(stats, mb_losses, losses)
        return self.last_loss

    def run(self, coro):
        """Run a coroutine on this rank's event loop (e.g. ``runtime.control()``)."""
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        """Say goodbye to the peers (waits until every rank is done) and free the sockets."""
        if self._loop.is_closed():
            return
        try:
            self._loop.run_until_complete(self.runtime.close())
            self._loop.run_until_complete(self.transport.close())
            agree = getattr(self.runtime.loop, "agree", None)
            if hasattr(agree, "aclose"):  # the TP agreement's control transport: say goodbye too
                self._loop.run_until_complete(agree.aclose())
        finally:
            self._loop.close()
            _unpatch(self.stages)
            self._close_parallel()

    def _close_parallel(self) -> None:
        # The DP reduction's and TP agreement's helper threads (rrfp.parallel).
        if getattr(self, "grad_sync", None) is not None:
            self.grad_sync.close()
        agree = getattr(self.runtime.loop, "agree", None)
        if hasattr(agree, "close"):
            agree.close()

    def abort(self) -> None:
        """Close at once without waiting for peers (error path)."""
        self.transport.abort()
        self.runtime.stop()  # the inbox's timer fd, the executor's threads: before the loop closes
        if not self._loop.is_closed():
            self._loop.close()
        _unpatch(self.stages)


def _result(outputs: dict, n_microbatches: int, spec, presplit: bool) -> Any:
    """The last stage's outputs in microbatch order: merged (torch's ``merge_chunks``), or a
    list when the caller passed pre-split ``microbatches``/``targets`` (each microbatch may
    have its own length)."""
    chunks = [outputs[m] for m in range(n_microbatches)]
    return chunks if presplit else merge_outputs(chunks, spec)


def _unpatch(stages: Sequence[PipelineStage]) -> None:
    # The split backward patched the user's layers; a closed pipeline leaves them as given.
    for st in stages:
        disable_split_backward(st.submod)


async def _run_step(rt: RankRuntime, step: int, mbs, kwarg_mbs, targets, losses, outputs, forward_only: bool,
                    scale_grads: bool) -> StepStats:
    """One step of one rank's runtime (the arguments Pipeline and LocalPipeline share)."""
    return await rt.run_step(step, mbs, targets, losses, kwargs=kwarg_mbs, outputs=outputs,
                             forward_only=forward_only, sum_losses=not scale_grads)


async def _make_runtime(rank: int, stages: Sequence[PipelineStage], *args, device=None, executor: str = "auto",
                        launch_ahead: int = 1, **kwargs) -> RankRuntime:
    """One rank's runtime, for :class:`Pipeline` and :class:`LocalPipeline` alike: its stages
    moved to ``device``, its executor made by name. Built inside the loop so that its asyncio
    primitives bind to it.

    Raises:
        ValueError: an unknown executor, or ``cuda`` on a non-CUDA device.
        RuntimeError: a CUDA device or executor without CUDA.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {str(device)!r}: torch.cuda.is_available() is False")
        for st in stages:
            st.submod.to(device)
            st.device = device
    ex = make_executor(executor, stages[0].device, window=launch_ahead)
    return RankRuntime(rank, stages, *args, executor=ex, **kwargs)
