"""A launched task as the scheduler loop sees it, and the compute function an executor runs;
shared by every executor (:mod:`rrfp.runtime.engine.executor`, :mod:`rrfp.runtime.engine.cuda`)."""

from __future__ import annotations

from typing import Callable

from ...scheduler.tasks import Task

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
