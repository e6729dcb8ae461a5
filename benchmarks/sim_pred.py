"""The simulator's prediction of a benchmark row: the same arbiter (``rrfp.sim.engine``) on the
row's placement, hint, in-flight limit and memory budget, with each task's duration its stage's
base cost plus *the very delays the real run injected* (the keyed draws of
:class:`benchmarks.harness.Injector` and :class:`benchmarks.workloads.MessageDelays`, same seed,
step ids, stages and microbatches), one step per round. No runtime overhead, no message time
beyond the injected delays, one processor per rank.

Costs per stage: with one stage per rank, the rank's calibrated forward and backward (plus the
setting's sleep, where tasks sleep for their compute); with two virtual stages, half of the
rank's each (the layers split evenly), and half of the rank's injected delay, as the harness
injects it. The jitter's ``e`` is the stage's mean of forward and backward, as the harness's. A
split backward's ``I`` and ``W`` each carry half of the compute and their share of the injected
delay and of the sleep (:attr:`benchmarks.harness.Injector.w_share`), as the harness sleeps them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.schedules import one_f_one_b_limits
from rrfp.scheduler.tasks import B, F, I, W, Placement
from rrfp.sim.engine import simulate
from rrfp.sim.jitter import LEVELS, STREAM_COMM_HIT, STREAM_COMM_SIZE, injected_delay


def timed_step_ids(phase_index: int, phase: dict) -> list[int]:
    """The step ids of a phase's timed rounds (as :mod:`benchmarks.compare` numbers them);
    ``phase`` is the phase's configuration or its result (with its round records)."""
    rounds = phase["rounds"]
    if isinstance(rounds, int):
        return [1000 * phase_index + k for k in range(2, 2 + rounds)]
    return [1000 * phase_index + r["round"] for r in rounds if r["kind"] == "timed"]


def predict(cfg: dict, calibration: Sequence[dict], phase_index: int, phase: dict, hint: str, *,
            n_virtual: int = 1, placement: str = "loop", limit: int | str = 32,
            budgets: Sequence[int] | None = None, stage_bytes: Sequence[Sequence[int]] | None = None) -> list[float]:
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

    Raises:
        ValueError: a hint that does not fit the placement (from the scheduler).
    """
    return [res.makespan for res, _ in _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement,
                                               limit, budgets, stage_bytes, None)]


def predict_bounded(cfg: dict, calibration: Sequence[dict], phase_index: int, phase: dict, hint: str, *,
                    bound_budgets: Sequence[int], stage_bytes: Sequence[Sequence[int]], n_virtual: int = 1,
                    placement: str = "loop", limit: int | str = 32,
                    budgets: Sequence[int] | None = None) -> tuple[list[float], list[float]]:
    """:func:`predict`'s step times, and per round the memory-aware lower bound (seconds) on any
    schedule of the same tasks that keeps each rank within ``bound_budgets`` bytes: the larger of
    :func:`rrfp.sim.metrics.lower_bound` and :func:`rrfp.sim.metrics.memory_bound` over that
    round's task durations (the suite's memory-aware ceiling, :mod:`rrfp.sim.suite`).

    Raises:
        ValueError: a hint that does not fit the placement (from the scheduler).
    """
    steps, bounds = [], []
    for res, bound in _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement, limit, budgets,
                              stage_bytes, bound_budgets):
        steps.append(res.makespan)
        bounds.append(bound)
    return steps, bounds


def _rounds(cfg, calibration, phase_index, phase, hint, n_virtual, placement, limit, budgets, stage_bytes,
            bound_budgets):
    """Per timed round: (the simulation's result, its memory-aware bound at ``bound_budgets`` or
    None without them)."""
    from rrfp.sim.metrics import lower_bound, memory_bound

    from .systems import torch_order_hint

    P, M, seed = cfg["n_ranks"], cfg["n_microbatches"], cfg["seed"]
    place = Placement(P, n_virtual, placement)
    limits = one_f_one_b_limits(P) if limit == "1f1b" else [int(limit)] * P
    spec, h, strict = resolve_hint(torch_order_hint(hint, P, M), place, M, inflight_limit=limits)
    level = LEVELS[phase["level"]]
    comm = LEVELS[cfg["comm"]] if cfg.get("comm") else None
    sleep = cfg.get("sleep") or {"F": 0.0, "B": 0.0}
    share = 1.0 / n_virtual
    # The harness's own rules (its Injector): e per stage, W's share of a backward.
    from .harness import Injector

    inj = [Injector(level, seed, r, dict(sleep) if cfg.get("sleep") else c, base=cfg.get("sleep"))
           for r, c in enumerate(calibration)]
    act = None
    if stage_bytes is not None:
        pos = {s: (place.rank_of(s), i) for r in range(P) for i, s in enumerate(place.stages_of(r))}
        act = lambda step, stage, mb: int(stage_bytes[pos[stage][0]][pos[stage][1]])  # noqa: E731

    for step_id in timed_step_ids(phase_index, phase):
        def duration(step: int, rank: int, t, sid=step_id) -> float:
            kind = F if t.kind == F else B
            base = calibration[rank][kind] * share
            d = (injected_delay(level, seed, sid, rank, t.mb, kind, inj[rank].e_stage) + sleep[kind]) * share
            if t.kind == W:
                return base / 2 + d * inj[rank].w_share
            if t.kind == I:
                return base / 2 + d * (1.0 - inj[rank].w_share)
            return d + base

        def delay(step: int, src: int, dst: int, t, sid=step_id) -> float:
            if comm is None:
                return 0.0
            return injected_delay(comm, seed, sid, t.stage, t.mb, F if t.kind == F else B, 0.0,
                                  streams=(STREAM_COMM_HIT, STREAM_COMM_SIZE))

        res = simulate(spec, h, duration, strict=strict, inflight_limit=limits, delay=delay,
                       record=bound_budgets is not None,
                       memory_budget=list(budgets) if budgets is not None else None,
                       act_bytes=act if budgets is not None else None)
        bound = None
        if bound_budgets is not None:
            bound = max(lower_bound(spec, res.records, delay=delay),
                        memory_bound(spec, res.records, list(bound_budgets), act, delay=delay))
        yield res, bound


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-round ``num / den``: median, quartiles and a 95% bootstrap interval of the median."""
    from .harness import median_ci

    r = np.asarray(num, dtype=float) / np.asarray(den, dtype=float)
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    lo, hi = median_ci(r)
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "ci": [lo, hi], "n": int(r.size)}
