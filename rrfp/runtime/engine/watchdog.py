"""The task watchdog: a task that runs longer than the watchdog period, seen from another thread.

The scheduler loop's own watchdog (:mod:`rrfp.runtime.engine.loop`) runs on the event loop: it
notices a rank that waits too long for a message, but not a task that never returns. With the
inline executor the task holds the loop thread, so no timer of the loop ever runs again; with
the worker-thread executor the loop counts a running task as busy, not stalled. One daemon
thread per process (:class:`_Watcher`) therefore looks at every rank's running task
(:class:`TaskWatch`) a few times per period, and a task that has run a whole period ends as
follows (README, "Clean ends"):

- **the task holds the loop thread** (inline executor, the CPU default; the host part of a
  CUDA task): nothing can unwind it. The watchdog writes the stuck thread's stack to stderr,
  then one line, ``rrfp: watchdog: rank R (stages [...]) stuck in task T of step S for N s
  (watchdog P s); ending the process (exit 1)``, and ends the process with exit code
  :data:`STUCK_EXIT` (``os._exit``: a thread that never returns cannot be joined).
- **the task runs on a worker thread** (``executor="thread"``): the stuck thread's stack goes
  to stderr and the rank's step raises :class:`~rrfp.errors.WatchdogTimeout` with that line
  in the caller, as any other watchdog timeout; the worker is a daemon thread, so the process
  can exit (an uncaught error: Python's exit code 1).

A task counts from the moment its compute starts on its thread until it returns, in wall time
(``time.monotonic``); the watchdog period is the runtime's ``watchdog`` (0 disables both
watchdogs). An event loop that keeps its own simulated time (tests/virtual_time.py: its clock
is more than a second away from ``time.monotonic``) is timed on that clock, which stands still
while a task holds the loop: as for the loop's watchdog, simulated time alone decides. While a rank of an event loop runs a task, the other ranks of that loop (every
rank of a :class:`~rrfp.runtime.doors.local.LocalPipeline`) are not stalled by waiting for it:
:func:`loop_busy` tells their loop watchdog so, and the one that is stuck is the one reported.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Callable, Sized

from ...errors import WatchdogTimeout
from .pending import RunFn

STUCK_EXIT = 1
"""Exit code of a process whose loop thread the watchdog found stuck in a task (as an uncaught
:class:`~rrfp.errors.WatchdogTimeout`, or any failing rank of ``rrfp train``)."""

_CHECKS_PER_PERIOD = 4  # a stuck task is reported between 1 and 1.25 periods after it started


class TaskWatch:
    """One rank's running task, as the watchdog thread sees it.

    Args:
        rank: the rank (for the report).
        period: seconds a task may run (the runtime's ``watchdog``; 0 disables).
        stages: the rank's stage indices (for the report).
        on_stuck: ``on_stuck(step, exc)``, called on the rank's event loop thread when a task
            of ``step`` on a worker thread is stuck: the scheduler loop raises ``exc`` from
            that step.
        pending: the rank's tasks launched and not yet taken back in by its loop (the
            scheduler loop's queue; only its length is read).
    """

    def __init__(self, rank: int, period: float, stages: list[int],
                 on_stuck: Callable[[int, WatchdogTimeout], None], pending: Sized = ()) -> None:
        self.rank = rank
        self.period = period
        self.stages = stages
        self.on_stuck = on_stuck
        self.pending = pending  # the rank's launched tasks its loop has not taken back in
        self.current: tuple | None = None  # (task, step, start, thread ident) while a task runs
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._announced: tuple | None = None  # the ``current`` the watchdog thread reported
        self._reported: tuple | None = None  # ... whose report the loop thread has taken in

    def watched(self, run_fn: RunFn, step: int) -> RunFn:
        """``run_fn`` timed by the watchdog thread, on whatever thread the executor runs it;
        call on the event loop thread when a step starts. ``run_fn`` itself when disabled."""
        if not self.arm():
            return run_fn
        clock = self.clock

        def run(task):
            self.current = (task, step, clock(), threading.get_ident())
            try:
                return run_fn(task)
            finally:
                self.current = None

        return run

    def arm(self) -> bool:
        """Watch the tasks of a step about to start (on the event loop thread); False when
        disabled. A task runs watched while :attr:`current` is ``(task, step, clock(), thread
        ident)``: :meth:`watched`'s wrapper sets it, or the scheduler loop for a task it runs
        itself on the loop thread."""
        if self.period <= 0:
            return False
        self.loop = loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.clock = loop.time if abs(loop.time() - time.monotonic()) > 1.0 else time.monotonic
        _watcher().add(self)
        return True

    @property
    def busy(self) -> bool:
        """A task runs and its stuck report, if any, has not reached the rank's loop yet; or,
        none running, a launched task is not yet taken back in by the loop: queued for its
        worker thread, or returned and its result not yet handed on (a neighbour's loop
        watchdog judging then would name the rank that only waits for this one)."""
        cur = self.current
        if cur is not None:
            return cur is not self._reported
        return len(self.pending) > 0

    def still_stuck(self) -> str | None:
        """One line naming this rank's task that was reported stuck and has not returned (its
        worker thread never came back), None without one: a step started after it would queue
        behind that thread and wait for ever."""
        cur = self.current
        if cur is None or cur is not self._reported:
            return None
        task, step, start, _ = cur
        return (f"rank {self.rank} (stages {self.stages}) cannot run another step: its task {task} of step {step} "
                f"has been stuck on a worker thread for {self.clock() - start:.1f} s (watchdog {self.period:g} s); "
                f"close the pipeline")

    def check(self) -> None:
        """On the watchdog thread: report the running task if it has run a whole period."""
        cur = self.current
        if cur is None or cur is self._announced or (now := self.clock()) - cur[2] < self.period:
            return
        self._announced = cur
        task, step, start, ident = cur
        line = (f"rank {self.rank} (stages {self.stages}) stuck in task {task} of step {step} for "
                f"{now - start:.1f} s (watchdog {self.period:g} s)")
        _write_stack(ident, f"rrfp: watchdog: where rank {self.rank}'s task {task} is stuck:\n")
        if ident == self.loop_thread:
            _end_process(f"rrfp: watchdog: {line}; ending the process (exit {STUCK_EXIT})")
        try:
            self.loop.call_soon_threadsafe(self._deliver, cur, step, WatchdogTimeout(line))
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this step
            pass

    def _deliver(self, cur: tuple, step: int, exc: WatchdogTimeout) -> None:
        # On the loop thread. The rank stays busy for its loop's other ranks until here, not
        # from the watchdog thread's report: had their loop watchdog judged them stalled in
        # between, a rank merely waiting for the stuck one could fail the step first and be
        # the one named. From here the stuck rank's wake is set one loop turn before any of
        # theirs can be.
        self._reported = cur
        self.on_stuck(step, exc)


def loop_busy(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a rank of ``loop`` runs a task (whose stuck report, if any, ``loop`` has not
    taken in yet): then a rank of the same loop that waits is waiting on it, not stalled."""
    w = _WATCHER
    return w is not None and any(t.busy and t.loop is loop for t in w.watches())


def _write_stack(ident: int, header: str) -> None:
    frame = sys._current_frames().get(ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (the thread has ended)\n"
    _write(header + stack)


def _write(text: str) -> None:
    # Straight to the file descriptor: the stuck thread may hold sys.stderr's lock.
    data = text.encode("utf-8", "replace")
    while data:
        try:
            data = data[os.write(2, data):]
        except OSError:
            return


def _end_process(line: str) -> None:
    _write(line + "\n")
    os._exit(STUCK_EXIT)


class _Watcher:
    """The process's one watchdog thread (a daemon: it never holds an exit)."""

    def __init__(self) -> None:
        self._watches: weakref.WeakSet[TaskWatch] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._changed = threading.Event()
        threading.Thread(target=self._run, name="rrfp-watchdog", daemon=True).start()

    def add(self, watch: TaskWatch) -> None:
        with self._lock:
            if watch in self._watches:
                return
            self._watches.add(watch)
        self._changed.set()

    def watches(self) -> list[TaskWatch]:
        with self._lock:
            return list(self._watches)

    def _run(self) -> None:
        while True:
            self._changed.clear()
            watches = self.watches()
            if not watches:  # a pipeline's watches go with it: sleep until the next one comes
                self._changed.wait()
                continue
            for w in watches:
                w.check()
            self._changed.wait(min(w.period for w in watches) / _CHECKS_PER_PERIOD)


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher:
    global _WATCHER
    if _WATCHER is None:
        with _WATCHER_LOCK:
            if _WATCHER is None:
                _WATCHER = _Watcher()
    return _WATCHER


def _reset_after_fork() -> None:
    # A forked child has no watchdog thread: it starts its own when it needs one.
    global _WATCHER
    _WATCHER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)

__all__ = ["STUCK_EXIT", "TaskWatch", "loop_busy"]
