"""Executors: where and how a rank's compute tasks run, observed without blocking the loop.

The protocol (ARCHITECTURE.md, "One rank, one event loop"):

- ``launch(task, run_fn) -> Pending``: start ``run_fn(task)`` (the task's compute; it returns
  the task's outputs, a list the runtime hands on afterwards). Called on the event loop thread.
- completion is observed without blocking the loop: the executor sets ``pending.launched``
  (the host part is over: the arbiter may be told and the outputs handed on) and
  ``pending.done`` (the device part is over too: its time counts, its gradients are final),
  then calls the ``wake`` function given to :meth:`Executor.bind`, on the loop thread.
- ``release(pending)``: the runtime has handed the outputs on; the executor drops what it kept
  for the task (events, references to tensors), so memory frees when the transport is done.

Which executor, and why: an inline dispatch costs microseconds where a hop to a worker thread
and back costs about 90 us on a 2-core machine, so inline is the CPU default; the worker thread
keeps the loop answering during long tasks.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from ..scheduler.tasks import Task

RunFn = Callable[[Task], list]
"""``run_fn(task)``: runs a task's compute and returns its outputs (handed on by the loop)."""


class Pending:
    """One launched task, as the scheduler loop sees it.

    Attributes:
        task: the task.
        t0: ``time.perf_counter()`` at launch (seconds).
        outputs: what ``run_fn`` returned, once ``launched``.
        error: the exception ``run_fn`` raised (the loop re-raises it), or None.
        launched: the host part is over (outputs and ``error`` are set).
        done: the task is over, device work included; implies ``launched``.
        completed: set by the loop once the arbiter has been told.
    """

    __slots__ = ("task", "t0", "outputs", "error", "launched", "done", "completed", "handle")

    def __init__(self, task: Task, t0: float) -> None:
        self.task = task
        self.t0 = t0
        self.outputs: list = []
        self.error: BaseException | None = None
        self.launched = False
        self.done = False
        self.completed = False
        self.handle = None  # executor-private (a CUDA event, a thread's future)


class Executor(Protocol):
    """What the scheduler loop needs from an executor (see the module docstring).

    Attributes:
        name: ``inline``, ``thread`` or ``cuda``.
        window: how many launched tasks may be unfinished at once (the launch-ahead window;
            1 means the next task launches only when the previous one is done).
    """

    name: str
    window: int

    def bind(self, wake: Callable[[], None]) -> None:
        """Called once on the loop thread before the first launch: ``wake()`` (loop thread
        only) tells the scheduler loop that a pending task changed state."""

    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        """Start ``run_fn(task)``; an exception from it may raise here or land in
        ``pending.error``."""

    def release(self, pending: Pending) -> None:
        """Forget ``pending`` (its outputs were handed on)."""

    def close(self) -> None:
        """Free the executor's resources (threads, streams); idempotent."""


class InlineExecutor:
    """Runs each task to completion inside :meth:`launch`, on the loop thread (the CPU default).

    ZeroMQ keeps receiving in its own I/O thread while Python computes, and the arrivals are
    routed as soon as the task returns, so inline costs nothing per task beyond the call.
    """

    name = "inline"
    window = 1

    def bind(self, wake: Callable[[], None]) -> None:
        pass

    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        p = Pending(task, time.perf_counter())
        p.outputs = run_fn(task)
        p.launched = p.done = True
        return p

    def release(self, pending: Pending) -> None:
        pass

    def close(self) -> None:
        pass
