"""In-process pipelines: every rank of a pipeline in one process over the fake transport.

:class:`LocalPipeline` builds each rank through the same construction path as
:class:`~rrfp.runtime.pipeline.Pipeline` (``_make_runtime``) and runs the ranks' steps
concurrently on one event loop, for users' own unit tests and for ours.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..scheduler.hints import DEFAULT_HINT, resolve_hint
from ..scheduler.tasks import Placement
from .compat import StepIO as _StepIO, check_grad_mode as _check_grad_mode, hint_text
from .compat import prepare_inputs as _prepare_inputs
from .memory import budget_bytes
from .pipeline import _limits, _make_runtime, _result, _run_step, new_event_loop
from .rank import DelayFn, LossFn, RankRuntime, StepStats
from .split import disable_split_backward
from .stage import PipelineStage


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
        dw_builders: one per stage (None for none): that stage's ``PipelineStage(dw_builder=)``.

    Raises:
        ValueError: as :class:`Pipeline`.
    """

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
        hint: Any = DEFAULT_HINT,
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
        dw_builders: Sequence[Callable[[], Callable[[], None]] | None] | None = None,
    ) -> None:
        from ..transport.fake import FakeNetwork

        n_stages = len(modules)
        if dw_builders is not None and len(dw_builders) != n_stages:
            raise ValueError(f"dw_builders: {len(dw_builders)} given, expected one per stage ({n_stages}, None for none)")
        if n_stages % n_virtual:
            raise ValueError(f"{n_stages} stage modules do not split into ranks of {n_virtual} virtual stages")
        n_ranks = n_stages // n_virtual
        place = Placement(n_ranks, n_virtual, placement)
        limits = _limits(inflight_limit, n_ranks)
        self.spec, self.hint, self.strict = resolve_hint(
            hint_text(hint), place, n_microbatches, inflight_limit=limits, backpressure=backpressure
        )
        self.n_microbatches = n_microbatches
        self.modules = list(modules)
        self.loss_fn = loss_fn
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._io = _StepIO(loss_fn, loss_weight_fn)
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
                    [PipelineStage(modules[s], s, n_stages, dw_builder=dw_builders[s] if dw_builders else None)
                     for s in place.stages_of(r)],
                    self.spec, self.hint, self.transports[r], strict=self.strict, inflight_limit=limits[r],
                    job=job, loss_fn=self._io.loss if loss_fn is not None else None,
                    loss_weight_fn=self._io.weight, watchdog=watchdog,
                    task_delay=task_delay, record=record, deterministic=deterministic,
                    memory_budget=budget_bytes(memory_budget),
                    device=device, executor=executor, launch_ahead=launch_ahead,
                )
                for r in range(n_ranks)
            ]

        self.runtimes = self._loop.run_until_complete(build())
        self._step = 0
        self.last_stats: list[StepStats] = []
        self.last_loss: torch.Tensor | None = None

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        return_outputs: bool = False,
        loss_kwargs: dict[str, Any] | None = None,
        microbatches: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step of every rank, with :meth:`Pipeline.step`'s arguments (the inputs
        reach stage 0, the keyword inputs every stage, the target the last stage).

        Returns:
            the step loss (detached scalar), or with ``return_outputs=True`` the last stage's
            merged outputs (as :meth:`Pipeline.step`; the loss is then in :attr:`last_loss`).
        """
        _check_grad_mode(self)
        if targets is None and target is None and self.loss_fn is not None:
            raise ValueError("the last stage needs a target: pass target= or targets=")
        out = self._run(args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches, targets, False)
        return out if return_outputs else self.last_loss

    def eval(self, *args: Any, target: Any = None, losses: list | None = None,
             microbatches: Sequence[tuple] | None = None, targets: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Forwards only on every rank (no graph kept); returns the last stage's merged outputs."""
        return self._run(args, kwargs, target, losses, True, None, microbatches, targets, True)

    def _run(self, args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches, targets, forward_only):
        if self._loop.is_closed():
            raise RuntimeError("this pipeline is closed: build a new one to run more steps")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
        presplit = microbatches is not None or targets is not None
        mbs, kwarg_mbs, targets = _prepare_inputs(self, args, kwargs, microbatches, target, targets, True, True)
        self._io.loss_kwargs = dict(loss_kwargs or {})
        outputs: dict | None = {} if return_outputs else None
        forward_only = forward_only or self.loss_fn is None
        last_rank = self.spec.placement.rank_of(self.spec.n_stages - 1)
        mb_losses: list = []

        async def run() -> list[StepStats]:
            coros = [
                _run_step(
                    rt, self._step,
                    mbs if 0 in rt.stages else None,
                    kwarg_mbs,
                    targets if r == last_rank else None,
                    mb_losses if r == last_rank else None,
                    outputs if r == last_rank else None,
                    forward_only, self.scale_grads,
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
        loss = self.last_stats[last_rank].loss
        self.last_loss = None if loss is None else torch.tensor(loss)
        if losses is not None:
            losses.clear()
            losses.extend(mb_losses)
        return _result(outputs, self.n_microbatches, self.output_merge_spec, presplit) if return_outputs else None

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
            for m in self.modules:
                disable_split_backward(m)

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

