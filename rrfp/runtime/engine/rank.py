"""One rank's asyncio program: inbox -> ready set -> arbiter -> executor -> outbox.

:class:`RankRuntime` wires the parts together and runs the steps:

- :mod:`~rrfp.runtime.engine.router`: the stage graph (which stage consumes a task's outputs, which
  rank holds it, who may send an input) and the receive buffers;
- :mod:`~rrfp.runtime.engine.inbox`: the transport's delivery callback admits arrivals by key into
  the router's buffers and marks readiness (step admission, early-message cap, refusals);
- :mod:`~rrfp.runtime.engine.loop`: one scheduler coroutine asks the
  :class:`~rrfp.scheduler.arbiter.Arbiter` for the next task, hands it to the executor, waits for
  readiness events; the watchdog;
- :mod:`~rrfp.runtime.engine.executor`: where tasks run (inline on the loop thread by default: ZeroMQ
  keeps receiving in its own I/O thread while Python computes, and an inline dispatch costs
  microseconds where a hop to a worker thread and back costs about 90 us on a 2-core machine);
- :mod:`~rrfp.runtime.engine.outbox`: sends, which never block compute;
- :mod:`~rrfp.runtime.engine.pace`: a forward-only step ends once the ranks it sends
  activations to have begun it (else a peer can run more than one step ahead);
- :mod:`~rrfp.runtime.engine.hooks`: step hooks (a stage's gradients are final; the step ends);
- step features join through :mod:`~rrfp.runtime.engine.observer` (the loop's events),
  :meth:`~rrfp.runtime.engine.inbox.Inbox.on_control` (their control messages), a decider
  (:meth:`~rrfp.runtime.engine.loop.SchedulerLoop.set_decider`) and :attr:`RankRuntime.backfill_for`;
  :mod:`rrfp.runtime.features` holds them;
- :mod:`~rrfp.runtime.engine.compute`: the tasks themselves (F, B, I, W on the stage modules) and
  ``run_backward``.

This module keeps :meth:`RankRuntime.run_step` and :class:`StepStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from ...scheduler.arbiter import Arbiter
from ...scheduler.hints import Hint
from ...scheduler.backfill import Backfill
from ...scheduler.readyset import finalising_kind
from ...scheduler.tasks import PipelineSpec, TaskRecord
from ...transport.base import Message, Transport
from ...transport.keys import Direction
from .compute import LossFn, TaskCompute, run_backward
from .executor import Executor, InlineExecutor
from ...scheduler.forward import ForwardArbiter
from .hooks import HookRunner, StepHooks
from .inbox import Inbox
from .loop import DelayFn, SchedulerLoop
from .memory import numel
from .ordered import _OrderedGrads
from .outbox import Outbox
from .pace import ForwardPace
from .router import Router
from .split import disable_split_backward, enable_split_backward
from .stage import PipelineStage, as_tuple

# run_backward, LossFn, DelayFn and TaskRecord are imported from here by the front doors, the
# train loop and the benchmarks.
__all__ = ["RankRuntime", "StepStats", "run_backward", "LossFn", "DelayFn", "TaskRecord"]

@dataclass
class StepStats:
    """What one rank measured in one step.

    Attributes:
        step: the step index.
        wall: seconds from the step's start to this rank's last task's end.
        busy: seconds spent computing tasks (injected delays included).
        peak_inflight: the most activations held at once (forwards done, their backward not).
        peak_mb_inflight: the most microbatches in flight at once on this rank (its first
            virtual stage's forward done, that stage's backward not); equal to
            ``peak_inflight`` with one stage per rank.
        loss: weighted step loss (only on the rank holding the last stage, else None).
        n_tasks: tasks run.
        peak_bytes: the most activation bytes held at once, as measured for the memory
            budget (0 without one; :mod:`rrfp.runtime.engine.memory`).
        n_backfilled: tasks a backfilling hint ran ahead of its strict order
            (:mod:`rrfp.scheduler.backfill`; 0 under any other hint).
        peak_one: the most of those bytes one microbatch held at once (a budget's rule lets
            the oldest microbatch hold it, however large: :func:`rrfp.scheduler.memory.over_budget`).
        input_elems: elements of the step's input tensors, positional and keyword, on the
            rank holding stage 0 (0 elsewhere): how large the step's batch was, a figure no
            hint changes (``auto``'s measure of a batch's work, :func:`rrfp.sim.trial.scaled`).
    """

    step: int
    wall: float
    busy: float
    peak_inflight: int
    loss: float | None = None
    n_tasks: int = 0
    peak_mb_inflight: int = 0
    records: list[TaskRecord] = field(default_factory=list)
    peak_bytes: int = 0
    n_backfilled: int = 0
    input_elems: int = 0
    peak_one: int = 0

    @property
    def bubble(self) -> float:
        """Idle share of this rank's step (0..1)."""
        return max(0.0, 1.0 - self.busy / self.wall) if self.wall > 0 else 0.0


class RankRuntime:
    """Runs the steps of one pipeline rank.

    Args:
        rank: this rank's pipeline index.
        stages: the :class:`PipelineStage` objects this rank holds (its virtual stages), in the
            placement's order.
        spec: the pipeline's shape (placement, microbatches, split backward).
        hint, strict, inflight_limit: arbitration (see :class:`~rrfp.scheduler.arbiter.Arbiter`).
        transport: moves messages to other ranks (started by the caller).
        job: job id carried in every message key.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage (per microbatch).
        loss_weight_fn: ``loss_weight_fn(target) -> float``: microbatch ``m``'s loss is weighted
            ``w_m / sum(w)``; None weights every microbatch ``1 / M`` (PyTorch's semantics).
        watchdog: seconds without progress before :class:`WatchdogTimeout` (0 disables).
        task_delay: optional injected extra seconds per task (jitter experiments), awaited after
            the task's compute while the rank counts as busy.
        record: keep a :class:`TaskRecord` per task (for traces).
        deterministic: accumulate weight gradients in microbatch order whatever order the
            backwards ran in, so runs are bitwise reproducible (see :class:`_OrderedGrads`).
        executor: where tasks run (:mod:`rrfp.runtime.engine.executor`); default
            :class:`~rrfp.runtime.engine.executor.InlineExecutor`.
        memory_budget: activation bytes this rank may hold (None: none): the arbiter admits
            by each forward's measured size (:mod:`rrfp.runtime.engine.memory`).

    Attributes:
        router, inbox, loop (the SchedulerLoop, not an asyncio loop), outbox, executor, compute
            (the :class:`~rrfp.runtime.engine.compute.TaskCompute`), pace (the
            :class:`~rrfp.runtime.engine.pace.ForwardPace` of forward-only steps): the parts
            (see the module docstring). The knobs live on their parts: ``loop.watchdog``,
            ``loop.task_delay``, ``loop.record``, ``compute.loss_fn``; refusals are counted in
            ``inbox.rejected``.
        features: the step features attached to this rank, by name (``notices``: backfilling's
            :class:`~rrfp.runtime.features.notices.StartedNotices`; ``tp-agreement``), for
            inspection; each registers itself through the seams (module docstring).
        backfill_for: ``(step, spec) -> Backfill``, where a backfilling step's arbiter takes its
            :class:`~rrfp.scheduler.backfill.Backfill` (backfilling's notices set it; None: a
            backfilling hint fails the step with a ValueError).
        sizer: the memory budget's :class:`~rrfp.runtime.engine.memory.ForwardSizer` (the
            activation bytes it measured per stage and microbatch, ``sizer(stage, mb)``), or
            None without a budget.
    """

    def __init__(
        self,
        rank: int,
        stages: Sequence[PipelineStage],
        spec: PipelineSpec,
        hint: Hint,
        transport: Transport,
        *,
        strict: bool = False,
        inflight_limit: int = 32,
        job: str = "rrfp",
        loss_fn: LossFn | None = None,
        loss_weight_fn: Callable[[Any], float] | None = None,
        watchdog: float = 300.0,
        task_delay: DelayFn | None = None,
        record: bool = False,
        deterministic: bool = False,
        executor: Executor | None = None,
        memory_budget: int | None = None,
    ) -> None:
        self.rank = rank
        self.deterministic = deterministic
        self.spec = spec
        self.hint = hint
        self.strict = strict
        self.inflight_limit = inflight_limit
        self.transport = transport
        self.job = job
        self.loss_weight_fn = loss_weight_fn
        want = spec.placement.stages_of(rank)
        got = [s.stage_index for s in stages]
        if got != want:
            raise ValueError(f"rank {rank} holds stages {want} under this placement, but got stages {got}")
        self.stages = {s.stage_index: s for s in stages}
        if spec.split_backward:
            for st in stages:
                if st.dw_builder is None:  # with one, the user's module defers its own weight gradients
                    enable_split_backward(st.submod)
        self.last_stage = spec.n_stages - 1
        self.executor = executor if executor is not None else InlineExecutor()
        self.router = Router(spec.placement, rank)
        self.inbox = Inbox(self.router, job, self.stages, spec.n_microbatches)
        copies = self.executor.copies
        self.outbox = Outbox(transport, job, copies and copies.to_host, copies and copies.ready_event)
        if copies is not None:  # the executor copies on its own stream
            self.inbox.place = lambda stage, tensors: copies.to_device(stage.device, tensors)
        self.loop = SchedulerLoop(rank, self.inbox, self.executor, watchdog=watchdog, task_delay=task_delay,
                                  record=record)
        self.features: dict[str, Any] = {}
        self.backfill_for: Callable[[int, PipelineSpec], Backfill] | None = None
        self._loss_total = self._loss_global = None
        self.hooks = HookRunner(self.stages, spec.n_microbatches, finalising_kind(spec.split_backward))
        self._receiving = False
        inbox, outbox = self.inbox, self.outbox
        # Forward-only steps in a row stay within one step of their receivers (engine/pace.py).
        self.pace = ForwardPace(self.router, inbox, self.outbox.send_control)
        self.router.connect(inbox.deliver_local, lambda dst_rank, dst_stage, m, direction, tensors: outbox.send(
            dst_rank, inbox.step, m, dst_stage, direction, tensors))
        self._ordered = {s: _OrderedGrads(st.submod) for s, st in self.stages.items()} if deterministic else None
        self.memory_budget = memory_budget
        self.sizer = self._wbytes = None
        self.compute = TaskCompute(rank, self.stages, self.last_stage, loss_fn, self.router, self._ordered)
        if memory_budget is not None:
            self.measure_activations()

    def measure_activations(self) -> None:
        """Measure what each forward saves for its backward from the next step on (a memory
        budget does it by itself), so that :attr:`StepStats.peak_bytes` reports the most
        activation bytes held at once. Without a budget nothing is gated by it; a
        backfilling hint then keeps its forwards run ahead within the order's peak *bytes*
        instead of its count of activations (:class:`~rrfp.scheduler.policy.BackfillOrder`).
        Idempotent."""
        if self.sizer is not None:
            return
        from .memory import ForwardSizer, WeightBytes

        self.sizer = self.compute.sizer = ForwardSizer({i: st.submod for i, st in self.stages.items()},
                                                       self.spec.placement.stages_of(self.rank)[0])
        # The ledger frees at I all but what W's store holds (measured).
        self._wbytes = WeightBytes(self.compute._wstate)

    def set_loss_reduction(self, total_fn: Callable[[float], float], loss_fn: Callable[[float], float]) -> None:
        """Data parallelism (:mod:`rrfp.parallel.grads`): ``total_fn(local total)`` gives the
        loss-weight total over every replica (the global token count), so microbatch weights
        are shares of the global batch; ``loss_fn(local loss)`` gives the global step loss
        from this replica's part (both on the rank holding the last stage)."""
        self._loss_total, self._loss_global = total_fn, loss_fn

    @property
    def loss_reduction(self) -> tuple[Callable[[float], float] | None, Callable[[float], float] | None]:
        """``(total_fn, loss_fn)`` as :meth:`set_loss_reduction` set them (None, None: one
        replica), so a caller can wrap them and put them back."""
        return self._loss_total, self._loss_global

    def set_hint(self, spec: PipelineSpec, hint: Hint, strict: bool) -> None:
        """Run ``hint`` (resolved with ``spec`` and ``strict``, as
        :func:`~rrfp.scheduler.hints.resolve_hint` gives them) from the next step on: a split
        backward is enabled on the stage modules where ``spec`` has one and undone where it has
        none (idempotent both ways; a module with a ``dw_builder`` is left as given), so a full
        backward runs the layers' own forwards, and the step hooks' final kind follows (``B``, or ``W``
        with a split backward). The front doors call it for every rank
        (:meth:`~rrfp.runtime.doors.front.FrontDoor.set_hint`).

        Raises:
            ValueError: ``spec`` of another placement or microbatch count (nothing changed).
        """
        if spec.placement != self.spec.placement or spec.n_microbatches != self.spec.n_microbatches:
            raise ValueError(f"rank {self.rank}: a hint for {spec.placement}, {spec.n_microbatches} microbatches; "
                             f"this pipeline is {self.spec.placement}, {self.spec.n_microbatches} microbatches")
        for st in self.stages.values():
            if st.dw_builder is None:  # with one, the user's module defers its own weight gradients
                # Routed layers run a Python autograd Function, 5-8% slower forwards than the
                # layers' own (split.py): a hint with a full backward gets them back (auto's split trials).
                (enable_split_backward if spec.split_backward else disable_split_backward)(st.submod)
        self.spec, self.hint, self.strict = spec, hint, strict
        self.hooks.final_kind = finalising_kind(spec.split_backward)

    def add_step_hooks(self, hooks: StepHooks) -> None:
        """Register step hooks (:mod:`rrfp.runtime.engine.hooks`): ``on_stage_grads_final(stage)``
        once a stage's gradients are final in a step, ``on_step_end()`` at its end; awaitables
        they return are done before the step returns."""
        self.hooks.add(hooks)

    # ------------------------------------------------------------ receiving
    def start(self) -> None:
        """Start receiving on the running loop (idempotent).

        Arrivals are handled inside the transport's delivery callback (``set_handler``):
        a receiver coroutine awaiting ``recv()`` costs a future and a task switch per
        message, a third of a small task's runtime overhead (``benchmarks/micro.py``)."""
        if self._receiving:
            return
        self._receiving = True
        self.transport.set_handler(self.inbox.handle, self.inbox.transport_failed)

    async def control(self, timeout: float | None = None) -> Message:
        """Next control (``Direction.CTL``) message addressed to this rank."""
        return await self.inbox.control(timeout)

    def poll_control(self) -> list[Message]:
        """Control messages received so far, without waiting."""
        return self.inbox.poll_control()

    def send_control(self, dst: int, step: int, meta: dict) -> None:
        """Send a small control message (statistics, losses) to rank ``dst``."""
        self.outbox.send_control(dst, step, meta)

    # ------------------------------------------------------------- one step
    async def run_step(
        self,
        step: int,
        inputs: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
        losses: list | None = None,
        *,
        kwargs: Sequence[dict] | None = None,
        outputs: dict[int, Any] | None = None,
        forward_only: bool = False,
        sum_losses: bool = False,
    ) -> StepStats:
        """Run every task of this rank for step ``step``.

        Args:
            inputs: on the rank holding stage 0, one tuple of input tensors per microbatch.
            targets: on the rank holding the last stage, one target per microbatch (optional
                in a forward-only step: without them no loss is computed).
            losses: if given (last stage), per-microbatch unweighted losses are appended.
            kwargs: one dict per microbatch of keyword inputs for this rank's stage forwards.
            outputs: the last stage's rank: filled with ``microbatch -> output`` (detached).
            forward_only: forwards only, under ``torch.no_grad()`` (no graph, no gradients).
            sum_losses: weight every microbatch loss 1 (PyTorch's ``scale_grads=False``)
                instead of ``loss_weight_fn``'s normalised weights.

        Returns:
            This rank's :class:`StepStats` (with the weighted loss on the last stage's rank).

        Raises:
            WatchdogTimeout, PeerLost, PipelineError, ValueError (inputs of the wrong length),
            and whatever a step hook raised.
        """
        M = self.spec.n_microbatches
        self._check_step_inputs(inputs, targets, kwargs, forward_only)
        if self.compute.loss_fn is None:
            targets = None
        self.start()
        inbox = self.inbox
        if inbox.error is not None:
            raise inbox.error
        arb = self._arbiter(forward_only, step)
        compute = self.compute
        compute.begin_step(kwargs, outputs, forward_only)
        self.executor.begin_step()
        inbox.begin_step(step, arb)  # clears the input buffers, then admits early arrivals
        if forward_only:
            self.pace.begins(step)
        weights, mb_losses = self._feed(inputs, targets, sum_losses)
        hooks = self.hooks if self.hooks.hooks and not forward_only else None
        if hooks is not None:
            hooks.begin_step()
        stats = StepStats(step, 0.0, 0.0, 0, input_elems=_elements(inputs, kwargs) if 0 in self.stages else 0)
        t_start = time.perf_counter()
        try:
            await self.loop.run(arb, step, stats, compute.run, self.router.hand_on, hooks)
        finally:
            compute.end_step()
        self.executor.end_step()
        if self._ordered is not None and not forward_only:
            for acc in self._ordered.values():
                acc.finish(M)
        if hooks is not None:
            await hooks.end_step(self.rank, step, self.loop.watchdog)
        stats.wall = time.perf_counter() - t_start
        stats.peak_inflight = arb.peak_inflight
        stats.peak_mb_inflight = arb.peak_mb_inflight
        stats.peak_bytes = arb.peak_bytes
        stats.peak_one = arb.peak_one
        if weights is not None:
            if losses is not None:
                losses.extend(mb_losses)
            stats.loss = self._step_loss(mb_losses, weights)
        compute.targets = compute.weights = None
        await self.outbox.flush()
        if forward_only:
            await self.pace.ends(step, self.loop.watchdog)
        inbox.end_step(step)
        return stats

    def _feed(self, inputs, targets, sum_losses: bool) -> tuple[list[float] | None, list]:
        """Put the step's inputs in stage 0's buffers and its targets and loss weights in the
        compute; returns ``(weights, the list the microbatch losses fill)``."""
        M = self.spec.n_microbatches
        if 0 in self.stages:
            first, inbox = self.stages[0], self.inbox
            for m, x in enumerate(inputs):
                self.router.put(0, m, Direction.ACT, inbox.place_on(first, as_tuple(x)))
        compute = self.compute
        compute.targets = targets
        weights = None
        if targets is not None:
            weights = [1.0] * M if sum_losses else self._loss_weights(targets)
        compute.weights = weights
        compute.mb_losses = mb_losses = [None] * M
        return weights, mb_losses

    def _check_step_inputs(self, inputs, targets, kwargs, forward_only: bool) -> None:
        M = self.spec.n_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != M):
            raise ValueError(f"stage 0 needs {M} microbatch inputs, got {None if inputs is None else len(inputs)}")
        last = self.last_stage in self.stages
        if last and not forward_only and self.compute.loss_fn is None:
            raise ValueError("a training step needs a loss_fn on the rank holding the last stage (eval() runs forwards only)")
        if last and (targets is None and not forward_only or targets is not None and len(targets) != M):
            raise ValueError(f"the last stage needs {M} microbatch targets, got {None if targets is None else len(targets)}")
        if kwargs is not None and len(kwargs) != M:
            raise ValueError(f"keyword inputs for {len(kwargs)} microbatches, expected {M}")

    def _arbiter(self, forward_only: bool, step: int):
        if forward_only:
            return ForwardArbiter(self.spec, self.rank)
        backfill = None
        if self.hint.backfill and self.strict:
            if self.backfill_for is None:
                raise ValueError(f"rank {self.rank}: hint {self.hint.name!r} backfills, but no backfilling feature "
                                 "is attached (rrfp.runtime.features.notices.attach)")
            backfill = self.backfill_for(step, self.spec)
        arb = Arbiter(self.spec, self.rank, self.hint, strict=self.strict, inflight_limit=self.inflight_limit,
                      memory_budget=self.memory_budget, act_bytes=self.sizer, w_bytes=self._wbytes,
                      backfill=backfill)
        if self.sizer is not None:
            self.sizer.begin_step(self.router.waiting(Direction.ACT))
        return arb

    def _step_loss(self, mb_losses: list, weights: list[float]) -> float:
        # One reduction in float64 instead of M scalar tensor ops (and M device syncs).
        flat = torch.stack([l.reshape(()) for l in mb_losses]).to("cpu", torch.float64)
        loss = float(flat.dot(torch.tensor(weights, dtype=torch.float64)))
        return loss if self._loss_global is None else self._loss_global(loss)

    def _loss_weights(self, targets: Sequence[Any]) -> list[float]:
        M = len(targets)
        if self.loss_weight_fn is None and self._loss_total is None:
            return [1.0 / M] * M
        # With data parallelism and no weights, every microbatch of every replica weighs the same.
        raw = [1.0] * M if self.loss_weight_fn is None else [float(self.loss_weight_fn(t)) for t in targets]
        total = sum(raw)
        if self._loss_total is not None:
            total = self._loss_total(total)
        if total <= 0:
            raise ValueError(f"loss weights {raw} sum to {total}: expected a positive total")
        return [r / total for r in raw]

    async def close(self) -> None:
        """Stop receiving (the caller closes the transport).

        Nothing is received afterwards, so a step still running, and any later one, fails at
        once with a PipelineError instead of waiting for the watchdog."""
        self.stop()

    def stop(self) -> None:
        """:meth:`close` without a running loop (the error path, ``Pipeline.abort``): stop
        receiving and free what the inbox and executor own (the hold's kernel timer, worker
        threads). Call it before the event loop closes, so the timer leaves the loop's watch
        list; after, it still frees the timer. Idempotent."""
        self.inbox.close()
        self.executor.close()


def _elements(inputs: Sequence[tuple] | None, kwargs: Sequence[dict] | None) -> int:
    """Elements of the tensors among the microbatches' inputs, at any depth: a keyword argument
    may hold a list or dict of tensors (one per image, say), as torch's microbatch split allows
    (its pytree leaves)."""
    return sum(_numel_deep(as_tuple(x)) for x in inputs or ()) + sum(_numel_deep(kw.values()) for kw in kwargs or ())


def _numel_deep(items: Any) -> int:
    # Tensors counted directly and only containers through torch's pytree: tree_leaves over
    # every input cost three times as much per step.
    n = 0
    for t in items:
        if isinstance(t, torch.Tensor):
            n += t.numel()
        elif isinstance(t, (list, tuple, dict)):
            n += numel(tree_leaves(t))
    return n
