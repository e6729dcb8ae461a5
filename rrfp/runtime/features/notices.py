"""Backfilling in the runtime: "started task X, estimated end T" notices on the control plane,
and the cost averages the estimates come from (:mod:`rrfp.scheduler.backfill`, which holds
the rule and its argument; the simulator and the runtime share it).

Under a backfilling hint (``backfill``, ``backfill:<order>``) a rank keeps its own measured task
seconds per (stage, kind) (:class:`~rrfp.scheduler.backfill.CostAverages`). When it starts a
task whose output goes to a stage on another rank (``F`` to the next stage's rank; ``B`` or
``I`` to the previous stage's), it sends that rank a *started notice*: which task, and the
fewest seconds a task of its kind took here.

Why the extremes and not the means: backfilling's argument needs a *lower* bound on the planned
task's input arrival and a backfilled task that surely ends before it. Real costs vary (load,
sequence lengths, jitter); with means, a producer faster than its mean or a backfilled task
slower than its mean delays the planned task. So a notice announces the fastest seconds seen
for its (stage, kind), and a rank backfills only a task whose slowest seconds seen fit in the
window (the simulator, whose notices carry exact or mean costs, takes the means). The price is
backfilling less: on 4 real ranks of the benchmarks' jitter4 workload, 3 tasks in 52 steps
against 119 with means. It is an ordinary control message
(:meth:`~rrfp.runtime.engine.outbox.Outbox.send_control`), so it takes the transport's one wire
format, authentication and size limits: key ``(job, step, 0, 0, CTL)``, meta
``{"kind": "started", "task": [stage, kind, microbatch], "s": seconds}`` (about 110 bytes
framed, ``benchmarks/bench_notices.py``). With no estimate yet (a kind's first task) it sends
nothing.

A step feature (:func:`attach`): the rank's scheduler loop tells it when a task starts and
finishes and when the loop waits (:class:`~rrfp.runtime.engine.observer.StepObserver`, only in
backfilling steps: the others pay nothing), the inbox hands it the ``started`` control messages
(:meth:`~rrfp.runtime.engine.inbox.Inbox.on_control`), and the rank takes each backfilling
step's :class:`~rrfp.scheduler.backfill.Backfill` from it
(:attr:`~rrfp.runtime.engine.rank.RankRuntime.backfill_for`).

The receiver (:meth:`StartedNotices.receive`) keeps, per step,
``producer task -> estimated end`` on its own clock: the board its
:class:`~rrfp.scheduler.backfill.Backfill` reads with ``complete_notices=False`` (a notice may
still be in transit, so a producer without one never lets the rank backfill). A notice that a
correct pipeline cannot send (unknown or malformed task, a task whose output this rank does not
consume, a sender that does not hold the task's stage, seconds negative, not finite or above
:data:`MAX_SECONDS`, a step other than the running one or the next, a second notice for one
task) is refused and counted with the inbox's other refusals.

Pure of torch; the clock (``clock``, default ``time.monotonic``) is the rank's, and a test may
put the event loop's simulated clock in its place.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

from ...scheduler.backfill import Backfill, CostAverages
from ...scheduler.tasks import KINDS, F, PipelineSpec, Task
from ...transport.base import Message
from ..engine.observer import StepObserver

STARTED = "started"
"""The ``kind`` of a started notice's meta."""

MAX_SECONDS = 3600.0
"""The most seconds a notice may announce: a longer estimate is refused, so a corrupt or hostile
notice cannot hold a rank's backfilling window open for longer than that."""

SendFn = Callable[[int, int, dict], None]
"""``send(dst_rank, step, meta)``: a control message to another rank."""


class StartedNotices(StepObserver):
    """One rank's side of backfilling: its cost averages, the notices it sends, and the
    board of the notices it received.

    Args:
        spec: the pipeline's shape.
        rank: this rank's pipeline index.
        send: sends a control message (the outbox's ``send_control``).
        wake: wakes the rank's scheduler loop (a notice for the producer of the task the
            rank waits for may let it run a later task now); None: never woken.

    Attributes:
        averages: per-(stage, kind) mean measured seconds of this rank's tasks (persists over
            steps).
        clock: seconds, this rank's clock for notices, the averages and ``Backfill.now``.
        n_sent, n_received: notices sent and admitted so far.
    """

    def __init__(self, spec: PipelineSpec, rank: int, send: SendFn, wake: Callable[[], None] | None = None) -> None:
        self.spec, self.rank = spec, rank
        self._send = send
        self._wake = wake
        self.averages = CostAverages()
        self.clock: Callable[[], float] = time.monotonic
        self.n_sent = self.n_received = 0
        place = spec.placement
        self._rank_of = place.rank_of
        self._consumer_rank: dict[Task, int] = {}  # cache: task -> the other rank its output goes to
        self._boards: dict[int, dict[Task, float]] = {}  # step -> producer task -> estimated end
        self._started: dict[Task, float] = {}  # running task -> its start on ``clock``
        self._last_end = -math.inf
        self._busy_from: float | None = None  # start of the current stretch of work (see receive)
        self._launches = 0
        self._last: Task | None = None  # the task of the last notice admitted
        self._made: tuple[int, Backfill] | None = None  # the last Backfill made, for its step
        self._bf: Backfill | None = None  # the running backfilling step's
        self._arb = None  # and its arbiter
        self._step: int | None = None  # and its index

    # ------------------------------------------------------------ the step
    def backfill(self, step: int, spec: PipelineSpec) -> Backfill:
        """The :class:`Backfill` for ``step``'s arbiter (``spec``: the step's shape): the most
        seconds each (stage, kind) of this rank took as its estimate, the received notices of
        ``step`` as its board (earlier steps' boards are dropped)."""
        self.spec = spec
        for k in [k for k in self._boards if k < step]:
            del self._boards[k]
        bf = Backfill(self.spec, self.rank, self.averages.high, self._boards.setdefault(step, {}),
                      complete_notices=False)
        self._made = (step, bf)
        return bf

    def step_begins(self, step: int, arb) -> bool:
        """A step whose arbiter was built with :meth:`backfill`'s Backfill for it is a
        backfilling step: this feature takes its task events; any other step pays nothing."""
        made, self._made = self._made, None
        if made is None or made[0] != step:
            self._bf = self._arb = self._step = None
            return False
        self._bf, self._arb, self._step = made[1], arb, step
        return True

    def before_decision(self) -> None:
        self._bf.now = self.clock()

    def task_started(self, step: int, task: Task) -> None:
        self.started(step, task)

    def task_finished(self, step: int, task: Task, start: float, end: float) -> None:
        self.finished(task)  # on this feature's own clock (a test's simulated one)

    def step_ends(self, step: int, stats) -> None:
        if self._bf is not None:
            stats.n_backfilled = self._bf.n_backfilled
        self._bf = self._arb = self._step = None

    def started(self, step: int, task: Task) -> None:
        """This rank starts ``task`` now: time it, and send its consumer rank a notice when the
        output leaves this rank and an estimate exists."""
        now = self.clock()
        self._started[task] = now
        self._launches += 1
        if self._busy_from is None:
            self._busy_from = now
        dst = self._consumer_rank.get(task)
        if dst is None:
            dst = self._consumer_rank[task] = self._receiver(task)
        if dst < 0:
            return
        e = self.averages.low(task)
        if e is None:
            return
        self._send(dst, step, {"kind": STARTED, "task": [task[0], task[1], task[2]], "s": e})
        self.n_sent += 1

    def finished(self, task: Task) -> None:
        """``task`` finished now: its measured seconds join the averages (tasks that overlap, as
        launched ahead on a device stream, each count from the later of their start and the
        previous end)."""
        now = self.clock()
        t0 = self._started.pop(task, None)
        if t0 is not None:
            self.averages.observe(task, now - (t0 if t0 > self._last_end else self._last_end))
        self._last_end = now

    def idle(self) -> None:
        """The scheduler loop waits for an event (nothing runs): from the loop's next turns on,
        notices are read as they arrive (see :meth:`receive`)."""
        if self._busy_from is None:
            return
        gen = self._launches
        loop = asyncio.get_running_loop()
        # Two turns later: the first turn reads what arrived during the work just done (asyncio
        # runs I/O callbacks after the ready queue, uvloop before it), which still gets the
        # stretch's start as its receipt time.
        loop.call_soon(loop.call_soon, self._clear_busy, gen)

    def _clear_busy(self, gen: int) -> None:
        if self._launches == gen:  # nothing launched since the wait began
            self._busy_from = None

    # ------------------------------------------------------------ receiving
    def receive(self, msg: Message, current: int) -> str | None:
        """Admit a started notice while the rank runs (or is about to run) step ``current``;
        returns why it is refused, or None when admitted.

        The receipt time stands in for the sender's clock, which may differ from this rank's
        by seconds across hosts. The notice and the task's output travel the same link in the
        same direction, the notice first and smaller, so the notice's transit time is no
        longer than the output's (barring a burst of queueing between the two): the output
        arrives no earlier than receipt + estimated seconds, the bound backfilling needs,
        whatever the clocks' offset. The receipt time is when the transport could first have
        handed the notice over: a rank reads its socket only between tasks, so a notice read
        right after a stretch of work is stamped with that stretch's start (an early stamp
        only shortens the window: never a later bound than the truth).
        """
        meta = msg.meta
        if len(meta) != 3 or "task" not in meta or "s" not in meta:
            return "started notice: expected exactly kind, task and s"
        raw, s = meta["task"], meta["s"]
        if (type(raw) not in (list, tuple) or len(raw) != 3 or type(raw[0]) is not int
                or type(raw[2]) is not int or raw[1] not in KINDS):
            return f"started notice: task {raw!r} is not [stage, kind, microbatch]"
        stage, kind, mb = raw
        if not 0 <= stage < self.spec.n_stages or not 0 <= mb < self.spec.n_microbatches:
            return f"started notice: no task {stage}{kind}{mb} in this pipeline"
        task = Task(stage, kind, mb)
        if kind not in (F, self.spec.backward_kind) or self._receiver(task) != self.rank:
            return f"started notice for {task}, whose output rank {self.rank} does not receive"
        owner = self._rank_of(stage)
        if msg.src != owner:
            return f"started notice for {task} from rank {msg.src}, but stage {stage} belongs to rank {owner}"
        if type(s) not in (int, float) or not 0.0 <= s <= MAX_SECONDS:
            return f"started notice for {task}: {s!r} seconds, expected 0 to {MAX_SECONDS:g}"
        step = msg.key.step
        if step != current and step != current + 1:
            return f"started notice for step {step} while in step {current}"
        board = self._boards.setdefault(step, {})
        if task in board:
            return f"a second started notice for {task} in step {step}"
        now = self.clock()
        at = self._busy_from if self._busy_from is not None and self._busy_from < now else now
        board[task] = at + s
        self.n_received += 1
        self._last = task
        return None

    def on_notice(self, msg: Message, current: int) -> str | None:
        """The inbox's handler of ``started`` control messages (:meth:`receive`); wakes the
        scheduler loop when the notice admitted is for the producer of the task a running
        backfilling step waits for (the only notice that can change its next decision: a
        wake-up for any other costs a decision for nothing)."""
        problem = self.receive(msg, current)
        if problem is None and msg.key.step == self._step and self._wake is not None:
            planned = self._arb.planned()
            if planned is not None and self.spec.producer(planned) == self._last:
                self._wake()
        return problem

    def _receiver(self, task: Task) -> int:
        """The rank receiving ``task``'s output (-1: none, or the rank that runs ``task``)."""
        c = self.spec.consumer(task)
        if c is None:
            return -1
        dst = self._rank_of(c.stage)
        return -1 if dst == self._rank_of(task.stage) else dst


def attach(runtime) -> StartedNotices:
    """Backfilling's started notices on ``runtime`` (a
    :class:`~rrfp.runtime.engine.rank.RankRuntime`): admitted whatever a step's hint (a
    neighbour may already run the next step under another), sent and read only in backfilling
    steps. Registered as ``runtime.features["notices"]``.

    Raises:
        ValueError: notices already attached (the inbox has a ``started`` handler).
    """
    notices = StartedNotices(runtime.spec, runtime.rank, runtime.send_control, runtime.inbox.wake.set)
    runtime.inbox.on_control(STARTED, notices.on_notice)
    runtime.loop.add_observer(notices)
    runtime.backfill_for = notices.backfill
    runtime.features["notices"] = notices
    return notices
