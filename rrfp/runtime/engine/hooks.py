"""Step hooks: how code outside the runtime (data parallelism, clipping, metrics) joins a step.

A hook object has two methods; both run on the rank's event loop thread, may be plain
functions or return an awaitable, and must not block (start the work and return its
awaitable instead)::

    class MyHooks(StepHooks):
        def on_stage_grads_final(self, stage_index):
            # every weight gradient of this stage is final for this step: e.g. start the
            # stage's DP all-reduce now, overlapping the pipeline's drain
            return start_all_reduce(stage_index)      # an awaitable, or None

        def on_step_end(self):
            # every stage hook's awaitable is done: e.g. clip (needs every reduction)
            return None

When they fire, on every rank, for the stages that rank holds:

- ``on_stage_grads_final(s)`` fires once per step per stage ``s``, as soon as the stage's last
  gradient task of the step is done: its last ``B``, or with a split backward its last ``W``
  (which comes after every ``I`` of the stage, so the ``I``-time parts, e.g. norms and
  embeddings, are in too). "Done" means the executor reported the task finished (device work
  included) and its outputs were handed on. In deterministic mode every microbatch's
  contribution has been added by then.
- An awaitable it returns is scheduled at once (``asyncio.ensure_future``), so it runs while
  the rank's remaining tasks run.
- After the rank's last task: every stage hook's awaitable is awaited, then ``on_step_end()``
  is called and its awaitable awaited. Only then does ``run_step`` return (and
  ``Pipeline.step``, so the optimizer sees the reduced gradients).
- An exception raised by a hook or its awaitable fails the step with that exception. The
  awaitables are waited for at most the runtime's watchdog period (then
  :class:`~rrfp.errors.WatchdogTimeout` names the step hooks).

Hooks are registered with :meth:`RankRuntime.add_step_hooks` and fire in registration order.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Iterable

from ...scheduler.tasks import Task
from ...errors import WatchdogTimeout


class StepHooks:
    """Base class of step hooks: both methods do nothing; override either (see module doc)."""

    def on_stage_grads_final(self, stage_index: int) -> Awaitable | None:
        """Stage ``stage_index``'s gradients are final for this step (its last B or W is done)."""
        return None

    def on_step_end(self) -> Awaitable | None:
        """The step's tasks and every stage hook's awaitable are done."""
        return None


class HookRunner:
    """Counts each stage's gradient tasks in a step and fires the hooks (used by the runtime).

    Args:
        stages: the stage indices this rank holds.
        n_microbatches: microbatches per step (a stage's gradients are final after that many
            gradient tasks).
        final_kind: the task kind that finishes a microbatch's gradients (``B``, or ``W`` with
            a split backward).
    """

    def __init__(self, stages: Iterable[int], n_microbatches: int, final_kind: str) -> None:
        self.stages = list(stages)
        self.n_microbatches = n_microbatches
        self.final_kind = final_kind
        self.hooks: list[StepHooks] = []
        self._left: dict[int, int] = {}
        self._awaiting: list[asyncio.Future] = []

    def add(self, hooks: StepHooks) -> None:
        self.hooks.append(hooks)

    def begin_step(self) -> None:
        self._left = dict.fromkeys(self.stages, self.n_microbatches)
        self._awaiting = []

    def task_done(self, task: Task) -> None:
        """A task finished (loop thread); fires the stage hooks when its stage is final."""
        if task.kind != self.final_kind:
            return
        s = task.stage
        self._left[s] -= 1
        if self._left[s] == 0:
            for h in self.hooks:
                self._schedule(h.on_stage_grads_final(s))

    def _schedule(self, aw: Awaitable | None) -> None:
        if aw is not None:
            self._awaiting.append(asyncio.ensure_future(aw))

    async def end_step(self, rank: int, step: int, timeout: float) -> None:
        """Await the stage hooks' awaitables, call ``on_step_end``, await its awaitables.

        Raises:
            WatchdogTimeout: the awaitables took longer than ``timeout`` seconds (0: no limit).
            whatever a hook or its awaitable raised.
        """
        not_final = [s for s, n in self._left.items() if n]
        if not_final:  # a runtime bug, not a user error: every stage's gradient tasks ran
            raise RuntimeError(f"rank {rank} step {step}: stages {not_final} never got final gradients")
        await self._wait(rank, step, timeout, "on_stage_grads_final")
        for h in self.hooks:
            self._schedule(h.on_step_end())
        await self._wait(rank, step, timeout, "on_step_end")

    async def _wait(self, rank: int, step: int, timeout: float, which: str) -> None:
        if not self._awaiting:
            return
        aws, self._awaiting = self._awaiting, []
        done, left = await asyncio.wait(aws, timeout=timeout if timeout > 0 else None,
                                        return_when=asyncio.FIRST_EXCEPTION)
        for f in left:
            f.cancel()
        errors = [f.exception() for f in aws if f in done and not f.cancelled()]
        first = next((e for e in errors if e is not None), None)  # in the order the hooks fired
        if first is not None:
            raise first
        if left:
            raise WatchdogTimeout(f"rank {rank} step {step}: {len(left)} {which} hook awaitable(s) "
                                  f"not done within the watchdog's {timeout:g} s")
