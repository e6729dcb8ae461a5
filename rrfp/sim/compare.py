"""Run several hints on one simulated pipeline and compare them (what ``rrfp simulate`` does).

:class:`SimConfig` holds a pipeline and its duration model; :func:`run_one` simulates one hint
on it through :func:`rrfp.scheduler.hints.resolve_hint` and the real arbiter;
:func:`compare` runs several hints under the same seed (same workload, same noise per task)
and fills each one's speedup over a baseline (strict 1F1B by default); :func:`sweep` repeats
that over pipeline depth, microbatches per stage, jitter level and encoder imbalance.

Pure module: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from ..scheduler.hints import resolve_hint
from ..scheduler.policy import placement_schedule
from ..scheduler.memory import BUDGET_NAMES, order_peak_bytes, parse_size
from ..scheduler.schedules import one_f_one_b_limits
from ..scheduler.tasks import Placement
from .calibration import Calibration
from .costs import CostModel
from .duration import CommModel, Dist, DurationModel
from .engine import SimResult, simulate
from .jitter import JitterLevel
from .metrics import RunSummary, set_speedups, summarize

DEFAULT_F = 0.010
DEFAULT_B = 0.020


@dataclass(frozen=True)
class SimConfig:
    """One simulated pipeline and its duration model (units: seconds, bytes, bytes/s).

    Attributes:
        n_ranks, n_virtual, placement: the placement (:class:`~rrfp.scheduler.tasks.Placement`).
        n_microbatches: microbatches per step.
        steps: steps run back to back; step_overhead: seconds between a rank's steps.
        backpressure: with virtual stages, ``admission`` or ``completion-order``
            (:data:`rrfp.scheduler.hints.BACKPRESSURE`).
        limit: the in-flight limit: an int, a per-rank list, or ``"1f1b"`` (1F1B's own
            per-rank limits ``p - r``, which match its activation memory).
        memory_budget: activation bytes per rank: None (no budget), bytes (an int, or one
            per rank, None for a rank without one), or ``"1f1b"`` / ``"gpipe"``: what the placement's fixed-order baseline
            (:func:`default_baseline`) or GPipe holds on each rank with these sizes
            (:func:`memory_budgets`). Needs ``act_bytes`` in the costs.
        costs: per-stage costs (None: every stage ``F = 10 ms``, ``B = 20 ms``).
        seed, jitter, noise, seqlen, images, samples_per_microbatch, encoder_stages,
        encoder_scale, stragglers: the compute model (:class:`~rrfp.sim.duration.DurationModel`).
        latency, bandwidth, comm_noise, comm_jitter, slow_links: the message model
            (:class:`~rrfp.sim.duration.CommModel`).
        calibration: what the runtime pays around tasks and how its ranks share cores
            (:class:`~rrfp.sim.calibration.Calibration`; None: nothing).
    """

    n_ranks: int
    n_microbatches: int
    n_virtual: int = 1
    placement: str = "loop"
    steps: int = 1
    step_overhead: float = 0.0
    limit: Any = 32
    memory_budget: Any = None
    backpressure: str = "admission"
    costs: CostModel | None = None
    seed: int = 0
    jitter: JitterLevel | None = None
    noise: float = 0.0
    seqlen: Dist | None = None
    images: Dist | None = None
    samples_per_microbatch: int = 1
    encoder_stages: int = 1
    encoder_scale: float = 1.0
    stragglers: dict[int, float] = field(default_factory=dict)
    latency: float = 0.0
    bandwidth: float = math.inf
    comm_noise: float = 0.0
    comm_jitter: JitterLevel | None = None
    slow_links: dict[tuple[int, int], float] = field(default_factory=dict)
    calibration: Calibration | None = None

    def make_placement(self) -> Placement:
        """Raises ValueError for a bad count or placement kind."""
        return Placement(self.n_ranks, self.n_virtual, self.placement)

    def limits(self) -> int | list[int]:
        """The in-flight limit as the arbiter takes it.

        Raises:
            ValueError: a limit that is not ``"1f1b"``, an int >= 1, or one int per rank.
        """
        lim = self.limit
        if lim == "1f1b":
            return one_f_one_b_limits(self.n_ranks)
        if isinstance(lim, int) and not isinstance(lim, bool) and lim >= 1:
            return lim
        if isinstance(lim, (list, tuple)) and len(lim) == self.n_ranks and all(
            isinstance(x, int) and x >= 1 for x in lim
        ):
            return list(lim)
        raise ValueError(f"in-flight limit {lim!r}: expected an integer >= 1, '1f1b', or one per rank")

    def memory_budgets(self) -> list[int | None] | None:
        """Per rank, the memory budget in bytes (None: no budget).

        Raises:
            ValueError: a budget without activation sizes, a bad budget, or ``1f1b`` on a
                placement without a fixed-order baseline.
        """
        mb = self.memory_budget
        if mb is None:
            return None
        if not any(c.act_bytes for c in self.cost_model().stages):
            raise ValueError(f"--memory-budget {mb}: needs activation sizes: give --act-bytes SIZE (or a cost file with act_bytes)")
        P = self.n_ranks
        if isinstance(mb, (list, tuple)):
            if len(mb) != P:
                raise ValueError(f"{len(mb)} memory budgets given for {P} ranks")
            return [None if x is None else parse_size(x) for x in mb]
        if mb not in BUDGET_NAMES:
            return [parse_size(mb)] * P
        if mb == "gpipe":  # all forwards before any backward: every microbatch held
            base = "strict-gpipe" if self.n_virtual == 1 else "strict-looped-bfs"
        else:
            base = default_baseline(self.n_virtual, self.placement)
        if base is None:
            raise ValueError(f"memory budget {mb!r}: no such schedule for {self.n_virtual} virtual stages ({self.placement})")
        spec, h, _ = resolve_hint(base, self.make_placement(), self.n_microbatches)
        model = self.duration_model()
        return [max(order_peak_bytes(h.order[r], lambda s, m, k=k: model.act_bytes(k, s, m)) for k in range(self.steps))
                for r in range(P)]

    def cost_model(self) -> CostModel:
        """Costs fitted to the pipeline's stage count.

        Raises:
            ValueError: a multi-stage cost model of the wrong length.
        """
        n = self.n_ranks * self.n_virtual
        if self.costs is None:
            return CostModel.uniform(n, DEFAULT_F, DEFAULT_B)
        return self.costs.for_stages(n)

    def duration_model(self) -> DurationModel:
        return DurationModel(
            self.cost_model(), seed=self.seed, jitter=self.jitter, noise=self.noise, seqlen=self.seqlen,
            images=self.images, samples_per_microbatch=self.samples_per_microbatch,
            encoder_stages=self.encoder_stages, encoder_scale=self.encoder_scale, stragglers=self.stragglers,
        )

    def comm_model(self) -> CommModel:
        return CommModel(
            self.cost_model(), latency=self.latency, bandwidth=self.bandwidth, noise=self.comm_noise,
            jitter=self.comm_jitter, seed=self.seed, slow_links=self.slow_links,
        )


def run_one(cfg: SimConfig, hint: str, *, record: bool = True) -> tuple[RunSummary, SimResult]:
    """Simulate ``hint`` (``"bf"``, ``"strict-1f1b"``, any text resolve_hint accepts) on
    ``cfg`` with a fresh duration model.

    Returns:
        the run's summary (lower bound included when ``record``) and the raw result.

    Raises:
        ValueError: an unknown hint, one that does not fit the placement or microbatch count,
            or a bad configuration (one line each).
        rrfp.sim.engine.DeadlockError: the schedule cannot finish.
    """
    placement = cfg.make_placement()
    limits = cfg.limits()
    # The limit also shapes a strict policy (strict-bf), which resolve_hint compiles under it.
    spec, h, strict = resolve_hint(
        hint, placement, cfg.n_microbatches, inflight_limit=limits, backpressure=cfg.backpressure
    )
    comm = cfg.comm_model()
    delay = None if comm.is_zero else comm
    kw: dict[str, Any] = {} if delay is None else {"delay": delay}
    act = [c.act_bytes for c in cfg.cost_model().stages]
    model = cfg.duration_model()
    if any(act):
        # The arbiter counts each microbatch's own bytes (they vary with sequence length and
        # image count): the exact peak per rank, and the budget when one is set.
        kw["act_bytes"] = model.act_bytes
        kw["memory_budget"] = cfg.memory_budgets()
        w_share = [None if c.w_bytes is None or not c.act_bytes else c.w_bytes / c.act_bytes
                   for c in cfg.cost_model().stages]
        if any(x is not None for x in w_share):
            # W's bytes scale with the microbatch as its activation does.
            kw["w_bytes"] = lambda k, s, m: None if w_share[s] is None else round(w_share[s] * model.act_bytes(k, s, m))
    run = simulate if cfg.calibration is None else cfg.calibration.simulate
    res = run(
        spec, h, model, strict=strict, inflight_limit=limits, steps=cfg.steps,
        step_overhead=cfg.step_overhead, record=record, **kw,
    )
    if record:
        summary = summarize(
            hint, spec, res, act, delay=delay, steps=cfg.steps, step_overhead=cfg.step_overhead, limit=cfg.limit
        )
    else:
        held = res.peak_inflight_stage
        summary = RunSummary(hint, res.makespan, res.bubble_fraction(), list(held),
                             [h_ * a for h_, a in zip(held, act)], [], math.nan, limit=cfg.limit)
    if any(act):
        summary.peak_memory_rank = list(res.peak_bytes)
    summary.extra["memory_budget"] = kw.get("memory_budget")
    summary.extra["split_backward"] = spec.split_backward
    summary.extra["strict"] = strict
    return summary, res


def default_baseline(n_virtual: int, placement: str = "loop") -> str | None:
    """The fixed-order baseline a placement has: strict 1F1B (one stage per rank), strict
    interleaved 1F1B (``loop`` with virtual stages), strict ZB-V (``v``, two virtual stages),
    else None."""
    name = placement_schedule(n_virtual, placement)
    return None if name is None else f"strict-{name}"


def compare(
    cfg: SimConfig,
    hints: Sequence[str],
    baseline: str | None = "auto",
    *,
    on_result: Callable[[str, RunSummary, SimResult], None] | None = None,
) -> list[RunSummary]:
    """Run each hint (and the baseline, appended when missing) on ``cfg`` and set each
    row's speedup over the baseline.

    Args:
        baseline: a hint text, ``"auto"`` (:func:`default_baseline`; none when the placement
            has no fixed-order baseline) or None (no speedups).
        on_result: called after each run (e.g. to write its trace).

    Raises:
        ValueError / DeadlockError: as :func:`run_one`, naming the hint.
    """
    if baseline == "auto":
        baseline = default_baseline(cfg.n_virtual, cfg.placement)
    names = list(dict.fromkeys(hints))
    if baseline and baseline not in names:
        names.append(baseline)
    rows = []
    base_row = None
    for name in names:
        try:
            summary, res = run_one(cfg, name)
        except ValueError as e:  # said once: the hint's own check may have named it already
            raise ValueError(str(e) if str(e).startswith(f"hint {name!r}") else f"hint {name!r}: {e}") from None
        if on_result:
            on_result(name, summary, res)
        rows.append(summary)
        if name == baseline:
            base_row = summary
    set_speedups(rows, base_row)
    return rows


@dataclass
class SweepPoint:
    """One configuration of a sweep and its runs, by hint (a missing hint did not apply)."""

    n_ranks: int
    mb_per_stage: int
    n_microbatches: int
    jitter: str
    imbalance: float
    runs: dict[str, RunSummary]
    errors: dict[str, str] = field(default_factory=dict)


def sweep(
    base: SimConfig,
    *,
    depths: Iterable[int],
    mb_per_stage: Iterable[int],
    jitters: Iterable[JitterLevel | None],
    imbalances: Iterable[float],
    hints: Sequence[str],
    baseline: str | None = "auto",
    seeds: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[SweepPoint]:
    """The paper's scaling study on the simulator: every combination of pipeline depth
    (ranks), microbatches per stage (``M = mb_per_stage * ranks``), jitter level and encoder
    imbalance (``encoder_scale``), each hint under ``seeds`` seeds (makespans averaged; the
    lower bound averaged too). A hint that does not fit a configuration is recorded in
    ``errors`` instead of stopping the sweep.

    Raises:
        ValueError: ``seeds < 1``.
    """
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: expected at least 1")
    if baseline == "auto":
        baseline = default_baseline(base.n_virtual, base.placement)
    names = list(dict.fromkeys(list(hints) + ([baseline] if baseline else [])))
    points = []
    for P in depths:
        for mps in mb_per_stage:
            for jit in jitters:
                for imb in imbalances:
                    cfg = replace(base, n_ranks=P, n_microbatches=mps * P, jitter=jit, encoder_scale=imb)
                    pt = SweepPoint(P, mps, mps * P, jit.name if jit else "J0", imb, {})
                    for name in names:
                        try:
                            runs = [run_one(replace(cfg, seed=base.seed + k), name)[0] for k in range(seeds)]
                        except ValueError as e:
                            pt.errors[name] = str(e)
                            continue
                        avg = runs[0]
                        avg.makespan = sum(r.makespan for r in runs) / seeds
                        avg.lower_bound = sum(r.lower_bound for r in runs) / seeds
                        avg.bubble = [sum(b) / seeds for b in zip(*(r.bubble for r in runs))]
                        pt.runs[name] = avg
                    set_speedups(list(pt.runs.values()), pt.runs.get(baseline) if baseline else None)
                    points.append(pt)
                    if progress:
                        progress(f"P={P} m/stage={mps} jitter={pt.jitter} imbalance={imb:g}: done")
    return points


def sweep_table(points: Sequence[SweepPoint], hints: Sequence[str], baseline: str | None) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the sweep's table: one row per configuration; the baseline's
    makespan and mean bubble, the lower bound (the smallest of the runs' bounds, so it holds
    for each), then each hint's speedup over the baseline (``n/a`` where the hint did not
    apply), and the fastest hint."""
    others = [h for h in dict.fromkeys(hints) if h != baseline]
    header = ["ranks", "mb/stage", "M", "jitter", "imbalance"]
    if baseline:
        header += [f"{baseline} (s)", f"{baseline} bubble"]
    header += ["bound (s)"] + [f"{h} speedup" for h in others] + ["best"]
    cells = []
    for pt in points:
        row = [str(pt.n_ranks), str(pt.mb_per_stage), str(pt.n_microbatches), pt.jitter, f"{pt.imbalance:g}"]
        base = pt.runs.get(baseline) if baseline else None
        if baseline:
            row += [f"{base.makespan:.4g}", f"{base.bubble_mean:.2f}"] if base else ["n/a", "n/a"]
        # Each run is bounded with its own durations (split and full backward differ): the
        # smallest bound holds for every run.
        bound = min((r.lower_bound for r in pt.runs.values()), default=math.nan)
        row.append(f"{bound:.4g}")
        speeds = {}
        for h in others:
            r = pt.runs.get(h)
            if r is None or r.speedup is None:
                row.append("n/a")
                continue
            row.append(f"{r.speedup:.2f}x")
            speeds[h] = round(r.speedup, 2)
        # Ties at the printed precision are all named: "bfw=zb-h1".
        top = max(speeds.values(), default=None)
        if top is None:
            best = ""
        elif base is not None and top < 1.0:
            best = baseline or ""
        else:
            best = "=".join(h for h, v in speeds.items() if v == top)
        row.append(best)
        cells.append(row)
    return header, cells
