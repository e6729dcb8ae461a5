"""Conservative backfilling over a strict order (one rank; EASY/conservative backfilling of
batch schedulers, Mu'alem and Feitelson 2001, applied to a pipeline rank's fixed order).

A rank running a strict order waits whenever the order's next task, the *planned* task, has
not received its input. Backfilling runs a *later* task of the order that is ready now, but
only if its estimated cost ends before a lower bound on the planned task's input arrival:

- the planned task's producer (``F(s-1, m)`` for ``F(s, m)``; the input backward of
  ``(s+1, m)`` for a backward of ``(s, m)``) sent a "started, estimated end T" notice: the
  input arrives no earlier than ``T``;
- no notice, and notices are complete (every started task is known, as in the simulator,
  where they travel instantly): the producer starts no earlier than now, so the input arrives
  no earlier than now plus the producer's estimated cost;
- otherwise (the runtime, where a notice may still be in transit) nothing is known and the
  rank does not backfill.

A backfilled forward must also keep the rank's bytes within the strict order's own peak
(checked by the arbiter against the order's byte profile), so backfilling needs no memory
beyond its strict order's.

**Never slower with exact costs.** Let every estimate equal the task's real duration and
message delays be ``>= min_delay``. Write ``s*(t)`` for the start of task ``t`` in the strict
run and ``b(t)`` in the backfilled run; compare tasks in the order of ``s*``. Claim:
``b(t) <= s*(t)`` for every task. A task starts at the later of its rank becoming free and its
input arriving. Its input comes from a task that, by induction, ended no later than in the
strict run, so it arrives no later. Its rank becomes free after the order's earlier tasks
(each ended no later, by induction) and after the tasks backfilled in front of it. Each of
those ended no later than the bound on ``t``'s input arrival (an exact bound is a real lower
bound), so they never delay ``t`` past its input. A backfilled task ``x`` itself started
while an earlier task ``p`` of the order was still waiting: ``b(x) < b(p) <= s*(p) <= s*(x)``.
Hence every task, and the step, ends no later than under the strict order.
``tests/test_scheduler_backfill.py`` checks it over random workloads.

With estimated costs (per-(stage, kind) running averages, :class:`CostAverages`) the bound
may be wrong by the estimate's error, and a backfilled task may delay its planned task by as
much.

Where it runs: :func:`rrfp.sim.engine.simulate` drives it (notices instant and complete,
averages shared by the ranks, or exact costs given), and so does the runtime
(:mod:`rrfp.runtime.features.notices`): each rank estimates from its own measured task times (the
fewest seconds seen for a notice, the most for a task it may backfill), a rank
starting a task whose output goes to another rank sends that rank a "started, estimated
seconds" control message, and the receiver turns it into an end on its own clock (receipt
time plus the seconds: the notice travels the link ahead of the output). Notices may be in
transit there (``complete_notices=False``), so without one a rank does not backfill, and with
estimated costs the guarantee above holds only up to the estimates' error.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import Callable, MutableMapping

from .tasks import F, W, PipelineSpec, Task

Estimate = Callable[[Task], "float | None"]
"""``estimate(task) -> seconds`` (None: unknown)."""


class CostAverages:
    """Per-(stage, kind) running mean of task seconds: the estimate backfilling uses when
    exact costs are unknown (calling it); also the fewest and most seconds seen
    (:meth:`low`, :meth:`high`), for bounds that must hold when costs vary."""

    __slots__ = ("_sum", "_n", "_lo", "_hi")

    def __init__(self) -> None:
        self._sum: dict[tuple[int, str], float] = {}
        self._n: dict[tuple[int, str], int] = {}
        self._lo: dict[tuple[int, str], float] = {}
        self._hi: dict[tuple[int, str], float] = {}

    def observe(self, task: Task, seconds: float) -> None:
        """One finished ``task`` took ``seconds``."""
        key = (task[0], task[1])
        self._sum[key] = self._sum.get(key, 0.0) + seconds
        n = self._n[key] = self._n.get(key, 0) + 1
        if n == 1 or seconds < self._lo[key]:
            self._lo[key] = seconds
        if n == 1 or seconds > self._hi[key]:
            self._hi[key] = seconds

    def low(self, task: Task) -> float | None:
        """The fewest seconds a task of ``task``'s (stage, kind) took (None: none seen)."""
        return self._lo.get((task[0], task[1]))

    def high(self, task: Task) -> float | None:
        """The most seconds a task of ``task``'s (stage, kind) took (None: none seen)."""
        return self._hi.get((task[0], task[1]))

    def __call__(self, task: Task) -> float | None:
        key = (task[0], task[1])
        n = self._n.get(key)
        return None if not n else self._sum[key] / n


def producer(spec: PipelineSpec, task: Task) -> Task | None:
    """The task on another stage whose output ``task`` waits for, or None (stage 0's
    forward, the last stage's backward, ``W``)."""
    return spec.producer(task)


class Backfill:
    """One rank's backfilling state for one step (the arbiter asks it; the driver feeds it).

    Args:
        spec: the pipeline's shape.
        rank: this rank's pipeline index.
        estimate: estimated seconds of any task (this rank's and its producers').
        notices: producer task -> its estimated end (seconds on the driver's clock), from
            "started" notices; the driver writes into it.
        complete_notices: True when a started task always has its notice here already (the
            simulator); False when a notice may be in transit (the runtime).
        min_delay: a lower bound on a message's delay (seconds, >= 0).

    Attributes:
        now: the driver's clock (seconds), set before each decision.
        n_backfilled: tasks run ahead of the order this step.
    """

    __slots__ = ("spec", "rank", "estimate", "notices", "complete_notices", "min_delay", "now",
                 "n_backfilled", "_rank_of")

    def __init__(self, spec: PipelineSpec, rank: int, estimate: Estimate,
                 notices: MutableMapping[Task, float], *, complete_notices: bool, min_delay: float = 0.0) -> None:
        if not min_delay >= 0:
            raise ValueError(f"min_delay={min_delay!r}: expected seconds >= 0")
        self.spec, self.rank = spec, rank
        self.estimate = estimate
        self.notices = notices
        self.complete_notices = complete_notices
        self.min_delay = min_delay
        self.now = 0.0
        self.n_backfilled = 0
        self._rank_of = spec.placement.rank_of

    def arrival_bound(self, planned: Task) -> float:
        """A lower bound on when ``planned``'s missing input arrives (seconds; ``now`` when
        nothing better is known)."""
        now = self.now
        q = producer(self.spec, planned)
        if q is None or self._rank_of(q.stage) == self.rank:
            return now
        end = self.notices.get(q)
        if end is not None:
            t = end + self.min_delay
            return t if t > now else now
        if not self.complete_notices:
            return now
        e = self.estimate(q)
        return now if e is None else now + e + self.min_delay

    def room(self, planned: Task) -> float:
        """Seconds a backfilled task may take now without delaying ``planned`` (0: none)."""
        return self.arrival_bound(planned) - self.now

    def fits(self, task: Task, room: float) -> bool:
        """Whether ``task``'s estimated cost ends within ``room`` seconds."""
        e = self.estimate(task)
        return e is not None and e <= room
