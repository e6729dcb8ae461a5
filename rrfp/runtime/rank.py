"""One rank's asyncio program: inbox -> ready set -> arbiter -> executor -> outbox.

The transport's delivery callback turns arrivals into buffered stage inputs and readiness
events; one scheduler coroutine asks the :class:`~rrfp.scheduler.arbiter.Arbiter` for the next task and
runs it. Tasks run inline on the loop thread: ZeroMQ keeps receiving in its own I/O thread
while Python computes, and an inline dispatch costs microseconds where a hop to a worker thread
and back costs about 90 us on a 2-core machine (ARCHITECTURE.md, "One rank, one event loop").
Sends are enqueued to the transport's outbox and never block compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..scheduler.arbiter import Arbiter, SchedulingError
from ..scheduler.hints import Hint
from ..scheduler.tasks import B, F, I, PipelineSpec, Task, TaskRecord
from ..transport.base import Message, Transport
from ..transport.keys import Direction, MsgKey
from .split import WeightGradStore, deferring, enable_split_backward
from .stage import PipelineStage, as_tuple, detach_for_next

log = logging.getLogger("rrfp.runtime")

try:  # the C++ engine call that torch.autograd.backward ends in (torch >= 2.4)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older or newer torch without it: the public path
    _engine_run_backward = None


def run_backward(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                 where: tuple[int, int, int] | None = None) -> None:
    """``torch.autograd.backward(outs, grads)`` without its Python argument handling.

    ``torch.autograd.backward`` spends about 45 us per call in Python (``_make_grads``
    re-checks every gradient's shape through symbolic-shape helpers) before the engine runs;
    on small stages that is as much as the backward itself (``benchmarks/micro.py``). Here the
    one check that matters for a pipeline, shapes, is a tuple comparison, and the engine is
    called directly. Tensor subclasses (``__torch_function__``, e.g. DTensor) take the public
    path so that their overrides still apply.

    Args:
        outs: a stage's outputs that require grad (or its scalar loss).
        grads: one gradient per output, the same shape; ``None`` for a scalar loss (ones).
        where: ``(rank, stage, microbatch)``, to name the task in errors.

    Raises:
        PipelineError: a gradient whose shape or dtype differs from its output's.
    """
    outs = tuple(outs)
    plain = _engine_run_backward is not None
    if grads is None:
        grads = tuple(torch.ones_like(o) for o in outs)
    else:
        grads = tuple(grads)
        for o, g in zip(outs, grads):
            if o.shape != g.shape or o.dtype != g.dtype:
                # A correct pipeline sends an output's gradient in that output's shape and
                # dtype; the engine would cast another dtype silently, or fail deep inside.
                r, st, mb = where or ("?", "?", "?")
                what = (f"shape {tuple(g.shape)} for an output of shape {tuple(o.shape)}" if o.shape != g.shape
                        else f"dtype {g.dtype} for an output of dtype {o.dtype}")
                raise PipelineError(f"rank {r} stage {st} microbatch {mb}: gradient of {what}")
            if type(g) is not torch.Tensor:
                plain = False
    for o in outs:
        if type(o) is not torch.Tensor:
            plain = False
    if not plain:
        torch.autograd.backward(outs, grads)
        return
    _engine_run_backward(outs, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)

LossFn = Callable[[Any, Any], torch.Tensor]
DelayFn = Callable[[int, int, Task], float]  # (step, rank, task) -> extra seconds


MAX_CONTROL_BACKLOG = 4096
"""Control messages a rank keeps unread before refusing more."""


class WatchdogTimeout(RuntimeError):
    """A rank made no progress for the watchdog's period; the message says what it waits for."""


class PipelineError(RuntimeError):
    """A message or input that a correct pipeline cannot produce (wrong job, stale step...)."""


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
    """

    step: int
    wall: float
    busy: float
    peak_inflight: int
    loss: float | None = None
    n_tasks: int = 0
    peak_mb_inflight: int = 0
    records: list[TaskRecord] = field(default_factory=list)

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
    ) -> None:
        self.rank = rank
        self.deterministic = deterministic
        self.spec = spec
        self.hint = hint
        self.strict = strict
        self.inflight_limit = inflight_limit
        self.transport = transport
        self.job = job
        self.loss_fn = loss_fn
        self.loss_weight_fn = loss_weight_fn
        self.watchdog = watchdog
        self.task_delay = task_delay
        self.record = record
        want = spec.placement.stages_of(rank)
        got = [s.stage_index for s in stages]
        if got != want:
            raise ValueError(f"rank {rank} holds stages {want} under this placement, but got stages {got}")
        self.stages = {s.stage_index: s for s in stages}
        if spec.split_backward:
            for st in stages:
                enable_split_backward(st.submod)
        self.last_stage = spec.n_stages - 1
        if self.last_stage in self.stages and loss_fn is None:
            raise ValueError("the rank holding the last stage needs a loss_fn")
        self._pending: dict[int, list[Message]] = {}  # early arrivals, by step
        self._control: asyncio.Queue[Message] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._receiving = False
        self._closed = False
        self._step: int | None = None
        self._last_step = -1
        self.rejected = 0  # messages refused for their routing (wrong job, step, stage...)
        self._arb: Arbiter | None = None
        self._act: dict[tuple[int, int], tuple] = {}
        self._grad: dict[tuple[int, int], list] = {}
        self._out: dict[tuple[int, int], tuple] = {}
        self._wstate: dict[tuple[int, int], Any] = {}
        self._seed: dict[int, float] = {}  # last stage: microbatch -> loss weight
        self._held: list | None = None  # outputs of a task whose injected delay is running
        self._watch: asyncio.TimerHandle | None = None  # the watchdog's timer, armed while waiting
        self._waiting = False  # the scheduler waits for an event
        self._timed_out: WatchdogTimeout | None = None
        self._rank_of = [spec.placement.rank_of(st) for st in range(spec.n_stages)]
        self._ordered = {s: _OrderedGrads(st.submod) for s, st in self.stages.items()} if deterministic else None
        self._progress = time.perf_counter()  # the watchdog's clock: last task's end

    # ------------------------------------------------------------ receiving
    def start(self) -> None:
        """Start receiving on the running loop (idempotent).

        Arrivals are handled inside the transport's delivery callback (``set_handler``):
        a receiver coroutine awaiting ``recv()`` costs a future and a task switch per
        message, a third of a small task's runtime overhead (``benchmarks/micro.py``)."""
        if self._receiving:
            return
        self._receiving = True
        self.transport.set_handler(self._handle, self._transport_failed)

    def _handle(self, msg: Message) -> None:
        if self._closed:
            return
        try:
            self._on_message(msg)
        except Exception as e:  # noqa: BLE001 - handed to the scheduler coroutine
            self._fail(e)

    def _transport_failed(self, e: BaseException) -> None:
        if not self._closed:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self._error is None:
            self._error = e
        self._wake.set()

    def _on_message(self, msg: Message) -> None:
        key = msg.key
        if key.job != self.job:
            return self._reject(msg, f"job {key.job!r}, expected {self.job!r}")
        if key.direction == Direction.CTL:
            # Control messages are small statistics: no tensors, and a bounded backlog, so a
            # forged flood cannot grow a rank's memory.
            if msg.tensors or self._control.qsize() >= MAX_CONTROL_BACKLOG:
                return self._reject(msg, "control message with tensors, or control backlog full")
            self._control.put_nowait(msg)
            return
        # A peer can be at most one step ahead: it needs this rank's step-k outputs to finish
        # step k. Anything else is a stale, forged or corrupt message.
        current = self._step if self._step is not None else self._last_step + 1
        if key.step == current + 1 or (self._step is None and key.step == current):
            early = self._pending.setdefault(key.step, [])
            # A step brings at most one activation and one gradient per stage and microbatch
            # here; more is a flood, and must not grow memory.
            if len(early) >= 2 * len(self.stages) * self.spec.n_microbatches:
                return self._reject(msg, f"more early messages for step {key.step} than a step has inputs")
            early.append(msg)
            return
        if key.step != current:
            return self._reject(msg, f"step {key.step} while in step {current}")
        self._accept(msg)

    def _reject(self, msg: Message, why: str) -> None:
        self.rejected += 1
        if self.rejected <= 10 or self.rejected % 1000 == 0:  # bounded: a hostile peer must not flood the log
            log.warning("rank %d: rejected message #%d from rank %d (%s): %s",
                        self.rank, self.rejected, msg.src, msg.key, why)

    def _accept(self, msg: Message) -> None:
        key = msg.key
        stage = self.stages.get(key.stage)
        grad = key.direction == Direction.GRAD
        if stage is None or not 0 <= key.microbatch < self.spec.n_microbatches:
            return self._reject(msg, f"no task here for stage {key.stage} microbatch {key.microbatch}")
        try:
            self._arb.mark_input(key.stage, key.microbatch, grad)
        except SchedulingError as e:  # a duplicate: the first copy stands
            return self._reject(msg, str(e))
        tensors = stage.to_device(msg.tensors)
        if grad:
            self._grad[(key.stage, key.microbatch)] = list(tensors)
        else:
            self._act[(key.stage, key.microbatch)] = tensors
        self._wake.set()

    async def control(self, timeout: float | None = None) -> Message:
        """Next control (``Direction.CTL``) message addressed to this rank."""
        if self._error is not None:
            raise self._error
        get = asyncio.ensure_future(self._control.get())
        err = asyncio.ensure_future(self._wake_on_error())
        done, _ = await asyncio.wait({get, err}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        err.cancel()
        if get in done:
            return get.result()
        get.cancel()
        if self._error is not None:
            raise self._error
        raise TimeoutError(f"rank {self.rank}: no control message within {timeout} s")

    def poll_control(self) -> list[Message]:
        """Control messages received so far, without waiting."""
        out = []
        while not self._control.empty():
            out.append(self._control.get_nowait())
        return out

    async def _wake_on_error(self) -> None:
        while self._error is None:
            self._wake.clear()
            await self._wake.wait()

    def send_control(self, dst: int, step: int, meta: dict) -> None:
        """Send a small control message (statistics, losses) to rank ``dst``."""
        self.transport.send(dst, MsgKey(self.job, step, 0, 0, Direction.CTL), [], meta)

    # ------------------------------------------------------------- one step
    async def run_step(
        self,
        step: int,
        inputs: Sequence[tuple] | None = None,
        targets: Sequence[Any] | None = None,
        losses: list | None = None,
    ) -> StepStats:
        """Run every task of this rank for step ``step``.

        Args:
            inputs: on the rank holding stage 0, one tuple of input tensors per microbatch.
            targets: on the rank holding the last stage, one target per microbatch.
            losses: if given (last stage), per-microbatch unweighted losses are appended.

        Returns:
            This rank's :class:`StepStats` (with the weighted loss on the last stage's rank).

        Raises:
            WatchdogTimeout, PeerLost, PipelineError, ValueError (inputs of the wrong length).
        """
        M = self.spec.n_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != M):
            raise ValueError(f"stage 0 needs {M} microbatch inputs, got {None if inputs is None else len(inputs)}")
        if self.last_stage in self.stages and (targets is None or len(targets) != M):
            raise ValueError(f"the last stage needs {M} microbatch targets, got {None if targets is None else len(targets)}")
        self.start()
        if self._error is not None:
            raise self._error
        arb = Arbiter(self.spec, self.rank, self.hint, strict=self.strict, inflight_limit=self.inflight_limit)
        self._arb, self._step = arb, step
        self._act.clear(), self._grad.clear(), self._out.clear(), self._wstate.clear(), self._seed.clear()
        if 0 in self.stages:
            first = self.stages[0]
            for m, x in enumerate(inputs):
                self._act[(0, m)] = first.to_device(as_tuple(x))
        weights = self._loss_weights(targets) if targets is not None else None
        mb_losses: list[torch.Tensor | None] = [None] * M
        for msg in self._pending.pop(step, []):
            self._accept(msg)
        stats = StepStats(step, 0.0, 0.0, 0)
        t_start = time.perf_counter()
        self._progress = time.perf_counter()
        self._timed_out = None
        try:
            await self._run_tasks(arb, step, stats, targets, weights, mb_losses)
        finally:
            self._disarm_watchdog()
        if self._ordered is not None:
            for acc in self._ordered.values():
                acc.finish(M)
        stats.wall = time.perf_counter() - t_start
        stats.peak_inflight = arb.peak_inflight
        stats.peak_mb_inflight = arb.peak_mb_inflight
        if weights is not None:
            if losses is not None:
                losses.extend(mb_losses)
            # One reduction in float64 instead of M scalar tensor ops (and M device syncs).
            flat = torch.stack([l.reshape(()) for l in mb_losses]).to("cpu", torch.float64)
            stats.loss = float(flat.dot(torch.tensor(weights, dtype=torch.float64)))
        await self.transport.flush()
        self._step, self._last_step = None, step
        return stats

    async def _run_tasks(self, arb: Arbiter, step: int, stats: StepStats, targets, weights, mb_losses) -> None:
        """The scheduler coroutine's loop: ask the arbiter, run the task inline, repeat."""
        while not arb.finished:
            if self._error is not None:
                raise self._error
            self._wake.clear()
            task = arb.next()
            if task is None:
                await self._wait_for_event()
                continue
            t0 = time.perf_counter()
            if self.task_delay is None:
                self._run_task(task, targets, weights, mb_losses)
            else:
                # Injected delays stand for device time: the rank stays busy but its loop keeps
                # receiving, as with a GPU kernel awaited through an event, and the task's
                # outputs leave only when it is done.
                self._held = []
                self._run_task(task, targets, weights, mb_losses)
                held, self._held = self._held, None
                extra = self.task_delay(step, self.rank, task)
                if extra > 0:
                    await asyncio.sleep(extra)
                for args in held:
                    self._emit(*args)
            t1 = time.perf_counter()
            arb.complete(task)
            stats.busy += t1 - t0
            stats.n_tasks += 1
            if self.record:
                stats.records.append(TaskRecord(self.rank, step, task, t0, t1))
            self._progress = t1
            # Let the transport deliver arrivals so the next decision sees them.
            await asyncio.sleep(0)

    async def _wait_for_event(self) -> None:
        if self.watchdog <= 0:
            await self._wake.wait()
            return
        # One timer per watchdog period, not asyncio.wait_for per wait: wait_for wraps each
        # wait in a task and a timeout handle, most of what a short wait costs.
        if self._watch is None:
            self._arm_watchdog(self._progress + self.watchdog - time.perf_counter())
        self._waiting = True
        try:
            await self._wake.wait()
        finally:
            self._waiting = False
        if self._timed_out is not None:
            exc, self._timed_out = self._timed_out, None
            raise exc

    def _arm_watchdog(self, delay: float) -> None:
        self._watch = asyncio.get_running_loop().call_later(max(delay, 0.0), self._watchdog_fired)

    def _disarm_watchdog(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _watchdog_fired(self) -> None:
        self._watch = None
        left = self._progress + self.watchdog - time.perf_counter()
        if left > 0:  # progress since arming
            self._arm_watchdog(left)
            return
        if not self._waiting:  # busy in a task's injected delay: not stalled
            self._arm_watchdog(self.watchdog)
            return
        if self._wake.is_set():
            # An input came in the same loop turn as the deadline: let the scheduler look at
            # it first, and judge again right after.
            self._arm_watchdog(0.0)
            return
        self._timed_out = WatchdogTimeout(
            f"rank {self.rank} (stages {list(self.stages)}) made no progress for {self.watchdog:g} s "
            f"in step {self._step}: waiting for {self._arb.waiting_for()}"
        )
        self._wake.set()

    def _loss_weights(self, targets: Sequence[Any]) -> list[float]:
        M = len(targets)
        if self.loss_weight_fn is None:
            return [1.0 / M] * M
        raw = [float(self.loss_weight_fn(t)) for t in targets]
        total = sum(raw)
        if total <= 0:
            raise ValueError(f"loss weights {raw} sum to {total}: expected a positive total")
        return [r / total for r in raw]

    # ------------------------------------------------------------ executing
    def _run_task(self, task: Task, targets, weights, mb_losses) -> None:
        s, kind, m = task
        if kind == F:
            self._forward(s, m, targets, weights, mb_losses)
        elif kind == B:
            self._backward(s, m, split=False)
        elif kind == I:
            self._backward(s, m, split=True)
        else:
            self._weight(s, m)

    def _forward(self, s: int, m: int, targets, weights, mb_losses) -> None:
        stage = self.stages[s]
        inputs = self._act[(s, m)]
        if torch.is_grad_enabled():  # entering enable_grad() costs more than the check
            out = self._forward_graph(stage, s, m, inputs, targets, weights, mb_losses)
        else:
            with torch.enable_grad():
                out = self._forward_graph(stage, s, m, inputs, targets, weights, mb_losses)
        if out is None:
            return
        outs = out if type(out) is tuple else as_tuple(out)
        self._out[(s, m)] = outs
        self._emit(s + 1, m, Direction.ACT, [detach_for_next(o) for o in outs])

    def _forward_graph(self, stage, s: int, m: int, inputs, targets, weights, mb_losses):
        out = stage.submod(*inputs)
        if s != self.last_stage:
            return out
        loss = self.loss_fn(out, targets[m])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        mb_losses[m] = loss.detach()
        # The microbatch's weight enters as the backward's seed gradient, d(w L) = w dL: the
        # same values as backpropagating through ``loss * w``, without that extra node.
        self._out[(s, m)] = (loss,)
        self._seed[m] = weights[m]
        return None

    def _grad_pairs(self, s: int, m: int) -> tuple[list, list | None]:
        outs = self._out.pop((s, m))
        if s == self.last_stage:
            return list(outs), [torch.full_like(outs[0], self._seed.pop(m))]
        grads = self._grad.pop((s, m))
        if len(grads) != len(outs):
            raise PipelineError(
                f"rank {self.rank}: stage {s} microbatch {m} got {len(grads)} gradients for {len(outs)} outputs"
            )
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, s: int, m: int, split: bool) -> None:
        inputs = self._act.pop((s, m))
        outs, grads = self._grad_pairs(s, m)
        if split and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            # I: input gradients now; the linear layers' weight gradients wait in a store for W.
            store = WeightGradStore()
            with deferring(store), self._capture(s, m, final=False):
                if outs:
                    run_backward(outs, grads, (self.rank, s, m))
            self._wstate[(s, m)] = ("store", store)
        elif split:
            # No input needs a gradient (stage 0): nothing is on the critical path, so the
            # whole backward moves to W, as PyTorch's zero-bubble schedules do.
            self._wstate[(s, m)] = ("full", outs, grads)
        elif self._ordered is None:
            if outs:
                run_backward(outs, grads, (self.rank, s, m))
        else:
            with self._capture(s, m):
                if outs:
                    run_backward(outs, grads, (self.rank, s, m))
        if s > 0:
            in_grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]
            self._emit(s - 1, m, Direction.GRAD, in_grads)

    def _weight(self, s: int, m: int) -> None:
        state = self._wstate.pop((s, m))
        with self._capture(s, m):
            if state[0] == "store":
                state[1].flush()
            elif state[1]:
                run_backward(state[1], state[2], (self.rank, s, m))

    def _capture(self, s: int, m: int, final: bool = True):
        if self._ordered is None:
            return contextlib.nullcontext()
        return self._ordered[s].capture(m, final)

    def _emit(self, dst_stage: int, m: int, direction: Direction, tensors: list) -> None:
        if self._held is not None:
            self._held.append((dst_stage, m, direction, tensors))
            return
        dst_rank = self._rank_of[dst_stage]
        if dst_rank == self.rank:
            # Same rank (virtual stages): hand over directly, no serialization.
            if direction == Direction.ACT:
                self._act[(dst_stage, m)] = tuple(tensors)
            else:
                self._grad[(dst_stage, m)] = [None if t is None else t.detach() for t in tensors]
            self._arb.mark_input(dst_stage, m, direction == Direction.GRAD)
            return
        payload = [None if t is None else (t.detach().cpu() if t.device.type != "cpu" else t) for t in tensors]
        self.transport.send(dst_rank, MsgKey(self.job, self._step, m, dst_stage, direction), payload)

    async def close(self) -> None:
        """Stop receiving (the caller closes the transport).

        Nothing is received afterwards, so a step still running, and any later one, fails at
        once with a PipelineError instead of waiting for the watchdog."""
        self._closed = True
        self._fail(PipelineError(f"rank {self.rank}: closed"))



class _OrderedGrads:
    """Deterministic weight-gradient accumulation for one stage (``--deterministic``).

    Each microbatch's weight gradients are computed into fresh ``.grad`` tensors and added to
    the accumulated gradient in microbatch order ``0..M-1``; a contribution that finishes early
    is held until every lower microbatch has been added. Floating-point addition is not
    associative, so this fixes the summation order and makes the result independent of
    execution order. Cost: one extra gradient buffer per microbatch finished ahead of its turn
    (at most ``M - 1`` per stage, typically the in-flight count), and one extra add per
    parameter per microbatch.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.held: dict[int, list] = {}
        self.partial: dict[int, list] = {}
        self.next_mb = 0
        self.held_bytes = 0
        self.peak_held_bytes = 0  # extra gradient memory this mode has needed at once

    def capture(self, mb: int, final: bool = True):
        return _Capture(self, mb, final)

    def _add(self, contrib: list) -> None:
        for p, g in zip(self.params, contrib):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def put(self, mb: int, contrib: list, final: bool = True) -> None:
        first = self.partial.pop(mb, None)
        if first is not None:  # I's part (norms, embeddings) then W's part, in that order
            contrib = [b if a is None else (a if b is None else a + b) for a, b in zip(first, contrib)]
        if not final:
            self.partial[mb] = contrib
            self._count(contrib, +1)
            return
        if first is not None:
            self._count(first, -1)
        self.held[mb] = contrib
        self._count(contrib, +1)
        while self.next_mb in self.held:
            done = self.held.pop(self.next_mb)
            self._add(done)
            self._count(done, -1)
            self.next_mb += 1

    def _count(self, contrib: list, sign: int) -> None:
        self.held_bytes += sign * sum(g.numel() * g.element_size() for g in contrib if g is not None)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def finish(self, n_microbatches: int) -> None:
        """End of step: every microbatch's contribution must have been added."""
        if self.next_mb != n_microbatches or self.held or self.partial:
            raise PipelineError(
                f"deterministic accumulation saw microbatches 0..{self.next_mb - 1} of {n_microbatches}, "
                f"holding {sorted(self.held)}"
            )
        self.next_mb = 0


class _Capture:
    def __init__(self, acc: _OrderedGrads, mb: int, final: bool) -> None:
        self.acc, self.mb, self.final = acc, mb, final

    def __enter__(self) -> None:
        self.saved = [p.grad for p in self.acc.params]
        for p in self.acc.params:
            p.grad = None

    def __exit__(self, *exc) -> None:
        contrib = [p.grad for p in self.acc.params]
        for p, g in zip(self.acc.params, self.saved):
            p.grad = g
        if exc[0] is None:
            self.acc.put(self.mb, contrib, self.final)
