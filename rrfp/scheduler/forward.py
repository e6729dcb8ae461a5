"""Forward-only steps (``Pipeline.eval()``, and ``step()`` without a ``loss_fn``, as in
``torch.distributed.pipelining``): an arbiter over one rank's forwards alone.

No backward follows, so nothing is held in flight and no in-flight limit applies; a ready
forward of a deeper virtual stage goes first, so microbatches leave the rank as early as they
can: the ready set's forward heap, depth-first. It keeps its state in the same
:class:`~rrfp.scheduler.readyset.ReadySet` as :class:`~rrfp.scheduler.arbiter.Arbiter` and
has its interface (``next``, ``propose``,
``commit``, ``mark_input``, ``complete``, ``waiting_for``).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from .errors import SchedulingError
from .readyset import ReadySet
from .tasks import F, PipelineSpec, Task


class ForwardArbiter:
    """Chooses what one rank runs next in a forward-only step.

    Args:
        spec: the pipeline's shape.
        rank: this rank's pipeline index.
    """

    def __init__(self, spec: PipelineSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.stages = spec.placement.stages_of(rank)
        self.ready = ReadySet(self.stages, spec.n_microbatches, queues=True, depth_first=True)
        self._n_mb = spec.n_microbatches
        self.n_tasks = len(self.stages) * self._n_mb
        self.n_done = 0
        self.running: Task | None = None
        # Forwards only keep no activations for a backward: nothing is held, nothing counted.
        self.peak_inflight = self.peak_mb_inflight = self.peak_bytes = self.peak_one = 0
        if self.stages[0] == 0:
            for m in range(self._n_mb):
                self.ready.act[m] = 1
                self.ready.add(Task(0, F, m))

    @property
    def finished(self) -> bool:
        return self.n_done == self.n_tasks

    def mark_input(self, stage: int, mb: int, grad: bool) -> None:
        """An activation arrived for ``F(stage, mb)``.

        Raises:
            SchedulingError: a gradient (none exists in a forward-only step), a stage this
                rank does not hold, or a duplicate.
        """
        v = self.ready.vidx.get(stage)
        if grad or v is None or not 0 <= mb < self._n_mb:
            what = "gradient" if grad else "input"
            raise SchedulingError(
                f"rank {self.rank}: {what} for stage {stage} microbatch {mb}, which this forward-only step does not run"
            )
        i = v * self._n_mb + mb
        if self.ready.act[i]:
            raise SchedulingError(f"rank {self.rank}: duplicate activation for stage {stage} microbatch {mb}")
        self.ready.act[i] = 1
        self.ready.add(Task(stage, F, mb))

    def propose(self) -> Task | None:
        """The ready forward of the deepest virtual stage (lowest microbatch first), not
        taken; None when none is ready.

        Raises:
            SchedulingError: a task is already running.
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: propose() while {self.running} is running")
        if not self.ready.f:
            return None
        _, m, s = self.ready.f[0]
        return Task(s, F, m)

    def commit(self, task: Task) -> None:
        """Take ``task`` (it runs).

        Raises:
            SchedulingError: a task is running, or ``task`` is not a ready forward.
        """
        if self.running is not None:
            raise SchedulingError(f"rank {self.rank}: commit of {task} while {self.running} is running")
        if task.kind != F or task.stage not in self.ready.vidx or not 0 <= task.mb < self._n_mb \
                or not self.ready.is_ready(task):
            raise SchedulingError(f"rank {self.rank}: commit of {task}, which is not ready")
        self.ready.take(task)
        self.running = task

    def next(self) -> Task | None:
        """Take the ready forward of the deepest virtual stage (lowest microbatch first):
        :meth:`propose`, then take it.

        Raises:
            SchedulingError: a task is already running.
        """
        t = self.propose()
        if t is not None:
            self.ready.take(t)
            self.running = t
        return t

    def complete(self, task: Task) -> None:
        """The running ``task`` finished.

        Raises:
            SchedulingError: ``task`` is not the running task.
        """
        if task != self.running:
            raise SchedulingError(f"rank {self.rank}: completed {task} but {self.running} was running")
        self.running = None
        self.n_done += 1
        c, i = self.ready.key(task)
        self.ready.done[c][i] = 1

    def waiting_for(self, limit: int = 3) -> str:
        """What this rank waits for, in words (for the watchdog's error)."""
        if self.finished:
            return "nothing (step finished)"
        if self.running is not None:
            return f"task {self.running} to finish"
        place = self.spec.placement
        act = self.ready.act
        missing = [
            f"activation for {Task(s, F, m)} {place.source(place.prev_stage(s))}"
            for m in range(self._n_mb) for v, s in enumerate(self.stages) if not act[v * self._n_mb + m]
        ]
        return "; ".join(missing[:limit]) or "no ready task"
