"""The scheduler loop of one rank: arbiter -> executor -> hand the outputs on, and the watchdog.

One coroutine per step. Each turn it hands on what the executor finished (outputs to the
outbox or to a same-rank virtual stage, the task to the arbiter as completed), then, while the
launch-ahead window has room and the arbiter has no task running, asks the arbiter for the
next task and launches it. With nothing to do it waits for the inbox's ``wake`` event: an
arrival, an executor's completion, an error, or the watchdog.

The watchdog's clock is the event loop's own (``loop.time()``), the clock its timer runs on
and the one the fake transport's message delays are drawn on: a test that runs the loop on
simulated time (tests/virtual_time.py) decides every watchdog outcome without real delays.

Step features join the loop through two seams and nothing else: step observers
(:mod:`~rrfp.runtime.engine.observer`, :meth:`SchedulerLoop.add_observer`) are told when a step
begins and ends, before each decision, when a task starts and finishes, and when the loop
waits (backfilling's started notices, :mod:`rrfp.runtime.features.notices`); a decider
(:meth:`SchedulerLoop.set_decider`) takes the arbiter's place in choosing each task when the
choice must be agreed with other ranks first (TP agreement,
:mod:`rrfp.runtime.features.agreement`).

The arbiter runs one task at a time (``Arbiter.running``): an executor whose tasks complete on
the host at launch (CUDA: the kernels are queued on the rank's stream, in order) may run up to
``executor.window`` tasks ahead of the device; a worker-thread executor is told complete when
its thread returns.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections import deque
from typing import Awaitable, Callable

from ...scheduler.arbiter import Arbiter
from ...scheduler.tasks import Task, TaskRecord
from ...errors import WatchdogTimeout
from .executor import Executor, InlineExecutor, Pending, RunFn
from .hooks import HookRunner
from .inbox import Inbox
from .observer import StepObserver
from .watchdog import TaskWatch, loop_busy

@types.coroutine
def _yield():
    """What ``await asyncio.sleep(0)`` does (one bare yield: the task runs again on the loop's
    next turn), without sleep's own call and its generator."""
    yield


AGAIN = object()
"""What a decider returns when no task may run yet but the loop should look at arrivals and
ask again at once (the TP group disagreed on the proposed task)."""

DelayFn = Callable[[int, int, Task], float]  # (step, rank, task) -> extra seconds
EmitFn = Callable[[list], None]  # hands a finished task's outputs on (loop thread)
DeciderFn = Callable[[Arbiter], Awaitable]
"""``await decide(arb)``: the next task (committed on ``arb``), None when nothing may run now
(the loop waits for an event), or :data:`AGAIN`."""


class SchedulerLoop:
    """Runs the tasks of one rank's steps.

    Args:
        rank: the rank (for errors and records).
        inbox: the rank's inbox (its ``wake`` event and ``error``).
        executor: where tasks run (see :mod:`rrfp.runtime.engine.executor`).
        watchdog: seconds without progress before :class:`WatchdogTimeout` (0 disables).
        task_delay: optional injected extra seconds per task (jitter experiments), awaited after
            the task's compute while the rank counts as busy; its outputs leave afterwards.
        record: keep a :class:`TaskRecord` per task in the step's stats.
    """

    def __init__(self, rank: int, inbox: Inbox, executor: Executor, *, watchdog: float = 300.0,
                 task_delay: DelayFn | None = None, record: bool = False) -> None:
        self.rank = rank
        self.inbox = inbox
        self.executor = executor
        self.watchdog = watchdog
        self.task_delay = task_delay
        self.record = record
        self._running: deque[Pending] = deque()  # launched, not yet finished
        self._arb: Arbiter | None = None
        self._step: int | None = None
        self._watch: asyncio.TimerHandle | None = None  # the watchdog's timer, armed while waiting
        self._waiting = False  # the loop waits for an event
        self._timed_out: WatchdogTimeout | None = None
        self._clock: Callable[[], float] = time.monotonic  # the watchdog's: run() binds the loop's
        self._progress = 0.0  # the watchdog's clock at the last task's end (or the step's start)
        self._last_end = 0.0
        self.observers: tuple[StepObserver, ...] = ()  # every registered observer
        self._watching: tuple[StepObserver, ...] = ()  # those taking this step's task events
        self.decide: DeciderFn | None = None  # None: the arbiter's own next()
        # A task that never returns; a launched one counts as busy for this loop's other ranks.
        self.task_watch = TaskWatch(rank, watchdog, list(inbox.stages), self._stuck, self._running)
        executor.bind(inbox.wake.set)

    def add_observer(self, observer: StepObserver) -> None:
        """Tell ``observer`` what this loop does from the next step on
        (:mod:`~rrfp.runtime.engine.observer`: the events, when each fires, their order)."""
        self.observers = (*self.observers, observer)

    def set_decider(self, decide: DeciderFn) -> None:
        """Choose each task with ``await decide(arb)`` instead of ``arb.next()`` (see
        :data:`DeciderFn`); one decider per loop.

        Raises:
            ValueError: a decider is already set.
        """
        if self.decide is not None:
            raise ValueError(f"rank {self.rank}: a decider is already set ({self.decide!r})")
        self.decide = decide

    async def run(self, arb: Arbiter, step: int, stats, run_fn: RunFn, emit: EmitFn,
                  hooks: HookRunner | None = None) -> None:
        """Run every task of ``arb``'s step; fills ``stats`` (busy, n_tasks, records).

        Raises:
            the inbox's error (lost peer, closed rank, bad arrival), a task's exception,
            WatchdogTimeout.
        """
        inbox, ex = self.inbox, self.executor
        inline = ex.__class__ is InlineExecutor  # run here, not through launch (the CPU default)
        run_fn = self._begin(arb, step, run_fn, inline)
        running = self._running
        wake = inbox.wake
        decide = self.decide
        tw = self.task_watch
        watched = inline and tw.period > 0  # armed by _begin
        perf = time.perf_counter
        watching = self._watching = tuple(o for o in self.observers if o.step_begins(step, arb) is not False)
        try:
            while True:
                if inbox.error is not None:
                    raise inbox.error
                wake.clear()
                if running:
                    await self._hand_on_finished(arb, step, stats, emit, hooks)
                if arb.n_done == arb.n_tasks:  # arb.finished, without the property's call
                    if not running:
                        break
                elif arb.running is None and len(running) < ex.window:
                    if watching:
                        for o in watching:
                            o.before_decision()
                    task = arb.next() if decide is None else await decide(arb)
                    if task is AGAIN:  # e.g. the TP group disagreed: look at arrivals, decide again
                        await _yield()
                        continue
                    if task is not None:
                        if watching:  # before the task: an inline one runs inside launch
                            for o in watching:
                                o.task_started(step, task)
                        if inline:  # InlineExecutor.launch, TaskWatch.watched, _hand_on and _finished
                            # inlined: the same calls in the same order, no Pending or frame per task.
                            t0 = perf()
                            if watched:
                                tw.current = (task, step, tw.clock(), tw.loop_thread)
                            try:
                                outputs = run_fn(task)
                            finally:
                                tw.current = None
                            if self.task_delay is not None:
                                await self._delay(step, task)
                            if outputs:
                                emit(outputs)
                            arb.complete(task)
                            t1 = perf()
                            last = self._last_end
                            stats.busy += t1 - (t0 if t0 > last else last)
                            stats.n_tasks += 1
                            if self.record:
                                stats.records.append(TaskRecord(self.rank, step, task, t0, t1))
                            self._last_end = t1
                            self._progress = self._clock()
                            if watching:
                                for o in watching:
                                    o.task_finished(step, task, t0, t1)
                            if hooks is not None:
                                hooks.task_done(task)
                        else:
                            await self._launch(task, run_fn, arb, step, stats, emit, hooks)
                        # Let the transport deliver arrivals so the next decision sees them
                        # (asyncio.sleep(0)'s one bare yield, without its two calls).
                        await _yield()
                        continue
                await self._wait_for_event()
        finally:
            self._disarm_watchdog()
        for o in self.observers:
            o.step_ends(step, stats)

    async def _hand_on_finished(self, arb: Arbiter, step: int, stats, emit: EmitFn,
                                hooks: HookRunner | None) -> None:
        # An executor's finished tasks, handed on in launch order (a later one waits for an
        # earlier one still running, so completions reach the arbiter in the launch order).
        running = self._running
        while running:
            p = running[0]
            if not p.launched:
                return
            if p.error is not None:
                raise p.error
            if not p.completed:
                if self.task_delay is not None:
                    await self._delay(step, p.task)
                self._hand_on(p, arb, emit)
            if not p.done:
                return
            running.popleft()
            self._finish(p, step, stats, hooks)

    async def _launch(self, task, run_fn: RunFn, arb: Arbiter, step: int, stats, emit: EmitFn,
                      hooks: HookRunner | None) -> None:
        # A task through the executor's launch (not the loop's own inline path).
        p = self.executor.launch(task, run_fn)
        if p.done and p.error is None:  # finished inside launch
            if self.task_delay is not None:
                await self._delay(step, task)
            self._hand_on(p, arb, emit)
            self._finish(p, step, stats, hooks)
        else:
            self._running.append(p)

    def _begin(self, arb: Arbiter, step: int, run_fn: RunFn, inline: bool) -> RunFn:
        # A step's start: its state reset, and run_fn as the task watchdog times it (inline:
        # run() marks each task on the armed watch itself and gets run_fn as it is).
        self._arb, self._step = arb, step
        self._clock = asyncio.get_running_loop().time
        self._progress = self._clock()
        self._last_end = 0.0
        self._timed_out = None
        self._running.clear()
        self.task_watch.period = self.watchdog
        stuck = self.task_watch.still_stuck()
        if stuck is not None:
            raise WatchdogTimeout(stuck)
        if inline:
            self.task_watch.arm()
            return run_fn
        return self.task_watch.watched(run_fn, step)

    async def _delay(self, step: int, task: Task) -> None:
        # Injected delays stand for device time: the rank stays busy but its loop keeps
        # receiving, as with a GPU kernel awaited through an event, and the task's outputs
        # leave only when it is done.
        extra = self.task_delay(step, self.rank, task)
        if extra > 0:
            await asyncio.sleep(extra)

    @staticmethod
    def _hand_on(p: Pending, arb: Arbiter, emit: EmitFn) -> None:
        if p.outputs:
            emit(p.outputs)
        arb.complete(p.task)
        p.completed = True

    def _finish(self, p: Pending, step: int, stats, hooks: HookRunner | None) -> None:
        self._finished(p.task, p.t0, step, stats, hooks, p)

    def _finished(self, task: Task, t0: float, step: int, stats, hooks: HookRunner | None,
                  p: Pending | None = None) -> None:
        # ``p``: the executor's Pending, released here (None: none). run()'s inline path has
        # these lines in its own body (once per task): a change here is one there too.
        t1 = time.perf_counter()
        # Tasks launched ahead overlap on the device: count each instant once.
        stats.busy += t1 - (t0 if t0 > self._last_end else self._last_end)
        stats.n_tasks += 1
        if self.record:
            stats.records.append(TaskRecord(self.rank, step, task, t0, t1))
        self._last_end = t1
        self._progress = self._clock()
        if self._watching:
            for o in self._watching:
                o.task_finished(step, task, t0, t1)
        if p is not None:
            self.executor.release(p)
        if hooks is not None:
            hooks.task_done(task)

    # ------------------------------------------------------------ watchdog
    async def _wait_for_event(self) -> None:
        wake = self.inbox.wake
        if self._watching:
            for o in self._watching:
                o.idle()
        if self.watchdog <= 0:
            await wake.wait()
            return
        # One timer per watchdog period, not asyncio.wait_for per wait: wait_for wraps each
        # wait in a task and a timeout handle, most of what a short wait costs.
        if self._watch is None:
            self._arm_watchdog(self._progress + self.watchdog - self._clock())
        self._waiting = True
        try:
            await wake.wait()
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
        left = self._progress + self.watchdog - self._clock()
        if left > 0:  # progress since arming
            self._arm_watchdog(left)
            return
        if not self._waiting or self._running or loop_busy(asyncio.get_running_loop()):
            # Busy in a task or its injected delay, or waiting on a rank of this loop that runs
            # one: not stalled (a task that never returns is the task watchdog's to report).
            self._arm_watchdog(self.watchdog)
            return
        if self.inbox.wake.is_set():
            # An input came in the same loop turn as the deadline: let the loop look at it
            # first, and judge again right after.
            self._arm_watchdog(0.0)
            return
        self._timed_out = WatchdogTimeout(
            f"rank {self.rank} (stages {list(self.inbox.stages)}) made no progress for {self.watchdog:g} s "
            f"in step {self._step}: waiting for {self._arb.waiting_for()}"
        )
        self.inbox.wake.set()

    def _stuck(self, step: int, exc: WatchdogTimeout) -> None:
        # The task watchdog (rrfp/runtime/engine/watchdog.py) found a task of this rank stuck
        # on a worker thread: the step raises its error from the wait.
        if self._step == step:
            self._timed_out = exc
            self.inbox.wake.set()
