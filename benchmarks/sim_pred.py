"""The simulator's prediction of a benchmark row: the same arbiter (``rrfp.sim.engine``) on the
row's placement, hint, in-flight limit and memory budget, with each task's duration its stage's
cost plus *the very delays the real run injected* (the keyed draws of
:class:`benchmarks.harness.Injector` and :class:`benchmarks.workloads.MessageDelays`, same seed,
step ids, stages and microbatches), one step per round.

Two models of a task's cost:

- calibrated (``model``, a :class:`RuntimeModel`, :func:`fit_model`): each task's own cost
  measured in place on the setting's recorded rows (its recorded duration less the sleeps the
  harness injected into it), and what the runtime pays around tasks and how its ranks share
  cores (:class:`rrfp.sim.calibration.Calibration`, the model ``auto`` ranks with too);
- uncalibrated (no ``model``): the rank's calibrated compute (one rank at a time), no runtime
  overhead, no message time beyond the injected delays, one processor per rank.

Either way a split backward runs as the real runtime runs it: on stage 0 (no input gradient)
``I`` is a no-op and ``W`` the whole backward with all of its injected delay and sleep
(rrfp's and PyTorch's split); on the other stages ``I`` and ``W`` carry their share of the
injected delay and sleep (:attr:`benchmarks.harness.Injector.w_share`), as the harness sleeps
them, and their own measured costs (uncalibrated: half of the backward's compute each).

Costs per stage: with one stage per rank, the rank's; with two virtual stages, calibrated: each
virtual stage's own, read off the strict rows of the same placement (:data:`PLACEMENT_ROWS`; a
1-layer stage keeps the fixed costs of a task, so it costs more than half of its rank's 2-layer
one), uncalibrated or where the placement's strict rows were not recorded: half of the rank's
each (the layers split evenly). The injected delay of a virtual stage is half of the rank's, as
the harness injects it. The jitter's ``e`` is the stage's mean of forward and backward, as the
harness's.

Calibrated, a round's prediction is the simulation on the model rows' recorded step of that
round (the rows run alternated, round by round: the same injected delays, the same state of the
machine; the median over the model's rows where two ran it), else the median over one
simulation per recorded step: each task's mean cost times its factor in that step, each message
its consumer waited for at its own hop in that step (:attr:`RuntimeModel.factors`,
:attr:`RuntimeModel.hops`): the spread of the recorded steps, and how their tasks and messages
moved together, carried to the row's schedule (a step's slowest path is longer than the means'
one). Check a model against
a recorded run offline: ``python -m benchmarks.report_fit --from-json results.json``.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.schedules import one_f_one_b_limits
from rrfp.scheduler.tasks import B, F, I, W, Placement, PipelineSpec, Task, TaskRecord
from rrfp.sim.calibration import Calibration, RankStep, busy_share, fit, remote_inputs, stage_costs, step_factors
from rrfp.sim.held import read_held, record_factors, without_held
from rrfp.sim.engine import simulate
from rrfp.sim.jitter import LEVELS, STREAM_COMM_HIT, STREAM_COMM_SIZE, injected_delay


def timed_step_ids(phase_index: int, phase: dict) -> list[int]:
    """The step ids of a phase's timed rounds (as :mod:`benchmarks.compare` numbers them);
    ``phase`` is the phase's configuration or its result (with its round records)."""
    rounds = phase["rounds"]
    if isinstance(rounds, int):
        return [1000 * phase_index + k for k in range(2, 2 + rounds)]
    return [1000 * phase_index + r["round"] for r in rounds if r["kind"] == "timed"]


@dataclass
class RuntimeModel:
    """The calibrated model of a setting's rrfp rows on one placement (:func:`fit_model`).

    Attributes:
        calibration: what the runtime pays around tasks, how its ranks share cores.
        costs: per stage of the placement it was read from (with one stage per rank, per
            rank), the task's own seconds by kind (``F``, ``B``, ``I``, ``W``), less what the
            harness slept in it.
        source: which rows and rounds it was read from.
        n_virtual, placement: the placement it was read from (virtual stages per rank, and
            ``"loop"`` or ``"v"``).
        factors: per recorded step, each task's own cost over its mean
            (:func:`rrfp.sim.calibration.step_factors`): a prediction runs one simulation per
            recorded step and takes the median makespan (empty: one on the means).
        hops: per recorded step (as ``factors``), the own hop of each message its consumer
            waited for (:attr:`rrfp.sim.calibration.Fit.hops`), in place of
            :attr:`Calibration.hop` in that step's simulation (empty: the mean everywhere).
        draw_steps: the step id of each of ``factors`` (as ``factors``): a round whose step
            the model's rows recorded runs on those steps' draws only (:func:`predict`).
        duties: with :attr:`Calibration.cores`, per recorded step (as ``factors``) the duty its
            costs were measured at, in place of :attr:`Calibration.duty` in that step's
            simulation (its own schedule is rescaled by 1).
    """

    calibration: Calibration
    costs: list[dict[str, float]]
    source: str = ""
    n_virtual: int = 1
    placement: str = "loop"
    factors: list[dict[tuple[int, int, str], float]] = dataclasses.field(default_factory=list)
    hops: list[dict[tuple[int, int, str], float]] = dataclasses.field(default_factory=list)
    draw_steps: list[int] = dataclasses.field(default_factory=list)
    duties: list[float] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        """The figures for the report (the per-step factors as their count)."""
        return {"calibration": self.calibration.to_mapping(), "costs": self.costs, "source": self.source,
                "n_virtual": self.n_virtual, "placement": self.placement, "draws": len(self.factors)}

    @classmethod
    def from_json(cls, d: dict) -> "RuntimeModel":
        return cls(Calibration.from_mapping(d["calibration"]), [dict(c) for c in d["costs"]], d.get("source", ""),
                   int(d.get("n_virtual", 1)), d.get("placement", "loop"))

    def fits(self, n_virtual: int, placement: str) -> bool:
        """Whether it was read off rows of this placement (else a prediction halves a rank's
        cost per virtual stage)."""
        return self.n_virtual == n_virtual and (n_virtual == 1 or self.placement == placement)


def harness_sleep(cfg: dict, calibration: Sequence[dict], phase: dict, n_virtual: int = 1,
                  placement: str = "loop") -> Callable[[int, int, Task], float]:
    """``sleep(step_id, rank, task)``: the seconds the harness sleeps in ``task`` of step
    ``step_id`` (the setting's sleep and the injected delay, :class:`benchmarks.harness.Injector`'s
    draws), shared between a split backward's ``I`` and ``W`` as it sleeps them (module
    docstring): what a task waits for, not CPU."""
    from .harness import Injector

    P, seed = cfg["n_ranks"], cfg["seed"]
    level = LEVELS[phase["level"]]
    base = cfg.get("sleep") or {"F": 0.0, "B": 0.0}
    share = 1.0 / n_virtual
    inj = [Injector(level, seed, r, dict(cfg["sleep"]) if cfg.get("sleep") else c, base=cfg.get("sleep"))
           for r, c in enumerate(calibration)]
    rank_of = Placement(P, n_virtual, placement).rank_of

    def sleep(sid: int, rank: int, t: Task) -> float:
        kind = F if t.kind == F else B
        d = (injected_delay(level, seed, sid, rank_of(t.stage), t.mb, kind, inj[rank].e_stage) + base[kind]) * share
        if t.kind == W:
            return d if t.stage == 0 else d * inj[rank].w_share
        if t.kind == I:
            return 0.0 if t.stage == 0 else d * (1.0 - inj[rank].w_share)
        return d

    return sleep


def message_delay(cfg: dict) -> Callable[[int, int, int, Task], float] | None:
    """``delay(step_id, src, dst, task)``: the seconds the harness holds the message ``task``
    sends (:class:`benchmarks.workloads.MessageDelays`' keyed draw of the setting's ``comm``
    level, by sending stage, microbatch and direction); None in a setting without message
    delays."""
    if not cfg.get("comm"):
        return None
    comm, seed = LEVELS[cfg["comm"]], cfg["seed"]

    def delay(sid: int, src: int, dst: int, t: Task) -> float:
        return injected_delay(comm, seed, sid, t.stage, t.mb, F if t.kind == F else B, 0.0,
                              streams=(STREAM_COMM_HIT, STREAM_COMM_SIZE))

    return delay


def compute_cost(calibration: Sequence[dict], n_virtual: int = 1) -> Callable[[int, Task], float]:
    """``cost(rank, task)``, uncalibrated: the rank's calibrated compute (its share per virtual
    stage); a split backward's ``I`` and ``W`` half of ``B`` each, but on stage 0 ``I`` nothing
    and ``W`` all of it (the runtime's split there)."""
    share = 1.0 / n_virtual

    def cost(rank: int, t: Task) -> float:
        if t.kind == F:
            return calibration[rank][F] * share
        b = calibration[rank][B] * share
        if t.kind == B:
            return b
        if t.stage == 0:
            return b if t.kind == W else 0.0
        return b / 2

    return cost


def predict(cfg: dict, calibration: Sequence[dict], phase_index: int, phase: dict, hint: str, *,
            n_virtual: int = 1, placement: str = "loop", limit: int | str = 32,
            budgets: Sequence[int] | None = None, stage_bytes: Sequence[Sequence[int]] | None = None,
            model: RuntimeModel | None = None) -> list[float]:
    """Simulated step time (seconds) of each timed round of ``phase`` for one benchmark row.

    Args:
        cfg: the setting's configuration (``n_ranks``, ``n_microbatches``, ``seed``, ``comm``,
            ``sleep``).
        calibration: per rank, ``{"F": s, "B": s}``, the calibrated base compute.
        phase_index, phase: which phase (its jitter level and rounds).
        hint: the row's hint text (``strict-...`` for a fixed order; ``torch-order:<class>``).
        limit: in-flight limit, or ``"1f1b"`` (1F1B's ``p - r`` per rank).
        budgets: per rank, ``memory_budget`` in bytes, or None.
        stage_bytes: per rank, the saved bytes of one microbatch on each of its stages (in
            virtual-stage order); needed with ``budgets``.
        model: the calibrated model (:func:`fit_model`); None: uncalibrated (module docstring).

    Raises:
        ValueError: a hint that does not fit the placement (from the scheduler).
    """
    return [span for span, _ in _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement,
                                        limit, budgets, stage_bytes, None, model)]


def predict_bounded(cfg: dict, calibration: Sequence[dict], phase_index: int, phase: dict, hint: str, *,
                    bound_budgets: Sequence[int], stage_bytes: Sequence[Sequence[int]], n_virtual: int = 1,
                    placement: str = "loop", limit: int | str = 32,
                    budgets: Sequence[int] | None = None, model: RuntimeModel | None = None,
                    ) -> tuple[list[float], list[float]]:
    """:func:`predict`'s step times, and per round the memory-aware lower bound (seconds) on any
    schedule of the same tasks that keeps each rank within ``bound_budgets`` bytes: the larger of
    :func:`rrfp.sim.metrics.lower_bound` and :func:`rrfp.sim.metrics.memory_bound` over that
    round's task durations (the suite's memory-aware ceiling, :mod:`rrfp.sim.suite`).

    Raises:
        ValueError: a hint that does not fit the placement (from the scheduler).
    """
    steps, bounds = [], []
    for span, bound in _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement, limit, budgets,
                               stage_bytes, bound_budgets, model):
        steps.append(span)
        bounds.append(bound)
    return steps, bounds


def _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement, limit, budgets, stage_bytes,
            bound_budgets, model=None):
    """Per timed round: (the simulated step time: the median over the model's recorded steps'
    factors, or the one on the means; its memory-aware bound at ``bound_budgets`` on the means,
    or None without them)."""
    from rrfp.sim.metrics import lower_bound, memory_bound

    from .systems import torch_order_hint

    P, M = cfg["n_ranks"], cfg["n_microbatches"]
    place = Placement(P, n_virtual, placement)
    limits = one_f_one_b_limits(P) if limit == "1f1b" else [int(limit)] * P
    spec, h, strict = resolve_hint(torch_order_hint(hint, P, M), place, M, inflight_limit=limits)
    sleep = harness_sleep(cfg, calibration, phase, n_virtual, placement)
    draws: list = [None]
    pairs: list = []
    if model is None:
        cost = compute_cost(calibration, n_virtual)
    elif model.fits(n_virtual, placement):  # costs per stage, read off this placement's rows
        cost = lambda rank, t: model.costs[t.stage][t.kind]  # noqa: E731
        n = len(model.factors)
        draws = list(zip(model.factors, model.hops or [{}] * n, model.duties or [None] * n)) or draws
        pairs = list(zip(model.draw_steps, draws)) if model.draw_steps else []
    else:  # read off one stage per rank: a virtual stage is its share of the rank's layers
        share = 1.0 / n_virtual
        cost = lambda rank, t: model.costs[rank][t.kind] * share  # noqa: E731
    act = None
    if stage_bytes is not None:
        pos = {s: (place.rank_of(s), i) for r in range(P) for i, s in enumerate(place.stages_of(r))}
        act = lambda step, stage, mb: int(stage_bytes[pos[stage][0]][pos[stage][1]])  # noqa: E731

    held = message_delay(cfg)
    # Without injected jitter or message delays every round simulates the same: once.
    same = LEVELS[phase["level"]].p <= 0 and (not cfg.get("comm") or LEVELS[cfg["comm"]].p <= 0)
    first = None
    for step_id in timed_step_ids(phase_index, phase):
        if same and first is not None and not pairs:
            yield first
            continue

        def delay(step: int, src: int, dst: int, t, sid=step_id) -> float:
            return 0.0 if held is None else held(sid, src, dst, t)

        def run(own, record=False, sid=step_id, hops=None, duty=None):
            duration = lambda step, rank, t: sleep(sid, rank, t) + own(rank, t)  # noqa: E731
            kw = dict(strict=strict, inflight_limit=limits, delay=delay, record=record,
                      memory_budget=list(budgets) if budgets is not None else None,
                      act_bytes=act if budgets is not None else None)
            if model is None:
                return simulate(spec, h, duration, **kw)
            if hops:  # each message its consumer waited for in that step: its own hop
                mean = model.calibration.hop
                kw["hops"] = lambda t: hops.get((t.stage, t.mb, F if t.kind == F else B), mean)  # noqa: E731
            c = model.calibration if duty is None else dataclasses.replace(model.calibration, duty=duty)
            return c.simulate(spec, h, duration, cpu=lambda k, r, t: own(r, t), **kw)

        spans = []
        # The model's rows ran in the same rounds, alternated with this one: the round's own
        # recorded steps' draws where it has them (the round's machine, its injected delays).
        paired = [d for k, d in pairs if k == step_id]
        for draw in (paired or draws):
            if draw is None:
                spans.append(run(cost).makespan)
                continue
            fac, hops, duty = draw
            own = lambda rank, t, fac=fac: cost(rank, t) * fac.get((t.stage, t.mb, F if t.kind == F else B), 1.0)  # noqa: E731
            spans.append(run(own, hops=hops, duty=duty).makespan)
        bound = None
        if bound_budgets is not None:
            res = run(cost, record=True)
            bound = max(lower_bound(spec, res.records, delay=delay),
                        memory_bound(spec, res.records, list(bound_budgets), act, delay=delay))
        first = (statistics.median(spans), bound)
        yield first


def machine_background(seconds: float = 0.5) -> tuple[int, float]:
    """``(cores, background)``: this process's cores and the machine's other load as this
    process's group sees it, read off the CPU share a busy loop of ``seconds`` got: a fair
    scheduler gives it ``cores / (1 + background)`` of a core when that is below one (0 when it
    got a whole core): :attr:`rrfp.sim.calibration.Calibration.background`. Rank processes
    started from this one share its group."""
    import os
    import time

    cores = len(os.sched_getaffinity(0))
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        pass
    share = (time.thread_time() - c0) / (time.perf_counter() - t0)
    return cores, (max(0.0, cores / max(share, 1e-3) - 1.0) if share < 0.98 else 0.0)


RECV_IN_HOP = True
"""In ``rrfp bench``'s calibrated model, a message's hop holds its receiving
(:attr:`Calibration.recv_in_hop`): a waited-for message flies ``hop - recv`` and its receiving
task spends ``recv``, both read off the strict rows' own gaps. It replaces a hand-chosen share
of the hop on the receiving rank (0.5, ``HOP_ON_RANK`` before), which added ``recv`` to every
waited-for message's recorded wait a second time: the strict 1F1B row, predicted on its own
records, came out 9% slow at J0 (``jitter4``, ``multimodal4``), a median 0.4-1.2% off with it
(docs/simulator.md)."""

PROFILE_ROWS = ("rrfp strict-1f1b", "rrfp strict-split")
"""The rows a setting's calibrated model is read from when they ran (:func:`fit_model`): the
strict schedule (``F``, ``B``) and its split (``I``, ``W``), as ``auto`` measures a job."""

PLACEMENT_ROWS = {
    (1, "loop"): PROFILE_ROWS,
    (2, "loop"): ("rrfp strict Int1F1B order", "rrfp strict IntZB order"),
    (2, "v"): ("rrfp strict ZBV order", "rrfp strict DualPipeV order"),
}
"""Per placement (virtual stages per rank, ``"loop"`` or ``"v"``), the strict rows its model is
read from (:func:`fit_model`): a virtual stage's own cost is measured on that placement, not
taken as half of its rank's (the fixed costs of a task, autograd's set-up, the stage wrapper,
the outputs' encoding, do not halve with its layers)."""


def held_applies(cores: int | None, n_ranks: int) -> bool:
    """Whether :func:`fit_model` reads held-activation factors for ranks on ``cores`` cores
    (None: each its own): only where each rank has a core; where ranks share cores, what a rank
    holds moves with how many ranks are busy, which :attr:`Calibration.cores` models instead."""
    return cores is None or cores >= n_ranks


def _task_records(rs: dict, sid: int) -> list[TaskRecord]:
    """One rank's recorded step (``{"rank", "tasks": [[stage, kind, mb, start, end], ...]}``)
    as task records of step ``sid``."""
    return [TaskRecord(rs["rank"], sid, Task(int(a), str(k), int(m)), t0, t1) for a, k, m, t0, t1 in rs["tasks"]]


def ran_split(steps: dict) -> bool:
    """Whether a row's recorded steps (step id -> per rank records) ran a split backward."""
    return any(t[1] in (I, W) for ranks in steps.values() for rs in ranks for t in rs["tasks"])


def fit_model(cfg: dict, calibration: Sequence[dict], phase_index: int, phase: dict, recorded: dict,
              rows: Sequence[str] | None = None, cores: int | None = None, background: float = 0.0,
              n_virtual: int = 1, placement: str = "loop", draws: bool = True,
              hop_on_rank: float = 0.0, backward: str | None = None,
              recv_in_hop: bool = RECV_IN_HOP, held_without: Sequence[str] | None = None) -> RuntimeModel:
    """The calibrated model of a setting's phase on one placement, read off the recorded steps
    of ``rows`` (those that ran; default the placement's :data:`PLACEMENT_ROWS`): each task's own
    cost per stage (its recorded duration less what the harness slept in it,
    :func:`harness_sleep`; a kind no row ran is derived, ``I = W = B / 2``, stage 0's ``I``
    none), the runtime's time per task, per message (beyond the message delays the harness
    injected, :func:`message_delay`) and per step (:func:`rrfp.sim.calibration.fit`), with
    ``draws`` each recorded step's factors (:func:`rrfp.sim.calibration.step_factors`), and,
    with ``cores``, the duty the costs were measured at.

    Args:
        recorded: row -> step id -> per rank ``{"rank", "t0", "t1", "tasks": [[stage, kind, mb,
            start, end], ...]}`` (:mod:`benchmarks.compare`
            with ``record_tasks``, ``benchmarks/bench_sim_vs_runtime.py``).
        cores, background: the machine's cores and its other load as the ranks see it
            (:class:`~rrfp.sim.calibration.Calibration`).
        n_virtual, placement: the placement of ``rows``.
        draws: keep each recorded step's factors and hops (:class:`RuntimeModel`).
        hop_on_rank, recv_in_hop: :attr:`~rrfp.sim.calibration.Calibration.hop_on_rank`,
            :attr:`~rrfp.sim.calibration.Calibration.recv_in_hop` (:data:`RECV_IN_HOP`).
        backward: ``"full"`` or ``"split"``: only the rows that ran that backward form (a split
            backward routes the layers' forwards through the deferring function, so its ``F``
            costs more than a full backward's: :func:`rrfp.runtime.engine.split.enable_split_backward`);
            None: every row.
        held_without: read how held activations slow each rank's tasks off every recorded row but
            these (:func:`rrfp.sim.held.read_held`: a prediction of a row reads the other rows'),
            and measure the costs as with nothing held (:func:`rrfp.sim.held.without_held`);
            None: no such factor (a strict row holds what it holds).

    Raises:
        ValueError: none of ``rows`` was recorded in the phase's timed rounds, or a figure
            without a sample.
    """
    P, M = cfg["n_ranks"], cfg["n_microbatches"]
    if rows is None:
        rows = PLACEMENT_ROWS.get((n_virtual, placement if n_virtual > 1 else "loop"), ())
    place = Placement(P, n_virtual, placement)
    sleep = harness_sleep(cfg, calibration, phase, n_virtual, placement)
    ids = set(timed_step_ids(phase_index, phase))
    used = [r for r in rows if r in recorded and ids & {int(k) for k in recorded[r]}]
    if backward is not None:
        used = [r for r in used if ran_split(recorded[r]) == (backward == "split")]
    if not used:
        raise ValueError(f"no recorded step of {', '.join(rows) or 'a strict row'} in phase "
                         f"{phase.get('name', phase_index)}")
    records: list[TaskRecord] = []
    steps = []
    for n, row in enumerate(used):
        spec = PipelineSpec(place, M, ran_split(recorded[row]))
        for sid, ranks in sorted(recorded[row].items(), key=lambda kv: int(kv[0])):
            if int(sid) not in ids:
                continue
            step = []
            for rs in ranks:
                # The rows' steps apart (a row's own step ids: n * 10**6 on), the records per step.
                recs = _task_records(rs, int(sid))
                records += [dataclasses.replace(r, step=r.step + n * 10**6) for r in recs]
                step.append(RankStep(rs["rank"], recs, rs.get("t0"), rs.get("t1")))
            steps.append((spec, step))
    held = message_delay(cfg)  # an input held by the harness arrived that much later
    fits = [fit([step], spec, delay=held) for spec, step in steps]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    cal = Calibration(**{k: med([getattr(f.calibration, k) for f in fits]) for k in ("task", "recv", "hop", "step")},
                      hop_on_rank=hop_on_rank, recv_in_hop=recv_in_hop)
    wait = lambda sid, rank, t: sleep(sid % 10**6, rank, t)  # noqa: E731
    factor = None
    if held_without is not None and held_applies(cores, P):
        by_row = {}
        for row, steps_of in recorded.items():
            recs = [r for sid, ranks in steps_of.items() if int(sid) in ids for rs in ranks
                    for r in _task_records(rs, int(sid))]
            # Only rows of this placement: the same task ids then name the same work.
            if ({r.task.stage for r in recs} == set(range(place.n_stages))
                    and all(place.rank_of(r.task.stage) == r.rank for r in recs)):
                by_row[row] = recs
        table = read_held(by_row, P, exclude=held_without, wait=wait)
        if table is not None:
            cal = dataclasses.replace(cal, held=table)
            factor = record_factors(records, table)
    own_records = records if factor is None else without_held(records, factor, wait)
    measured = stage_costs(own_records, place.n_stages, wait=wait)
    # stage 0's I is the runtime's no-op (its whole backward runs in W) when no split row ran.
    per = [{k: c.cost(k) for k in (F, B, I, W)} for c in measured.stages]
    if not any(r.task.kind == W for r in records):
        per[0][I], per[0][W] = 0.0, per[0][B]
    if cores is not None:
        # The duty as Calibration.simulate counts a run's CPU (a task's own cost, the runtime's
        # time per task, the receiving of a remote input), so the rows' own schedule, simulated,
        # runs at the duty its costs were measured at (rescaled by 1).
        remote, on = remote_inputs(steps[0][0]), cal.on_rank()
        fac = (lambda k, r, t: 1.0) if factor is None else (lambda k, r, t: factor[(k, r, t)])  # noqa: E731
        cpu = lambda k, r, t: (per[t.stage][t.kind] * fac(k, r, t) + cal.task  # noqa: E731
                               + (on if (t.stage, t.kind) in remote else 0.0))
        cal = dataclasses.replace(cal, cores=cores, background=background, duty=busy_share(records, P, cpu))
        by_step: dict[int, list[TaskRecord]] = {}
        for r in records:
            by_step.setdefault(r.step, []).append(r)
        duties = [busy_share(by_step[k], P, cpu) for k in sorted(by_step)] if draws else []
    else:
        duties = []
    n = sum(len(s) for _, s in steps) // P
    factors = step_factors(own_records, measured, wait=wait) if draws else []
    hops = [f.hops for f in fits] if draws else []
    draw_ids = [k % 10**6 for k in sorted({r.step for r in records})] if draws else []  # step_factors' order
    return RuntimeModel(cal, per, f"{', '.join(used)}: {n} timed step{'s' if n != 1 else ''}", n_virtual,
                        placement if n_virtual > 1 else "loop", factors, hops, draw_ids, duties)


def full_backward(model: RuntimeModel, full: RuntimeModel, split: RuntimeModel) -> RuntimeModel:
    """``model``, read off rows that all ran a split backward on its placement, with the costs of
    a full backward: each stage's ``F`` and ``B`` (there ``I + W``) times its rank's full over
    split figure, both read with one stage per rank in the same rounds (``full`` off the strict
    1F1B row, ``split`` off strict-split). A split backward routes the layers' forwards through
    the deferring function and runs the backward in two passes, so the split rows' ``F`` and
    ``I + W`` overstate a full backward's; the V placement's strict rows (the zero-bubble orders)
    all split, so a full-backward hint there (``bf``) has no row of its own form to be read off
    (docs/simulator.md). The other figures (runtime costs, factors, hops, duties) stay.

    Raises:
        ValueError: ``full`` or ``split`` not one stage per rank, their ranks not ``model``'s, or
            a split figure not above 0.
    """
    P = len(full.costs)
    place = Placement(P, model.n_virtual, model.placement)
    if full.n_virtual != 1 or split.n_virtual != 1 or len(split.costs) != P or place.n_stages != len(model.costs):
        raise ValueError(f"full_backward: expected one-stage models of the {len(model.costs) // model.n_virtual} "
                         f"ranks of the model's placement, got {len(full.costs)} and {len(split.costs)} ranks")
    costs = []
    for s, c in enumerate(model.costs):
        f, sp = full.costs[place.rank_of(s)], split.costs[place.rank_of(s)]
        if not (sp[F] > 0 and sp[B] > 0):
            raise ValueError(f"full_backward: rank {place.rank_of(s)}'s split F {sp[F]!r} and I + W {sp[B]!r} s: "
                             "expected both above 0")
        costs.append({**c, F: c[F] * f[F] / sp[F], B: c[B] * f[B] / sp[B]})
    return dataclasses.replace(model, costs=costs, source=f"{model.source}; F and B x each rank's full/split "
                                                          f"ratio ({full.source}; {split.source})")


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-round ``num / den``: median, quartiles and a 95% bootstrap interval of the median."""
    from .harness import median_ci

    r = np.asarray(num, dtype=float) / np.asarray(den, dtype=float)
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    lo, hi = median_ci(r)
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "ci": [lo, hi], "n": int(r.size)}
