"""A rank's inbox: every arrival, admitted by its key into the router's receive buffers.

The transport hands each message to :meth:`Inbox.on_message` inside its delivery callback, on the
event loop thread. The inbox decides whether the message may be admitted (right job, this step
or the next, a stage and microbatch this rank runs, sent by the rank the
:class:`~rrfp.runtime.engine.router.Router` names, not a duplicate), puts its tensors in the router's
slot for (stage, microbatch, direction), tells the arbiter that an input arrived, and wakes the
scheduler loop.
Control messages (``Direction.CTL``: no tensors, a map as meta) go by their meta's ``kind`` to
the handler a step feature registered for it (:meth:`Inbox.on_control`: backfilling's started
notices, ``auto``'s figures), else to a bounded queue the rank's own code reads
(:meth:`Inbox.control`, :meth:`Inbox.poll_control`). Anything a correct pipeline cannot send is
refused and counted (:attr:`Inbox.rejected`), never fatal: a forged or replayed message must not
stop a job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping, Sequence

from ...scheduler.arbiter import Arbiter, SchedulingError
from ...transport.base import Message
from ...transport.keys import Direction
from ...errors import PipelineError
from .router import Router
from .stage import PipelineStage
from .timer import DeadlineTimers

log = logging.getLogger("rrfp.runtime")

# Read per message: a module global costs a tenth of an enum class's attribute lookup.
_ACT, _GRAD = Direction.ACT, Direction.GRAD

MAX_CONTROL_BACKLOG = 4096
"""Control messages a rank keeps unread before refusing more (per :class:`ControlQueue`)."""

ControlHandler = Callable[[Message, int], "str | None"]
"""``handler(msg, step) -> None`` (taken) or the reason it is refused (counted with the
inbox's refusals). ``step``: the step this rank runs, or runs next between steps. Called on the
event loop thread inside the transport's delivery callback: it must not block; an exception it
raises fails the rank's step, as a bad arrival does."""


class Inbox:
    """Arrivals of one rank: step admission into the router's buffers, control queue.

    Args:
        router: the rank's :class:`~rrfp.runtime.engine.router.Router` (who may send what; the
            buffers admitted inputs go to).
        job: the job id every admitted key must carry.
        stages: this rank's stages by stage index (their ``to_device`` places arrivals).
        n_microbatches: microbatches per step (keys outside ``[0, M)`` are refused).

    Attributes:
        rank: this rank's pipeline index (for log lines and errors).
        step: the step being run, or None between steps.
        last_step: the last finished step (-1 before the first).
        arb: the running step's arbiter (inputs are marked on it).
        pending: early arrivals (the next step's), by step; bounded per step.
        rejected: messages refused for their routing (wrong job, step, stage, duplicates...).
        error: the first error met on arrival (or from the transport); the step raises it.
        wake: set whenever something the scheduler loop waits for happens.
    """

    def __init__(self, router: Router, job: str, stages: Mapping[int, PipelineStage], n_microbatches: int) -> None:
        self.router = router
        self.rank = router.rank
        self.job = job
        self.stages = stages
        self.n_microbatches = n_microbatches
        # A step brings at most one activation and one gradient per stage and microbatch here.
        self._early_cap = 2 * len(stages) * n_microbatches
        self.step: int | None = None
        self.last_step = -1
        self.arb: Arbiter | None = None
        self.pending: dict[int, list[Message]] = {}
        self.rejected = 0
        self.error: BaseException | None = None
        self.closed = False
        self.wake = asyncio.Event()
        self._handlers: dict[str, ControlHandler] = {}
        self._control = ControlQueue(self)
        # How an arrival's tensors reach its stage's device: the stage's own to_device unless
        # an executor copies on its stream (CUDA).
        self.place: Callable[[PipelineStage, Sequence], tuple] | None = None
        # Injected communication delay (experiments, benchmarks): seconds to hold an arrival
        # before the arbiter learns of it, as if the wire had delivered it that much later.
        self.hold: Callable[[Message], float] | None = None
        self._timers: DeadlineTimers | None = None  # the holds' release times (made on first use)
        self._senders = (router.senders(Direction.ACT), router.senders(Direction.GRAD))  # for handle()
        self._n_stages = router.n_stages
        self._slots = (router.buffers(Direction.ACT), router.buffers(Direction.GRAD))  # by grad: False, True
        # Stages whose arrivals need no placing (plain PipelineStages on the host, no executor
        # copies): _admit buffers their tensors as they are, without place_on's calls. Set at
        # each step's start, since a stage's device is settled by then.
        self._host: frozenset[int] = frozenset()

    def on_control(self, kind: str, handler: ControlHandler) -> None:
        """Hand every control message whose meta's ``kind`` is ``kind`` to ``handler`` (see
        :data:`ControlHandler`) instead of the control queue; one handler per kind.

        Raises:
            ValueError: ``kind`` is not a non-empty string, or already has a handler.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"control kind {kind!r}: expected a non-empty string")
        if kind in self._handlers:
            raise ValueError(f"rank {self.rank}: control kind {kind!r} already has a handler "
                             f"({self._handlers[kind]!r})")
        self._handlers[kind] = handler

    # ------------------------------------------------------------ transport callbacks
    def handle(self, msg: Message) -> None:
        """The transport's delivery callback (``Transport.set_handler``); never raises.

        An input of the running step, sent by the rank :meth:`on_message` accepts it from, with
        no hold set, goes straight to :meth:`_admit`: the same checks as
        :meth:`on_message`'s, in one call instead of five (once per message); anything else
        takes :meth:`on_message`."""
        if self.closed:
            return
        try:
            key = msg.key
            step, d, s = self.step, key.direction, key.stage
            if (step is not None and key.step == step and (d == _ACT or d == _GRAD) and key.job == self.job
                    and self.hold is None and 0 <= s < self._n_stages and self._senders[d][s] == msg.src):
                self._admit(msg)
            else:
                self.on_message(msg)
        except Exception as e:  # noqa: BLE001 - handed to the scheduler loop
            self.fail(e)

    def _safely(self, fn: Callable[[Message], None], msg: Message) -> None:
        # Callbacks from outside the scheduler loop (the transport, the hold's timer): an
        # error is handed to the loop, never raised into the caller.
        if self.closed:
            return
        try:
            fn(msg)
        except Exception as e:  # noqa: BLE001 - handed to the scheduler loop
            self.fail(e)

    def transport_failed(self, e: BaseException) -> None:
        """The transport's terminal-error callback (a lost peer, a closed transport)."""
        if not self.closed:
            self.fail(e)

    def fail(self, e: BaseException) -> None:
        """Record the first error and wake the scheduler loop, which raises it."""
        if self.error is None:
            self.error = e
        self.wake.set()

    def close(self) -> None:
        """Admit nothing more; the running step (and any later one) fails at once."""
        self.closed = True
        if self._timers is not None:
            self._timers.close()
        self.fail(PipelineError(f"rank {self.rank}: closed"))

    # ------------------------------------------------------------ routing
    def on_message(self, msg: Message) -> None:
        """Route one arrival: control queue, early buffer, this step's buffers, or refusal."""
        key = msg.key
        if key.job != self.job:
            return self.reject(msg, f"job {key.job!r}, expected {self.job!r}")
        if key.direction == Direction.CTL:
            # Control messages are small statistics: no tensors, and a bounded backlog, so a
            # forged flood cannot grow a rank's memory.
            if msg.tensors:
                return self.reject(msg, "control message with tensors")
            if not isinstance(msg.meta, dict):  # the codec refuses it; a transport that skips it must not crash us
                return self.reject(msg, f"control meta of type {type(msg.meta).__name__}, expected a map")
            kind = msg.meta.get("kind")
            handler = self._handlers.get(kind) if kind.__class__ is str else None
            problem = (self._control.put(msg) if handler is None
                       else handler(msg, self.step if self.step is not None else self.last_step + 1))
            if problem is not None:
                self.reject(msg, problem)
            return
        # Only the rank holding the producing stage may send (the transport authenticates ``msg.src``).
        problem = self.router.sender_problem(msg.src, key.stage, key.direction)
        if problem is not None:
            return self.reject(msg, f"sent by rank {msg.src}, but {problem}")
        # A peer can be at most one step ahead: it needs this rank's step-k outputs to finish
        # step k, or (forward-only) this rank to begin it (engine/pace.py). Anything else is a
        # stale, forged or corrupt message.
        current = self.step if self.step is not None else self.last_step + 1
        if key.step == current + 1 or (self.step is None and key.step == current):
            early = self.pending.setdefault(key.step, [])
            # More than a step's inputs is a flood, and must not grow memory.
            if len(early) >= self._early_cap:
                return self.reject(msg, f"more early messages for step {key.step} than a step has inputs")
            early.append(msg)
            return
        if key.step != current:
            return self.reject(msg, f"step {key.step} while in step {current}")
        self.accept(msg)

    def reject(self, msg: Message, why: str) -> None:
        """Refuse ``msg`` and count it; the log is bounded (a hostile peer must not flood it)."""
        self.rejected += 1
        if self.rejected <= 10 or self.rejected % 1000 == 0:
            log.warning("rank %d: rejected message #%d from rank %d (%s): %s",
                        self.rank, self.rejected, msg.src, msg.key, why)

    def accept(self, msg: Message) -> None:
        """Buffer a message of the running step and mark its input on the arbiter (after
        :attr:`hold` seconds, when a hold is set and returns more than 0)."""
        if self.hold is not None:
            wait = self.hold(msg)
            if wait > 0:
                # The step cannot end before this input is admitted, so it is still the
                # running step when the timer fires. A kernel timer, not call_later: the
                # release must not be a millisecond late (rrfp.runtime.engine.timer).
                timers = self._timers
                if timers is None or timers.loop is not asyncio.get_running_loop():
                    if timers is not None:
                        timers.close()
                    timers = self._timers = DeadlineTimers(asyncio.get_running_loop())
                timers.call_at(time.monotonic() + wait, self._release, msg)
                return
        self._admit(msg)

    def _release(self, msg: Message) -> None:
        self._safely(self._admit, msg)

    def _admit(self, msg: Message) -> None:
        key = msg.key
        s, m, d = key.stage, key.microbatch, key.direction
        stage = self.stages.get(s)
        grad = d == _GRAD
        if stage is None or not 0 <= m < self.n_microbatches:
            return self.reject(msg, f"no task here for stage {s} microbatch {m}")
        try:
            self.arb.mark_input(s, m, grad)
        except SchedulingError as e:  # a duplicate: the first copy stands
            return self.reject(msg, str(e))
        if s in self._host:  # place_on would only make the tuple (PipelineStage.to_device on the host)
            tensors = list(msg.tensors) if grad else tuple(msg.tensors)
        else:
            tensors = self.place_on(stage, msg.tensors)
            if grad:
                tensors = list(tensors)
        slots = self._slots[grad]  # Router.put's slot inline (once per message)
        if (s, m) in slots:
            self.router.put(s, m, d, tensors)  # raises: a second input for one task
        slots[(s, m)] = tensors
        self.wake.set()

    def place_on(self, stage: PipelineStage, tensors: Sequence) -> tuple:
        """``tensors`` on ``stage``'s device (no copy on the CPU)."""
        return stage.to_device(tensors) if self.place is None else self.place(stage, tensors)

    def deliver_local(self, dst_stage: int, m: int, direction: Direction, tensors: list) -> None:
        """A same-rank handover between virtual stages: no serialization, no admission checks
        (this rank produced it). Called on the loop thread."""
        if direction == _ACT:
            self.router.put(dst_stage, m, direction, tuple(tensors))
        else:
            self.router.put(dst_stage, m, direction, [None if t is None else t.detach() for t in tensors])
        self.arb.mark_input(dst_stage, m, direction == _GRAD)

    # ------------------------------------------------------------ steps
    def begin_step(self, step: int, arb: Arbiter) -> None:
        """Start admitting ``step``'s inputs (clears the buffers, then admits the early
        arrivals kept for it)."""
        self.arb, self.step = arb, step
        self._host = frozenset() if self.place is not None else frozenset(
            s for s, st in self.stages.items()
            if getattr(st.to_device, "__func__", None) is PipelineStage.to_device and st.device.type == "cpu")
        self.router.clear()
        for msg in self.pending.pop(step, []):
            self.accept(msg)

    def end_step(self, step: int) -> None:
        """``step`` is over: the next one's arrivals are admitted as early messages."""
        self.step, self.last_step = None, step

    # ------------------------------------------------------------ control messages
    async def control(self, timeout: float | None = None) -> Message:
        """Next control (``Direction.CTL``) message addressed to this rank that no handler
        took (:meth:`ControlQueue.get`)."""
        return await self._control.get(timeout)

    def poll_control(self) -> list[Message]:
        """Control messages no handler took, received so far, without waiting."""
        return self._control.poll()


class ControlQueue:
    """Control messages kept for a reader: the inbox's own queue (messages no handler takes),
    or a step feature's (a handler that returns :meth:`put`'s answer). Bounded, so a forged
    flood cannot grow a rank's memory.

    Args:
        inbox: the rank's inbox (its ``error`` ends a wait; its ``wake`` tells of one).
        cap: messages kept unread before :meth:`put` refuses more.
    """

    def __init__(self, inbox: Inbox, cap: int = MAX_CONTROL_BACKLOG) -> None:
        self.inbox = inbox
        self.cap = cap
        self._queue: asyncio.Queue[Message] = asyncio.Queue()

    def put(self, msg: Message) -> str | None:
        """Keep ``msg`` for the reader; returns why it is refused (the queue is full), or None."""
        if self._queue.qsize() >= self.cap:
            return "control backlog full"
        self._queue.put_nowait(msg)
        return None

    async def get(self, timeout: float | None = None) -> Message:
        """The next message, in arrival order.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
            the inbox's error (a lost peer, a closed rank) as soon as it happens.
        """
        inbox = self.inbox
        if inbox.error is not None:
            raise inbox.error
        get = asyncio.ensure_future(self._queue.get())
        err = asyncio.ensure_future(self._wake_on_error())
        done, _ = await asyncio.wait({get, err}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        err.cancel()
        if get in done:
            return get.result()
        get.cancel()
        if inbox.error is not None:
            raise inbox.error
        raise TimeoutError(f"rank {inbox.rank}: no control message within {timeout} s")

    def poll(self) -> list[Message]:
        """The messages received so far, without waiting."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    async def _wake_on_error(self) -> None:
        inbox = self.inbox
        while inbox.error is None:
            inbox.wake.clear()
            await inbox.wake.wait()
