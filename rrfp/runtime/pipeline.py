"""The public API: a pipeline schedule object in the shape of ``torch.distributed.pipelining``.

Switching from PyTorch is a one-line change::

    # schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule = rrfp.Pipeline(stage, n_microbatches=8, loss_fn=loss_fn, hint="bf")
    schedule.step(x, target=y, losses=losses)   # then optimizer.step() as usual

:class:`LocalPipeline` runs every rank of a pipeline inside one process over the in-process
fake transport, for users' own unit tests.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..scheduler.hints import resolve_hint
from .memory import budget_bytes
from ..scheduler.tasks import Placement
from ..transport.base import Transport
from .executor import make_executor
from .rank import DelayFn, LossFn, RankRuntime, StepStats
from .stage import PipelineStage, as_tuple


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop where uvloop is installed, else asyncio's default."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()


def split_microbatches(args: Sequence[Any], n_microbatches: int, what: str = "input") -> list[tuple]:
    """Split each tensor of ``args`` along dim 0 into ``n_microbatches`` parts
    (``torch.tensor_split`` sizes: as equal as possible, earlier parts one larger).

    Returns:
        one tuple per microbatch, holding that microbatch's slice of every argument.

    Raises:
        ValueError: when a tensor's batch size is smaller than ``n_microbatches``.
    """
    parts = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{what} arguments must be tensors, got {type(a).__name__}")
        if a.dim() == 0 or a.shape[0] < n_microbatches:
            size = 0 if a.dim() == 0 else a.shape[0]
            raise ValueError(
                f"n_microbatches={n_microbatches} exceeds the {what} batch size {size}: "
                "each microbatch needs at least one sample"
            )
        parts.append(torch.tensor_split(a, n_microbatches, dim=0))
    return [tuple(p[m] for p in parts) for m in range(n_microbatches)]


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
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` on the last stage.
        hint: ``bf`` (default), ``bfw``, ``fb``, ``b-priority``, ``f-priority``, a schedule
            name (``1f1b``, ``gpipe``...) used as a hint, or ``strict-<schedule>`` for the
            fixed-order baseline (RRFP §4).
        inflight_limit: the in-flight limit (RRFP §6, default 32); a sequence gives one per rank.
        placement: ``loop`` or ``v`` for virtual stages.
        loss_weight_fn: ``fn(target) -> float`` weighting microbatch losses (e.g. token counts,
            so the step loss is the mean over all tokens); None: each microbatch ``1/M``.
        transport: a started-or-not :class:`~rrfp.transport.base.Transport`; default: ZeroMQ
            with endpoints exchanged through torch.distributed's store (initialised from the
            torchrun environment if needed).
            A name picks the data plane of that default: ``"zmq"`` or ``"torch"``
            (torch.distributed point-to-point, NCCL on CUDA stages, gloo on CPU).
        rank, n_ranks: this rank's pipeline index and the pipeline's rank count (default: the
            torch.distributed rank and world size).
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
        *,
        hint: str = "bf",
        inflight_limit: int | Sequence[int] = 32,
        placement: str = "loop",
        loss_weight_fn: Callable[[Any], float] | None = None,
        transport: Transport | str | None = None,
        rank: int | None = None,
        n_ranks: int | None = None,
        job: str = "rrfp",
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
        if layout is not None:
            rank = layout.pp_rank if rank is None else rank
            n_ranks = layout.pp if n_ranks is None else n_ranks
            base_job, job = job, layout.job(job)
        if rank is None or n_ranks is None:
            import torch.distributed as dist

            from .dist import init_distributed

            init_distributed()
            rank = dist.get_rank() if rank is None else rank
            n_ranks = dist.get_world_size() if n_ranks is None else n_ranks
        n_stages = stages[0].num_stages
        _check_stages(stages, n_stages)
        if n_stages != n_ranks * len(stages):
            raise ValueError(
                f"{n_stages} stages do not fit {n_ranks} ranks x {len(stages)} virtual stages per rank"
            )
        place = Placement(n_ranks, len(stages), placement)
        limits = _limits(inflight_limit, n_ranks)
        self.spec, self.hint, self.strict = resolve_hint(
            hint, place, n_microbatches, inflight_limit=limits, backpressure=backpressure
        )
        limit = limits[rank]
        self.rank = rank
        self.stages = stages
        self.n_microbatches = n_microbatches
        self._loop = new_event_loop()
        if transport is None:
            from .dist import default_transport

            transport = default_transport(rank, n_ranks, job)
        elif isinstance(transport, str):
            from .dist import default_transport

            # The data plane receives on the device the stages will compute on (device= moves them).
            plane_device = torch.device(device) if device is not None else stages[0].device
            transport = default_transport(rank, n_ranks, job, data_plane=transport, device=plane_device)
        self.transport = transport
        self._loop.run_until_complete(self.transport.start())
        self.runtime = self._loop.run_until_complete(
            _make_runtime(
                rank, stages, self.spec, self.hint, transport, strict=self.strict, inflight_limit=limit, job=job,
                loss_fn=loss_fn, loss_weight_fn=loss_weight_fn, watchdog=watchdog, task_delay=task_delay, record=record,
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
                tp_exchange=tp_exchange, job=base_job if layout is not None else job, run=self._loop.run_until_complete)
        self._step = 0
        self.last_stats: StepStats | None = None

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        microbatches: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> torch.Tensor | None:
        """Run one step's forwards and backwards on this rank (then call ``optimizer.step()``).

        Stage 0's rank passes the whole batch as ``*args`` (split along dim 0 into
        ``n_microbatches``) or pre-split ``microbatches`` (one tuple per microbatch, e.g. each
        padded to its own length); the last stage's rank passes ``target`` (split the same
        way) or ``targets``. Gradients accumulate into the parameters' ``.grad``.

        Returns:
            on the rank holding the last stage, the step loss (weighted sum of microbatch
            losses, a detached scalar); elsewhere None.
        """
        if self._loop.is_closed():
            raise RuntimeError("this pipeline is closed: build a new one to run more steps")
        return self._loop.run_until_complete(
            self.astep(*args, target=target, losses=losses, microbatches=microbatches, targets=targets)
        )

    async def astep(self, *args, target=None, losses=None, microbatches=None, targets=None) -> torch.Tensor | None:
        """Coroutine form of :meth:`step`, for callers that run their own event loop."""
        M = self.n_microbatches
        # Like PyTorch's schedules, every rank may pass inputs and target: each rank uses only
        # what its stages need.
        if 0 not in self.runtime.stages:
            microbatches = None
        elif microbatches is None and args:
            microbatches = split_microbatches(args, M)
        if self.spec.n_stages - 1 not in self.runtime.stages:
            targets = None
        elif targets is None and target is not None:
            targets = [t[0] for t in split_microbatches([target], M, "target")]
        stats = await self.runtime.run_step(self._step, microbatches, targets, losses)
        self._step += 1
        self.last_stats = stats
        return None if stats.loss is None else torch.tensor(stats.loss)

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
        if not self._loop.is_closed():
            self._loop.close()


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


class LocalPipeline:
    """Every rank of a pipeline in this process, over the in-process fake transport.

    For users' unit tests and for ours: the same :class:`RankRuntime` as a real job, with
    seeded per-message delays so messages overtake each other.

    Args:
        modules: one ``nn.Module`` per stage, in pipeline order (``n_ranks * n_virtual``).
        n_microbatches, loss_fn, hint, inflight_limit, placement, loss_weight_fn: as
            :class:`Pipeline`.
        n_virtual: virtual stages per rank.
        delay: ``(low, high)`` seconds of uniform random delay per message.
        seed: seeds the message delays.
        data_plane: None (tensors ride the fake network), ``fake`` or ``fake-nccl``: announcements
            on the fake network, tensors on an in-process data plane (``fake-nccl``: matched by
            order alone, like NCCL) with the same seeded ``delay``; see :attr:`wire`.
        encode: pass every message through the codec, as between processes.
        task_delay: ``fn(step, rank, task) -> seconds`` of injected compute time.
        deterministic, memory_budget: as :class:`Pipeline`.
        deterministic, device, executor, launch_ahead: as :class:`Pipeline` (every rank on
            the one device; each rank its own executor, so with ``cuda`` its own stream).

    Raises:
        ValueError: as :class:`Pipeline`.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        n_microbatches: int,
        loss_fn: LossFn,
        *,
        hint: str = "bf",
        inflight_limit: int | Sequence[int] = 32,
        n_virtual: int = 1,
        placement: str = "loop",
        loss_weight_fn: Callable[[Any], float] | None = None,
        delay: tuple[float, float] = (0.0, 0.0),
        seed: int = 0,
        data_plane: str | None = None,
        encode: bool = True,
        record: bool = False,
        task_delay: DelayFn | None = None,
        watchdog: float = 60.0,
        job: str = "rrfp-local",
        deterministic: bool = False,
        backpressure: str = "admission",
        memory_budget: int | str | None = None,
        device: torch.device | str | None = None,
        executor: str = "auto",
        launch_ahead: int = 1,
    ) -> None:
        from ..transport.fake import FakeNetwork

        n_stages = len(modules)
        if n_stages % n_virtual:
            raise ValueError(f"{n_stages} stage modules do not split into ranks of {n_virtual} virtual stages")
        n_ranks = n_stages // n_virtual
        place = Placement(n_ranks, n_virtual, placement)
        limits = _limits(inflight_limit, n_ranks)
        self.spec, self.hint, self.strict = resolve_hint(
            hint, place, n_microbatches, inflight_limit=limits, backpressure=backpressure
        )
        self.n_microbatches = n_microbatches
        self.n_ranks = n_ranks
        self._loop = new_event_loop()
        self.net = FakeNetwork(n_ranks, seed=seed, delay=delay, encode=encode)
        self.transports = [self.net.transport(r) for r in range(n_ranks)]
        self.wire = None
        if data_plane is not None:
            from ..transport.factory import wrap_fake

            self.transports, self.wire = wrap_fake(self.transports, data_plane, seed=seed + 1, delay=delay)

        async def build() -> list[RankRuntime]:
            for t in self.transports:
                await t.start()
            return [
                await _make_runtime(
                    r,
                    [PipelineStage(modules[s], s, n_stages) for s in place.stages_of(r)],
                    self.spec, self.hint, self.transports[r], strict=self.strict, inflight_limit=limits[r],
                    job=job, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn, watchdog=watchdog,
                    task_delay=task_delay, record=record, deterministic=deterministic,
                    memory_budget=budget_bytes(memory_budget),
                    device=device, executor=executor, launch_ahead=launch_ahead,
                )
                for r in range(n_ranks)
            ]

        self.runtimes = self._loop.run_until_complete(build())
        self._step = 0
        self.last_stats: list[StepStats] = []

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        microbatches: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> torch.Tensor:
        """Run one step of every rank; returns the step loss (detached scalar)."""
        if self._loop.is_closed():
            raise RuntimeError("this pipeline is closed: build a new one to run more steps")
        M = self.n_microbatches
        if microbatches is None:
            microbatches = split_microbatches(args, M)
        if targets is None:
            if target is None:
                raise ValueError("the last stage needs a target: pass target= or targets=")
            targets = [t[0] for t in split_microbatches([target], M, "target")]
        microbatches = [as_tuple(x) for x in microbatches]
        last_rank = self.spec.placement.rank_of(self.spec.n_stages - 1)

        async def run() -> list[StepStats]:
            coros = [
                rt.run_step(
                    self._step,
                    microbatches if 0 in rt.stages else None,
                    targets if r == last_rank else None,
                    losses if r == last_rank else None,
                )
                for r, rt in enumerate(self.runtimes)
            ]
            tasks = [asyncio.ensure_future(c) for c in coros]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        self.last_stats = self._loop.run_until_complete(run())
        self._step += 1
        return torch.tensor(self.last_stats[last_rank].loss)

    def close(self) -> None:
        """Stop every rank's receiving, close the transports and the loop."""
        if self._loop.is_closed():
            return

        async def shut() -> None:
            for rt in self.runtimes:
                await rt.close()
            await asyncio.gather(*(t.close() for t in self.transports))

        try:
            self._loop.run_until_complete(shut())
        finally:
            self._loop.close()

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

