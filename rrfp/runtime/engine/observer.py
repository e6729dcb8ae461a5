"""Step observers: how a step feature watches a rank's scheduler loop.

An observer is told what the rank's scheduler loop (:class:`~rrfp.runtime.engine.loop.SchedulerLoop`)
does, as it does it. Every method runs on the rank's event loop thread, inside the loop's own
turn, and must return quickly without blocking or awaiting (a feature with slow work starts it
and returns; a feature that must wait belongs in :mod:`~rrfp.runtime.engine.hooks` or the
decider seam, :meth:`SchedulerLoop.set_decider`)::

    class CountTasks(StepObserver):
        def step_begins(self, step, arb):
            self.n = 0
            return True                       # receive this step's task events

        def task_finished(self, step, task, start, end):
            self.n += 1

    runtime.loop.add_observer(CountTasks())

When each fires, for every rank, in this order within a step:

- ``step_begins(step, arb)``: once, when the loop starts the step's tasks (the step's
  arbiter built, this step's early arrivals already admitted), before the first decision.
  It returns whether the observer takes this step's *task events* (the four below): True
  (the default) or None to take them, False to sit the step out. A feature that acts only
  under some hints says False in the other steps, so they pay nothing for it.
- ``before_decision()``: just before each time the loop asks the arbiter (or a decider) for a
  task, whether or not one comes back.
- ``task_started(step, task)``: the arbiter chose ``task`` and the loop is about to hand it to
  the executor. It fires before the task runs (an inline executor runs it inside the launch).
- ``task_finished(step, task, start, end)``: the task is done (device work included) and its
  outputs were handed on. ``start`` and ``end`` are ``time.perf_counter()`` seconds (the
  executor's launch, the loop's noticing the end). Tasks finish in launch order, one event
  each.
- ``idle()``: the loop has nothing to launch and waits for an event (an arrival, a
  completion, an error, the watchdog); once per wait.
- ``step_ends(step, stats)``: once, after the rank's last task finished (and before the step
  hooks' ``on_step_end``, :mod:`~rrfp.runtime.engine.hooks`), to every observer, including
  those that sat the step out; ``stats`` is the step's
  :class:`~rrfp.runtime.engine.rank.StepStats` as far as the loop filled it (``busy``,
  ``n_tasks``, ``records``). A step that fails ends without it.

Observers fire in registration order. An exception raised by one fails the step with that
exception. With no observer taking a step's task events, the loop's per-task path has one
empty-tuple test at each of those four places (``benchmarks/micro.py``).
"""

from __future__ import annotations

from typing import Any

from ...scheduler.tasks import Task


class StepObserver:
    """Base class of step observers: every method does nothing; override any (module doc)."""

    def step_begins(self, step: int, arb: Any) -> bool | None:
        """Step ``step`` starts under arbiter ``arb``; False: no task events this step."""
        return True

    def before_decision(self) -> None:
        """The loop is about to ask for the next task."""

    def task_started(self, step: int, task: Task) -> None:
        """``task`` is about to run."""

    def task_finished(self, step: int, task: Task, start: float, end: float) -> None:
        """``task`` is done; ``start``, ``end`` in ``time.perf_counter()`` seconds."""

    def idle(self) -> None:
        """The loop waits for an event."""

    def step_ends(self, step: int, stats: Any) -> None:
        """Step ``step``'s tasks are all done (``stats``: its StepStats)."""
