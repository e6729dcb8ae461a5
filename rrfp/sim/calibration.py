"""What the runtime pays beyond each task's own cost, calibrated from recorded steps: the one
place the simulator models it (``auto``'s ranking, :mod:`rrfp.sim.auto`, and ``rrfp bench``'s
predictions, ``benchmarks/sim_pred.py``, both read a :class:`Calibration`).

A task's cost (per stage and kind, ``F``, ``B``, ``I``, ``W``: a :class:`~rrfp.sim.costs.CostModel`)
is what the task itself takes on its rank, measured in place (:func:`stage_costs`: the mean of
its recorded durations, less what the task waited for, a sleep or a device, when the caller
knows it). Measured in place, not assumed: a split backward's ``I`` and ``W`` are their own
(PyTorch's and rrfp's split run stage 0's whole backward in ``W``, its ``I`` is a no-op; ``I`` of
a small transformer stage costs most of a ``B``, not half). Around the tasks the runtime pays
(seconds; :func:`fit` reads them off recorded steps):

- ``task``: per task on its rank, the gap between a task's end and the next task's start when
  that task's input was already there (the arbiter's decision, the executor's dispatch, the
  records, the step hooks): the mean over such gaps;
- ``recv``: per task whose input came from another rank and was sent while its rank was busy,
  the mean gap before it beyond ``task``: receiving the message (the loop reads and decodes it
  between tasks) and whatever of its flight was left;
- ``hop``: per cross-rank message, from the producing task's end until the consuming task can
  start, when the consumer's rank was idle from before the producer ended (so the whole wait
  shows, whatever its length), less ``task``: the codec, the socket, waking the sender's I/O
  thread and the receiving process. The mean over such waits (a message the consumer does not
  wait for costs nothing, so the model adds it to every message and lets the schedule hide it);
- ``step``: per step, the slowest rank's step time beyond the span of all tasks (first start
  to last end): the runtime's set-up before the first task and its end after the last, and the
  ranks leaving the step's start at different moments (the median over steps);
- ``recv_in_hop``: whether ``recv`` is part of ``hop`` (``rrfp bench``'s predictions,
  ``benchmarks/sim_pred.py``): a consumer that waited for a message waited for its flight and
  then for its rank to receive it, so the recorded wait holds the receiving too. Then a message
  flies ``hop - recv`` and its receiving task spends ``recv``: a consumer that waited starts
  ``hop + task`` after the producer's end, as recorded, and one whose input came while it was
  busy ``recv + task`` after its previous task, as recorded (without it, ``hop`` flies and
  ``recv`` comes on top: a waited-for message counts its receiving twice);
- ``hop_on_rank``: a share of the hop beyond that (``hop - recv`` with ``recv_in_hop``) the
  receiving rank spends rather than waits (not read off the steps; 0 in ``rrfp bench``'s
  predictions since ``recv_in_hop``, which reads that part off the steps instead).

Ranks sharing cores: ``N`` rank processes on ``cores`` cores, beside other work. Linux shares
the cores fairly between groups of processes (autogroup, cgroups), then within a group: the
ranks, one group, get ``cores / (1 + background)`` cores however many of them are busy, where
``background`` is the machine's other load as a busy loop of the ranks' group sees it (it gets
``min(1, cores / (1 + background))`` of a core; 0 on a quiet machine). A rank busy on the CPU
shares that with the ``K`` other ranks busy at that moment, each busy with probability
``duty`` (the ranks' share of the step spent on the CPU, independently), so its CPU work
stretches by ``E[max(1, (1 + K) (1 + background) / cores)]``, ``K ~ Binomial(N - 1, duty)``
(:meth:`Calibration.stretch`). Checked by ``python -m benchmarks.bench_sim_vs_runtime --cores``
(``docs/simulator.md``: N processes at a duty, measured stretch against the model). Costs measured in place already carry the stretch of the duty
they were measured at (:attr:`Calibration.duty`); a schedule that keeps more ranks busy at once
stretches more, fewer less (:meth:`Calibration.rescale`), which :meth:`Calibration.simulate`
applies to each task's CPU part. Without ``cores`` (ranks on their own devices or cores) the
costs stand as measured.

Pure module: no torch (it drives :mod:`rrfp.sim.engine`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..scheduler.hints import Hint
from ..scheduler.tasks import B, F, I, W, PipelineSpec, Task, TaskRecord
from .costs import MAX_SECONDS, CostModel, StageCost, read_json
from .engine import DelayFn, DurationFn, SimResult, simulate
from .held import Held, held_tracker

_SECONDS = ("task", "recv", "hop", "step")


@dataclass(frozen=True)
class Calibration:
    """What the runtime pays around tasks (module docstring), and how its ranks share cores.

    Attributes:
        task: seconds per task on its rank, beside the task's own cost.
        recv: seconds more per task whose input came from another rank (receiving it).
        hop: seconds per cross-rank message, beside ``task``.
        hop_on_rank: the share (``0..1``) of ``hop`` (of ``hop - recv`` with ``recv_in_hop``)
            the receiving rank spends, not its tasks: a task whose input came from another rank
            takes that much longer, and the message flies the rest (0: all of it flies,
            overlapping the receiver's tasks; module docstring).
        recv_in_hop: ``recv`` is the receiving rank's part of ``hop`` (a message flies
            ``hop - recv``, at least 0), not a cost on top of it (module docstring).
        step: seconds per step outside tasks.
        cores: cores the ranks share (None: each rank has its own; nothing is rescaled).
        background: the machine's other load, as the ranks' group sees it: a busy loop of
            theirs gets ``cores / (1 + background)`` cores (``>= 0``; module docstring).
        duty: the ranks' CPU duty (``0..1``) when the costs were measured (None: measured
            with no other rank busy, as one rank at a time).
        source: where the figures come from (a line for reports).
        held: per rank, a task's factor by the microbatches its rank holds at its start
            (:mod:`rrfp.sim.held`; None: none). Costs then stand for a task with nothing held.

    Raises:
        ValueError: a time that is negative, not finite or above
            :data:`~rrfp.sim.costs.MAX_SECONDS`, cores below 1, a negative background, or a
            duty outside ``0..1``, or ``held`` not a :class:`~rrfp.sim.held.Held`.
    """

    task: float = 0.0
    recv: float = 0.0
    hop: float = 0.0
    step: float = 0.0
    hop_on_rank: float = 0.0
    recv_in_hop: bool = False
    cores: int | None = None
    background: float = 0.0
    duty: float | None = None
    source: str = ""
    held: Held | None = None

    def __post_init__(self) -> None:
        if self.held is not None and not isinstance(self.held, Held):
            raise ValueError(f"calibration held={self.held!r:.80}: expected per rank forward and backward factors")
        for k in _SECONDS:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_SECONDS:
                raise ValueError(f"calibration {k}={v!r}: expected seconds, 0 to {MAX_SECONDS:g}")
        if not isinstance(self.recv_in_hop, bool):
            raise ValueError(f"calibration recv_in_hop={self.recv_in_hop!r}: expected true or false")
        h = self.hop_on_rank
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h <= 1:
            raise ValueError(f"calibration hop_on_rank={h!r}: expected a share, 0 to 1")
        c = self.cores
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"calibration cores={c!r}: expected an integer >= 1, or None")
        b = self.background
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1e6:
            raise ValueError(f"calibration background={b!r}: expected a load >= 0")
        d = self.duty
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1):
            raise ValueError(f"calibration duty={d!r}: expected a share of time, 0 to 1, or None")

    # ------------------------------------------------------------ cores
    def stretch(self, n_ranks: int, duty: float) -> float:
        """The factor CPU work of one of ``n_ranks`` ranks stretches by when each rank is busy
        on the CPU ``duty`` of the time (module docstring); 1 without :attr:`cores`."""
        if self.cores is None:
            return 1.0
        u, n = min(max(duty, 0.0), 1.0), max(n_ranks - 1, 0)
        per = (1.0 + self.background) / self.cores  # stretch per busy rank of the group
        if u in (0.0, 1.0):  # K is 0, or every other rank
            return max(1.0, (1 + n * u) * per)
        return sum(math.comb(n, k) * u ** k * (1.0 - u) ** (n - k) * max(1.0, (1 + k) * per) for k in range(n + 1))

    def rescale(self, n_ranks: int, duty: float) -> float:
        """The factor on costs measured at :attr:`duty` for a run whose ranks are busy
        ``duty`` of the time: ``stretch(n_ranks, duty) / stretch(n_ranks, self.duty)``."""
        return self.stretch(n_ranks, duty) / self.stretch(n_ranks, self.duty or 0.0)

    # ------------------------------------------------------------ the model
    def on_rank(self, hop: float | None = None) -> float:
        """Seconds a task whose input came from another rank spends receiving it, beside
        :attr:`task`: :attr:`recv` and the :attr:`hop_on_rank` share of the hop that does not
        already count it (:meth:`flight`); ``hop``: that message's own hop (default :attr:`hop`)."""
        return self.recv + self.hop_on_rank * self._beyond_recv(self.hop if hop is None else hop)

    def flight(self, hop: float | None = None) -> float:
        """Seconds a cross-rank message flies beyond any injected delay, off both ranks' CPUs:
        the hop (``hop``, default :attr:`hop`) less what its receiving rank spends of it
        (:meth:`on_rank`). A consumer that waited for it starts ``flight + on_rank`` after the
        producer's end, plus :attr:`task`: the recorded wait with ``recv_in_hop``."""
        return (1.0 - self.hop_on_rank) * self._beyond_recv(self.hop if hop is None else hop)

    def _beyond_recv(self, hop: float) -> float:
        return max(0.0, hop - self.recv) if self.recv_in_hop else hop

    def simulate(self, spec: PipelineSpec, hint: Hint, duration: DurationFn, *, cpu: DurationFn | None = None,
                 delay: DelayFn | None = None, steps: int = 1, step_overhead: float = 0.0,
                 hops: Callable[[Task], float] | None = None, **kw: Any) -> SimResult:
        """:func:`~rrfp.sim.engine.simulate` with what the runtime pays: each task's
        ``duration`` plus :attr:`task` (and :meth:`on_rank` when its input comes from another
        rank), each cross-rank message's ``delay`` plus :meth:`flight`,
        each step :attr:`step` more (between steps, and after the last), and with
        :attr:`cores`, each task's CPU part (``cpu(step, rank, task)`` seconds of its
        duration, default all of it, plus :attr:`task` and :meth:`on_rank`) rescaled to the
        run's own duty: a first run measures the duty (the ranks' CPU seconds over their number
        times the makespan), the second runs at it. With :attr:`held`, each task's CPU part
        first times its factor at what its rank holds as it starts (:mod:`rrfp.sim.held`).

        Args:
            duration, delay: as :func:`~rrfp.sim.engine.simulate` (delay None: none).
            cpu: the CPU part of a task's duration (the rest it waits for: a sleep, a device).
            hops: ``hops(task)``, the own hop (seconds) of the message ``task`` sends, in place
                of :attr:`hop` (a recorded step's, :attr:`Fit.hops`); None: :attr:`hop` for all.
            kw: any other argument of :func:`~rrfp.sim.engine.simulate`.

        Raises:
            as :func:`~rrfp.sim.engine.simulate`.
        """
        if self.held is not None:  # each task's CPU part by what its rank holds as it starts
            g = held_tracker(self.held)
            plain, plain_cpu = duration, cpu
            if plain_cpu is None:
                duration = lambda k, r, t: plain(k, r, t) * g(k, r, t)  # noqa: E731
            else:
                duration = lambda k, r, t: plain(k, r, t) + (g(k, r, t) - 1.0) * plain_cpu(k, r, t)  # noqa: E731
                cpu = lambda k, r, t: plain_cpu(k, r, t) * g(k, r, t)  # noqa: E731
        task = self.task
        remote = remote_inputs(spec)
        if hops is None:
            on, fly = self.on_rank(), self.flight()
            extra_on = (lambda t: on if (t[0], t[1]) in remote else 0.0) if on and remote else None  # noqa: E731
            wire_of = (lambda t: fly) if fly else None  # noqa: E731
        else:
            extra_on = lambda t: self.on_rank(hops(spec.producer(t))) if (t[0], t[1]) in remote else 0.0  # noqa: E731
            wire_of = lambda t: self.flight(hops(t))  # noqa: E731
        if extra_on is not None:
            own = duration
            duration = lambda k, r, t: own(k, r, t) + extra_on(t)  # noqa: E731
            if cpu is not None:
                own_cpu = cpu
                cpu = lambda k, r, t: own_cpu(k, r, t) + extra_on(t)  # noqa: E731
        if wire_of is None:
            wire = delay
        elif delay is None:
            wire = lambda step, src, dst, t: wire_of(t)  # noqa: E731
        else:
            wire = lambda step, src, dst, t: delay(step, src, dst, t) + wire_of(t)  # noqa: E731
        extra = {} if wire is None else {"delay": wire}
        between = step_overhead + self.step
        run = lambda d: simulate(spec, hint, d, steps=steps, step_overhead=between, **extra, **kw)  # noqa: E731
        if self.cores is None:
            res = run((lambda k, r, t: duration(k, r, t) + task) if task else duration)
        else:
            part = cpu or duration
            spent = [0.0]

            def counted(k: int, r: int, t: Task) -> float:
                spent[0] += part(k, r, t) + task
                return duration(k, r, t) + task

            first = run(counted)
            n = spec.placement.n_ranks
            duty = spent[0] / (n * first.makespan) if first.makespan > 0 else 0.0
            f = self.rescale(n, duty)
            res = run(lambda k, r, t: duration(k, r, t) + task + (f - 1.0) * (part(k, r, t) + task))
        if not self.step:
            return res
        return dataclasses.replace(res, makespan=res.makespan + self.step,
                                   step_end=[t + self.step for t in res.step_end])

    # ------------------------------------------------------------ files
    def to_mapping(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (None fields left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != ""}

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], source: str = "calibration") -> "Calibration":
        """Build from :meth:`to_mapping`'s dict.

        Raises:
            ValueError: an unknown field or a bad value, naming ``source``.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected an object of {', '.join(sorted(names))}")
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"{source}: unknown field {bad[0]!r}: expected {', '.join(sorted(names))}")
        try:
            if d.get("held") is not None:
                d = {**d, "held": Held.from_mapping(d["held"], "held")}
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read a JSON file of :meth:`to_mapping`'s form.

        Raises:
            OSError: unreadable; ValueError: not JSON, or a bad field (naming the file).
        """
        return cls.from_mapping(read_json(path), str(path))

    def describe(self) -> str:
        """One line: the figures in milliseconds."""
        cores = "" if self.cores is None else (f", {self.cores} cores, background {self.background:.1f}"
                                               f"{'' if self.duty is None else f', measured at duty {self.duty:.2f}'}")
        on = f" ({self.hop_on_rank:.0%} of it on the receiving rank)" if self.hop_on_rank else ""
        on += " (recv of it on the receiving rank)" if self.recv_in_hop else ""
        held = ""
        if self.held is not None:
            top = [max(fs) for fs in (*self.held.forward, *self.held.backward)]
            held = f", held activations slow a task by up to {max(top):.2f}x"
        return (f"task {1e3 * self.task:.3f} ms, recv {1e3 * self.recv:.3f} ms, hop {1e3 * self.hop:.3f} ms{on}, "
                f"step {1e3 * self.step:.2f} ms{cores}{held}")


def remote_inputs(spec: PipelineSpec) -> set[tuple[int, str]]:
    """``(stage, kind)`` of the tasks whose input comes from another rank (a message)."""
    rank_of = spec.placement.rank_of
    out = set()
    for t in spec.all_tasks():
        src = spec.producer(t)
        if src is not None and rank_of(src.stage) != rank_of(t.stage):
            out.add((t.stage, t.kind))
    return out


# ------------------------------------------------------------------ from recorded steps


@dataclass(frozen=True)
class RankStep:
    """One rank's step as recorded: its tasks (the records' clock, seconds: ranks of one host
    share a monotonic clock), and when known, when the step began and returned on that rank."""

    rank: int
    records: Sequence[TaskRecord]
    begin: float | None = None
    end: float | None = None


@dataclass
class Fit:
    """What :func:`fit` read off the steps: the calibration, per link (stage ``s`` to its
    next) the mean hop, how many samples each figure had, and per message its consumer waited
    for, keyed ``(sending stage, microbatch, "F" or "B")``, its own hop (seconds beyond
    ``task``; of the last step that had it)."""

    calibration: Calibration
    links: dict[int, float]
    samples: dict[str, int]
    hops: dict[tuple[int, int, str], float] = dataclasses.field(default_factory=dict)


def fit(steps: Sequence[Sequence[RankStep]], spec: PipelineSpec, delay: DelayFn | None = None,
        **fields: Any) -> Fit:
    """:attr:`Calibration.task`, :attr:`~Calibration.hop` and :attr:`~Calibration.step` from
    recorded steps (the module docstring's rules): ``steps``, per step every rank's
    :class:`RankStep`. A gap between two tasks of a rank counts towards ``task`` when the next
    one's input is its own rank's (or none), towards ``recv`` when it came from another rank
    whose producer ended before the previous task did, and the time from the producer's end to
    the next task's start towards ``hop`` when the producer ended after it (the rank was idle,
    waiting). ``delay(step, src, dst, task)``: what a message was held beyond the runtime's
    own time (an injected delay, seconds; None: nothing): its input arrived that much after
    the producer ended, so that arrival, not the producer's end, decides the gap's kind and
    starts its wait (a simulation adds the same delay to :attr:`~Calibration.hop`).
    ``step`` needs every rank's ``begin`` and ``end`` (else it is 0). ``fields``: the
    calibration's other fields (``cores``, ...).

    Raises:
        ValueError: no gap to read ``task`` from (a figure without a sample is 0).
    """
    gaps: list[float] = []
    received: list[float] = []
    waits: dict[int, list[float]] = {}
    waited: dict[tuple[int, int, str], float] = {}
    outside: list[float] = []
    for ranks in steps:
        ended = {r.task: (r.rank, r.end, r.step) for rs in ranks for r in rs.records}
        recs_all = [r for rs in ranks for r in rs.records]
        timed = [rs for rs in ranks if rs.records and rs.begin is not None and rs.end is not None]
        if timed and len(timed) == len(ranks):
            span = max(r.end for r in recs_all) - min(r.start for r in recs_all)
            outside.append(max(rs.end - rs.begin for rs in timed) - span)
        for rs in ranks:
            recs = sorted(rs.records, key=lambda r: r.start)
            src = spec.producer(recs[0].task) if recs else None
            made = ended.get(src) if src is not None else None
            if made is not None and made[0] != rs.rank:  # the rank's first task waited for its input
                arrived = made[1] + (delay(made[2], made[0], rs.rank, src) if delay else 0.0)
                waited[(src.stage, src.mb, "F" if src.kind == F else "B")] = recs[0].start - arrived
            for prev, nxt in zip(recs, recs[1:]):
                src = spec.producer(nxt.task)
                made = ended.get(src) if src is not None else None
                if made is None or made[0] == rs.rank:
                    gaps.append(nxt.start - prev.end)
                    continue
                arrived = made[1] + (delay(made[2], made[0], rs.rank, src) if delay else 0.0)
                if arrived < prev.end:
                    received.append(nxt.start - prev.end)
                else:
                    link = min(src.stage, nxt.task.stage)
                    waits.setdefault(link, []).append(nxt.start - arrived)
                    waited[(src.stage, src.mb, "F" if src.kind == F else "B")] = nxt.start - arrived
    if not gaps:
        raise ValueError("calibration: no gap between two tasks whose input was there: record more tasks")
    task = max(0.0, statistics.fmean(gaps))
    recv = max(0.0, statistics.fmean(received) - task) if received else 0.0
    every = [w for ws in waits.values() for w in ws]
    hop = max(0.0, statistics.fmean(every) - task) if every else 0.0
    links = {s: max(0.0, statistics.fmean(ws) - task) for s, ws in sorted(waits.items())}
    step = max(0.0, statistics.median(outside)) if outside else 0.0
    cal = Calibration(task=task, recv=recv, hop=hop, step=step, **fields)
    return Fit(cal, links, {"task": len(gaps), "recv": len(received), "hop": len(every), "step": len(outside)},
               {k: max(0.0, w - task) for k, w in waited.items()})


WaitFn = Callable[[int, int, Task], float]  # (step, rank, task) -> seconds the task waited (not CPU)


def stage_costs(records: Sequence[TaskRecord], n_stages: int, wait: WaitFn | None = None,
                act_bytes: Sequence[int] | None = None) -> CostModel:
    """Per stage, the mean recorded seconds of each kind less what each task waited for
    (``wait(step, rank, task)``, e.g. an injected sleep; None: nothing): the task's own cost
    in place. A kind never recorded is derived (:meth:`StageCost.from_mapping`: ``B = I + W``,
    ``I = W = B / 2``).

    Raises:
        ValueError: a stage without a forward or a backward record.
    """
    samples: dict[tuple[int, str], list[float]] = {}
    for r in records:
        t = r.task
        samples.setdefault((t.stage, t.kind), []).append(r.end - r.start - (wait(r.step, r.rank, t) if wait else 0.0))
    stages = []
    for s in range(n_stages):
        m = {k: max(0.0, statistics.fmean(samples[(s, k)])) for k in (F, B, I, W) if samples.get((s, k))}
        if F not in m or not (B in m or (I in m and W in m)):
            raise ValueError(f"calibration: stage {s} has no forward or no backward record (have {sorted(m)})")
        if act_bytes is not None:
            m["act_bytes"] = int(act_bytes[s])
        stages.append(StageCost.from_mapping(m, f"stage {s}"))
    return CostModel(tuple(stages))


def step_factors(records: Sequence[TaskRecord], costs: CostModel, wait: WaitFn | None = None,
                 ) -> list[dict[tuple[int, int, str], float]]:
    """Per recorded step (in step order), how much each task's own cost (its duration less
    ``wait``, as :func:`stage_costs`) stood from the mean ``costs``: per ``(stage, microbatch,
    direction)``, ``F`` the forward's own seconds over the stage's mean forward, ``B`` the
    backward's (``B``, or ``I`` plus ``W``: whichever kinds ran) over the mean of the same kinds
    (1 where that mean is 0). A simulation that runs one step on each step's factors (each
    task's mean cost times its factor) replays the recorded durations, task for task, and
    carries their spread, and how they moved together in a step, to any other schedule of the
    same tasks: its makespans' spread, not the makespan of the means (a step's slowest path is
    longer than the mean's, ``E[max] >= max E``).

    Raises:
        ValueError: a record of a stage ``costs`` has not.
    """
    own: dict[int, dict[tuple[int, int, str], list[float]]] = {}
    for r in records:
        t = r.task
        if t.stage >= costs.n_stages:
            raise ValueError(f"calibration: a record of stage {t.stage}, the costs have {costs.n_stages} stages")
        mean = costs.stages[t.stage].cost(t.kind)
        d = "F" if t.kind == F else "B"
        acc = own.setdefault(r.step, {}).setdefault((t.stage, t.mb, d), [0.0, 0.0])
        acc[0] += max(0.0, r.end - r.start - (wait(r.step, r.rank, t) if wait else 0.0))
        acc[1] += mean
    return [{k: (a / m if m > 0 else 1.0) for k, (a, m) in own[sid].items()} for sid in sorted(own)]


def busy_share(records: Sequence[TaskRecord], n_ranks: int, cpu: WaitFn | None = None) -> float:
    """The ranks' CPU duty over recorded steps: their CPU seconds (``cpu(step, rank, task)``,
    default each task's whole duration) over ``n_ranks`` times the summed step spans (first
    start to last end, per step). For :attr:`Calibration.duty`."""
    spans: dict[int, list[float]] = {}
    total = 0.0
    for r in records:
        span = spans.setdefault(r.step, [math.inf, -math.inf])
        span[0], span[1] = min(span[0], r.start), max(span[1], r.end)
        total += cpu(r.step, r.rank, r.task) if cpu else r.end - r.start
    wall = sum(b - a for a, b in spans.values())
    return min(1.0, total / (n_ranks * wall)) if wall > 0 else 0.0
