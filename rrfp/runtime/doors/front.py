"""The one construction path and the one step path of both front doors.

:class:`~rrfp.runtime.doors.pipeline.Pipeline` (one process per pipeline rank) and
:class:`~rrfp.runtime.doors.local.LocalPipeline` (every rank in this process) subclass
:class:`FrontDoor` and differ only in the process model: which ranks they build, over which
transport. Everything else, the configuration (:class:`~rrfp.runtime.doors.config.RuntimeConfig`),
how a rank's runtime is built (:func:`build_runtime`), how a step's inputs are split and its
outputs merged, what ``step`` returns and how a pipeline closes, is written here once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import torch

from .compat import StepIO, check_grad_mode, merge_outputs, prepare_inputs
from ...scheduler.hints import resolve_hint
from ...scheduler.memory import over_budget, overrun_line
from ...scheduler.tasks import Placement
from .config import Plan, RuntimeConfig
from ..engine.executor import EXECUTORS, make_executor
from ..engine.rank import RankRuntime, StepStats
from ..engine.split import disable_split_backward
from ..engine.stage import PipelineStage
from ..features import notices

log = logging.getLogger("rrfp")

# abort()'s bound on ending a cut-short step's tasks, seconds: cancelled tasks end within a
# loop turn or two; this only keeps one that swallows its cancellation from holding an exit.
ABORT_DRAIN_S = 2.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop where uvloop is installed, else asyncio's default."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()


def check_rank(plan: Plan, rank: int, stages: Sequence[PipelineStage], config: RuntimeConfig) -> None:
    """What one rank can check alone before any peer is contacted: its stages' count and
    indices against the placement, its executor's name and its device.

    Raises:
        ValueError: one line naming the mismatch (e.g. V-style stages without ``placement="v"``).
        RuntimeError: a CUDA device without CUDA.
    """
    n_stages = plan.spec.n_stages
    for s in stages:
        if s.num_stages != n_stages:
            raise ValueError(
                f"stage {s.stage_index} says num_stages={s.num_stages}, but the pipeline has {n_stages} stages")
    want, got = plan.placement.stages_of(rank), [s.stage_index for s in stages]
    if got != want:
        hint = " (V-style stages need placement='v')" if _v_stages(plan, rank) == got else ""
        raise ValueError(f"rank {rank} holds stages {want} under placement {plan.placement.kind!r}, "
                         f"but got stages {got}{hint}")
    if config.executor not in ("auto", *EXECUTORS):
        raise ValueError(f"executor {config.executor!r}: expected one of auto, {', '.join(EXECUTORS)}")
    if config.device is not None and torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(config.device)!r}: torch.cuda.is_available() is False")


def _v_stages(plan: Plan, rank: int) -> list[int]:
    p = plan.placement
    try:
        return Placement(p.n_ranks, p.n_virtual, "v").stages_of(rank) if p.kind != "v" else []
    except ValueError:  # a shape V cannot place
        return []


def move_module(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)``, skipped where every parameter and buffer is there already: on a
    module that FSDP2's ``fully_shard`` sharded, even a move to where it is gives each parameter
    a new ``nn.Parameter`` object without the attributes set on the old one (a TP shard's
    ``_rrfp_tp_shard``, which global-norm clipping counts by)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # where .to("cuda") would go

    def there(t: torch.Tensor) -> bool:
        return t.device.type == device.type and (device.index is None or t.device.index == device.index)

    tensors = [*module.parameters(), *module.buffers()]
    if not all(there(t) for t in tensors):
        module.to(device)


async def build_runtime(plan: Plan, config: RuntimeConfig, rank: int, stages: Sequence[PipelineStage],
                        transport, io: StepIO, job: str) -> RankRuntime:
    """One rank's runtime, for every front door: its stages moved to ``config.device``, its
    executor made by name, backfilling's started notices attached
    (:mod:`rrfp.runtime.features.notices`). Built inside the loop so that its asyncio
    primitives bind to it.

    Raises:
        ValueError: an unknown executor, or ``cuda`` on a non-CUDA device.
        RuntimeError: a CUDA device or executor without CUDA.
    """
    if config.device is not None:
        device = torch.device(config.device)
        for st in stages:
            move_module(st.submod, device)
            st.device = device
    ex = make_executor(config.executor, stages[0].device, window=config.launch_ahead)
    rt = RankRuntime(
        rank, stages, plan.spec, plan.hint, transport, strict=plan.strict, inflight_limit=plan.limits[rank],
        job=job, loss_fn=io.loss if io.loss_fn is not None else None, loss_weight_fn=io.weight,
        watchdog=config.watchdog, task_delay=config.task_delay, record=config.record,
        deterministic=config.deterministic, executor=ex, memory_budget=plan.budget,
    )
    notices.attach(rt)
    return rt


class FrontDoor:
    """What :class:`Pipeline` and :class:`LocalPipeline` share: the step, eval and close paths.

    A subclass sets, in its constructor, :meth:`_setup`'s fields (with an event loop from its
    own module's ``new_event_loop``, which tests replace with a simulated-time loop), then
    ``runtimes`` (the ranks this process runs) and ``_transports`` (theirs), then, under
    ``hint="auto"``, :meth:`_start_auto` with how its ranks share figures.

    Attributes:
        runtimes: the :class:`~rrfp.runtime.engine.rank.RankRuntime` of every rank this process
            runs (one for :class:`~rrfp.runtime.doors.pipeline.Pipeline`), in rank order.
        spec, hint, strict: what the next step runs (:meth:`set_hint` changes them).
        auto: the ``auto`` controller (:class:`~rrfp.runtime.features.auto.AutoHint`; None under a
            named hint), run around every training step while ``drive_auto`` is True.
        on_overrun: says the first training step in which a rank of this process broke the
            memory budget (:func:`~rrfp.scheduler.memory.overrun_line`; a strict order cannot
            wait for bytes); default: a warning on the ``rrfp`` logger; None: nothing
            (``rrfp train`` says it once for every rank instead).
    """

    #: what :meth:`step` returns by default: the last stage's outputs (True) or the loss.
    RETURN_OUTPUTS = True

    def _setup(self, loop: asyncio.AbstractEventLoop, plan: Plan, config: RuntimeConfig, n_microbatches: int,
               loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads: bool) -> None:
        self.config = config
        self.plan = plan
        self.spec, self.hint, self.strict = plan.spec, plan.hint, plan.strict
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._io = StepIO(loss_fn, config.loss_weight_fn)
        self._loop = loop
        self.runtimes: list[RankRuntime] = []
        self._hint_text: str | None = None  # set_hint's, when called
        self._transports: list = []
        self._modules: list = []
        self._step = 0
        self.last_loss: float | None = None
        self.auto = None
        self.drive_auto = True
        self._auto_steps = 0
        self.on_overrun: Callable[[str], None] | None = log.warning
        self._over_said = False

    def _start_auto(self, share, say: Callable[[str], None] | None) -> None:
        """Under ``hint="auto"``, the controller (:class:`~rrfp.runtime.features.auto.AutoHint`) that
        chooses the hint on this pipeline's training steps; ``say``: its lines (one process)."""
        if not self.plan.auto:
            return
        from ..features.auto import AutoHint

        self.auto = AutoHint(self, share, say=say, recheck_every=self.config.auto_recheck,
                             same_backward=self.config.deterministic)

    @property
    def hint_name(self) -> str:
        """The hint the last training step ran, as text (before the first: the first one's;
        under ``auto`` a measuring or trial candidate, or the kept one, ``auto.chosen``)."""
        from .names import hint_text

        if self.auto is not None:
            return self.auto.current
        return self._hint_text if self._hint_text is not None else hint_text(self.config.hint)

    def set_hint(self, text: str) -> None:
        """Run the hint ``text`` (any form ``hint=`` takes but ``auto``) on every rank this
        process runs, from the next step on: the pipeline's and every rank's spec, hint and
        strict mode, each rank's split backward and its step hooks' final kind
        (:meth:`RankRuntime.set_hint <rrfp.runtime.engine.rank.RankRuntime.set_hint>`), at this
        pipeline's in-flight limits and backpressure. Every process of the pipeline must switch
        before the same step (``auto`` does: :mod:`rrfp.runtime.features.auto`).

        Raises:
            ValueError: a hint that does not resolve for this pipeline's placement and
                microbatches (nothing changed).
        """
        spec, hint, strict = resolve_hint(text, self.spec.placement, self.n_microbatches,
                                          inflight_limit=list(self.plan.limits), backpressure=self.config.backpressure)
        for rt in self.runtimes:
            rt.set_hint(spec, hint, strict)
        self.spec, self.hint, self.strict = spec, hint, strict
        self._hint_text = text

    # ------------------------------------------------------------------ steps

    def step(self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool | None = None,
             loss_kwargs: dict[str, Any] | None = None, microbatches: Sequence[tuple] | None = None,
             targets: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Run one step's forwards and backwards (then call ``optimizer.step()``).

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
            return_outputs: True: return the last stage's outputs; False: the step loss; None:
                the class's default (:attr:`RETURN_OUTPUTS`: ``Pipeline`` True, as PyTorch's
                schedules; ``LocalPipeline`` False).
            loss_kwargs: extra keyword arguments of ``loss_fn``.

        Returns:
            on the rank holding the last stage: its microbatch outputs in microbatch order,
            merged by torch's ``merge_chunks`` under ``output_merge_spec`` (detached), or
            their list with pre-split ``microbatches``; or, with ``return_outputs=False``, the
            step loss as a 0-dim detached tensor (microbatch losses weighted by their share of
            the batch, or summed without ``scale_grads``; also :attr:`last_loss` as a float).
            Other ranks: None.

        Raises:
            RuntimeError: called under ``torch.no_grad()`` (use :meth:`eval`), or after close.
            ValueError: inputs that do not split into ``n_microbatches``, no target for
                the last stage with a ``loss_fn``, or a target whose batch (dim 0) is not the
                inputs' where this process is given both (one line naming both sizes).
        """
        check_grad_mode(self)
        keep = self.RETURN_OUTPUTS if return_outputs is None else return_outputs
        return self._loop_run(self._step_async(args, kwargs, target, losses, keep, loss_kwargs, microbatches,
                                               targets, False))

    async def astep(self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = False,
                    loss_kwargs: dict[str, Any] | None = None, microbatches: Sequence[tuple] | None = None,
                    targets: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Coroutine form of :meth:`step`, on the caller's event loop (the one the pipeline
        was built on: run it with :meth:`run`); returns the step loss by default."""
        check_grad_mode(self)
        return await self._step_async(args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches,
                                      targets, False)

    def eval(self, *args: Any, target: Any = None, losses: list | None = None,
             microbatches: Sequence[tuple] | None = None, targets: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Forwards only (no autograd graph kept, no gradients): as :meth:`step` otherwise.
        The last stage's rank gets its merged outputs; with a target and a ``loss_fn``,
        ``losses`` is filled and :attr:`last_loss` set."""
        return self._loop_run(self._step_async(args, kwargs, target, losses, True, None, microbatches, targets, True))

    def run(self, coro):
        """Run a coroutine on this pipeline's event loop (e.g. :meth:`astep`, ``runtime.control()``)."""
        try:
            return self._loop.run_until_complete(coro)
        except (KeyboardInterrupt, SystemExit):
            # These leave the loop at once, the step's other tasks pending: end them now, so
            # that close() neither raises the interrupt again nor logs it.
            self._end_tasks()
            raise

    def _loop_run(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this pipeline is closed: build a new one to run more steps")
        return self.run(coro)

    async def _step_async(self, args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches, targets,
                          forward_only):
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
        last = self.spec.n_stages - 1
        has_first = any(0 in rt.stages for rt in self.runtimes)
        has_last = any(last in rt.stages for rt in self.runtimes)
        forward_only = forward_only or self.loss_fn is None
        if has_last and not forward_only and targets is None and target is None:
            raise ValueError("the last stage needs a target: pass target= or targets=")
        presplit = microbatches is not None or targets is not None
        mbs, kwarg_mbs, targets = prepare_inputs(self, args, kwargs, microbatches, target, targets, has_first,
                                                 has_last)
        self._io.loss_kwargs = dict(loss_kwargs or {})
        keep = has_last and return_outputs
        outputs: dict | None = {} if keep else None
        mb_losses: list | None = [] if has_last else None
        auto = self.auto if self.auto is not None and self.drive_auto and not forward_only else None
        if auto is not None:
            auto.before_step(self._auto_steps)
        if not forward_only:
            self._before_backward()
        stats = await self._run_ranks(mbs, kwarg_mbs, targets, mb_losses, outputs, forward_only)
        self._end_step(stats, mb_losses, losses, forward_only)
        if auto is not None:
            self._auto_steps += 1
            await auto.after_step(self._auto_steps - 1, stats)
        if keep:
            chunks = [outputs[m] for m in range(self.n_microbatches)]
            return chunks if presplit else merge_outputs(chunks, self.output_merge_spec)
        return None if self.last_loss is None else torch.tensor(self.last_loss)

    async def _run_ranks(self, mbs, kwarg_mbs, targets, mb_losses, outputs, forward_only) -> list[StepStats]:
        # Every rank this process runs, concurrently; the first failure cancels the others.
        last = self.spec.n_stages - 1
        tasks = [asyncio.ensure_future(rt.run_step(
            self._step, mbs if 0 in rt.stages else None, targets if last in rt.stages else None,
            mb_losses if last in rt.stages else None, kwargs=kwarg_mbs,
            outputs=outputs if last in rt.stages else None, forward_only=forward_only,
            sum_losses=not self.scale_grads)) for rt in self.runtimes]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _end_step(self, stats: list[StepStats], mb_losses: list | None, losses: list | None,
                  forward_only: bool) -> None:
        """Book a finished step: its stats, its loss, and ``losses`` filled with one entry per
        microbatch (where this process holds the last stage)."""
        self._step += 1
        self._book_stats(stats)
        last = self.spec.n_stages - 1
        loss = next((s.loss for s, rt in zip(stats, self.runtimes) if last in rt.stages), None)
        self.last_loss = None if loss is None else float(loss)
        if losses is not None and mb_losses is not None:
            losses.clear()
            losses.extend(mb_losses)
        if not forward_only:
            self._after_backward()
            self._check_budget(stats)

    def _check_budget(self, stats: list[StepStats]) -> None:
        # Never a silent overrun (the rule: over_budget), said once per pipeline.
        if self._over_said or self.on_overrun is None or self.plan.budget is None:
            return
        over = [(rt.rank, s.peak_bytes, s.peak_mb_inflight) for s, rt in zip(stats, self.runtimes)
                if over_budget(s.peak_bytes, s.peak_one, rt.memory_budget)]
        if over:
            self._over_said = True
            self.on_overrun(overrun_line(self.hint_name, self.plan.budget, self._step, over))

    def _book_stats(self, stats: list[StepStats]) -> None:
        self.last_stats = stats

    def _before_backward(self) -> None:
        """Work a process model adds before a training step's first backward (gradients that
        earlier steps left, kept in one copy: :mod:`rrfp.parallel.grads`)."""

    def _after_backward(self) -> None:
        """Work a process model adds once a training step's gradients are final."""

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Say goodbye to the peers (waits until every rank is done), free the sockets and
        give the stage modules back unpatched. Idempotent."""
        if self._loop.is_closed():
            return
        if self.auto is not None and self.drive_auto and self.auto.say and (line := self.auto.unchosen()):
            self.auto.say(line)
        try:
            self._loop.run_until_complete(self._aclose())
        finally:
            self._end_tasks()  # a close that failed part-way leaves the transports' tasks
            self._loop.close()
            self._unpatch()
            self._close_parts()

    async def _aclose(self) -> None:
        for rt in self.runtimes:
            await rt.close()
        await asyncio.gather(*(t.close() for t in self._transports))

    def _abort_transports(self) -> None:
        for t in self._transports:
            t.abort()

    def _close_parts(self) -> None:
        """Helpers a process model adds (threads of the DP reduction...), closed last."""

    def abort(self) -> None:
        """Close at once without waiting for peers (error path): a step cut short (an
        exception or Ctrl-C inside :meth:`step`) has its tasks cancelled and ended, waiting
        at most ``ABORT_DRAIN_S`` seconds for them."""
        self._abort_transports()
        self._end_tasks()
        for rt in self.runtimes:
            rt.stop()  # the inbox's timer fd, the executor's threads: before the loop closes
        if not self._loop.is_closed():
            self._loop.close()
        self._unpatch()
        self._close_parts()

    def _end_tasks(self) -> None:
        # A closed loop can never run its pending tasks again: they would be destroyed
        # pending (asyncio's "Task was destroyed but it is pending!", a coroutine ignoring
        # GeneratorExit) once collected. Cancel them and let them end, as asyncio.run does;
        # bounded, so a task that swallows its cancellation cannot hold the error path.
        loop = self._loop
        if loop.is_closed() or loop.is_running():
            return
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            return
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.wait(pending, timeout=ABORT_DRAIN_S))
        for t in pending:
            if t.done() and not t.cancelled():
                t.exception()  # the error being reported is the caller's; not logged twice

    def _unpatch(self) -> None:
        # The split backward patched the user's layers; a closed pipeline leaves them as given.
        for m in self._modules:
            disable_split_backward(m)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
