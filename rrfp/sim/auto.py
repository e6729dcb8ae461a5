"""``auto``: rank the candidate hints with the simulator on a measured cost profile, then keep
the one whose trial steps were fastest.

The pure half of the ``auto`` hint (the other half, which measures a job's costs and runs the
trial on real steps, is :mod:`rrfp.runtime.features.auto`; the suite runs the same two steps on simulated
steps, :func:`simulate_auto`):

1. Ranking: given a :class:`Profile` (per stage the mean ``F``, ``B``, ``I``, ``W`` seconds and
   activation bytes, each measured microbatch's own bytes, per link the mean message seconds,
   and the spread of both) and the user's
   memory (in-flight limit, byte budget), :func:`rank` simulates every candidate of
   :func:`all_candidates` on that profile and orders them by simulated makespan. The spread enters
   as lognormal noise with the measured coefficient of variation, so a candidate that only
   wins on steady durations is not preferred under a noisy profile.
2. Trial (:mod:`rrfp.sim.trial`): the strict schedule and the best two by simulation (:func:`~rrfp.sim.trial.trial_candidates`) run
   :data:`~rrfp.sim.trial.TRIAL_ROUNDS` rounds of one step each, in rotating order (:func:`~rrfp.sim.trial.trial_order`);
   :func:`~rrfp.sim.trial.keep` keeps the smallest median step time (each adjusted to the trial's median
   batch work, :func:`~rrfp.sim.trial.scaled`, so a step's batch size does not pick the winner); among hints
   within :data:`~rrfp.sim.trial.TIE` of the fastest (or within the steps' own :func:`~rrfp.sim.trial.spread`, where larger),
   the strict schedule, else the first in the fixed order of
   :func:`all_candidates` (:func:`~rrfp.sim.trial.preference`), so a policy measured slower than the strict
   schedule is never kept and noise below the tie cannot flip the choice.

Candidates are data: the hint table's entries that allow ``auto``
(:attr:`rrfp.scheduler.registry.HintEntry.auto`, so a registered hint joins them); a name the
table does not resolve for the shape (one that does not fit the placement) is skipped and
reported, never an error.

Pure module: no torch, no asyncio (it drives :mod:`rrfp.sim`).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ..scheduler.hints import resolve_hint
from ..scheduler.memory import mib, over_budget
from ..scheduler.registry import auto_candidates
from ..scheduler.tasks import B, F, I, W, Task
from .compare import SimConfig, default_baseline, run_one
from .calibration import Calibration
from .costs import CostModel, StageCost
from .engine import DeadlockError
from .sized import Sizes, ratios, sized_configs
from .trial import EXTRA_ROUNDS, TRIAL_ROUNDS, Step, decided_on, keep, trial_candidates, trial_order, undecided

log = logging.getLogger("rrfp.auto")

AUTO = "auto"
"""The hint name that asks for this choice (``rrfp train --hint auto``, the train default)."""

STRICT = "strict"
"""Stands for the placement's own strict schedule (:func:`rrfp.sim.compare.default_baseline`)."""

PROFILE_SEED = 1_000_003
"""Seed of the ranking's noise: the ranking never sees a run's own draws."""

TRIAL_SEED = 2_000_003
"""First seed of the simulated trial steps (:func:`simulate_auto`): step ``j`` of the trial
draws under ``TRIAL_SEED + j``, never under the seed of the run it is judged on."""

MEASURED_SIZE_STEPS = 2
"""Steps whose microbatch sizes the suite's profile measures (:func:`profile_of_config`), as the
runtime's ``auto`` measures two (the strict schedule's, then a split candidate's): the ranking
simulates each (:func:`rrfp.sim.sized.sized_configs`). One step instead put bfw-mem exactly level
with strict-split at the suite's 4-rank ``seqlen`` point again (at 1F1B's memory, where it is 4%
faster at seed 0)."""

_NS = 1e9  # message seconds travel as "bytes" at 1 byte/ns (CommModel's size term)


@dataclass(frozen=True)
class Profile:
    """A job's measured costs (seconds; bytes).

    Attributes:
        stages: per stage, mean seconds of ``F``, ``B``, ``I``, ``W`` and the activation bytes
            a microbatch holds there (:class:`~rrfp.sim.costs.StageCost`).
        links: per stage ``s < S - 1``, mean seconds of a message between stages ``s`` and
            ``s + 1`` (either direction; 0 on one rank).
        compute_cv, message_cv: coefficient of variation (std / mean, >= 0) of compute times
            and of message times, pooled over stages and kinds.
        sizes: per measured step, per stage, the bytes each microbatch's forward held there
            (``sizes[step][stage][microbatch]``; empty: only the stage means are known). Where
            they vary, :func:`rank` simulates each measured step's own sizes
            (:func:`sized_configs`): a memory-aware candidate's gain, admitting more small
            microbatches under a byte budget, shows only there.
    """

    stages: tuple[StageCost, ...]
    links: tuple[float, ...]
    compute_cv: float = 0.0
    message_cv: float = 0.0
    sizes: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def costs(self) -> CostModel:
        """The profile as a cost model whose message sizes carry the link times."""
        st = [StageCost(c.F, c.B, c.I, c.W, c.act_bytes, max(1, round((self.links[s] if s < len(self.links) else 0.0) * _NS)))
              for s, c in enumerate(self.stages)]
        return CostModel(tuple(st))

    def describe(self) -> str:
        """One short line: mean costs in ms, then the tasks' coefficients of variation (std / mean)
        of compute and of message times, named so they are not read as the trial steps' spread."""
        n = len(self.stages)
        mean = {k: 1e3 * sum(getattr(c, k) for c in self.stages) / n for k in (F, B, I, W)}
        link = 1e3 * (sum(self.links) / len(self.links) if self.links else 0.0)
        return (f"F {mean[F]:.2f} B {mean[B]:.2f} I {mean[I]:.2f} W {mean[W]:.2f} ms/stage, "
                f"messages {link:.2f} ms, task time std/mean: compute {100 * self.compute_cv:.0f}%, "
                f"messages {100 * self.message_cv:.0f}%")


def _sigma(cv: float) -> float:
    # Lognormal with mean 1 and this coefficient of variation.
    return math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0


def pooled_cv(samples: Sequence[Sequence[float]]) -> float:
    """The coefficient of variation pooled over groups (each group relative to its own mean)."""
    dev, n = 0.0, 0
    for g in samples:
        if len(g) < 2:
            continue
        mu = statistics.fmean(g)
        if mu <= 0:
            continue
        dev += sum((x / mu - 1.0) ** 2 for x in g)
        n += len(g)
    return math.sqrt(dev / n) if n else 0.0


def profile_from_samples(
    compute: dict[tuple[int, str], list[float]],
    messages: dict[int, list[float]],
    n_stages: int,
    act_bytes: Sequence[int],
    sizes: Sizes = (),
    sample_bytes: Mapping[tuple[int, str], Sequence[int]] | None = None,
) -> Profile:
    """A :class:`Profile` from measured samples.

    Args:
        compute: ``(stage, kind) -> seconds`` samples, kinds ``F`` and ``B`` and/or ``I``, ``W``.
        messages: ``stage s -> seconds`` of messages between ``s`` and ``s + 1``.
        act_bytes: per stage, bytes one microbatch holds (where ``sizes`` are given: their
            mean over the measured microbatches instead).
        sizes: per measured step, per stage, each microbatch's bytes (:attr:`Profile.sizes`).
        sample_bytes: beside ``compute``, each sample's microbatch's bytes on its stage. Where
            the sizes vary, the ranking scales a microbatch's seconds with its size
            (:mod:`rrfp.sim.sized`), so the spread is that of ``seconds / (bytes / the stage's
            mean bytes)``: what the sizes do not explain (None: the spread of the seconds).

    Raises:
        ValueError: a stage without a forward sample, or without any backward sample; sizes
            without one entry per stage.
    """
    if sizes:
        if any(len(step) != n_stages for step in sizes):
            raise ValueError(f"profile: sizes for {[len(step) for step in sizes]} stages, expected {n_stages}")
        act_bytes = [round(statistics.fmean(b for step in sizes for b in step[s])) for s in range(n_stages)]
    stages = []
    for s in range(n_stages):
        m = {k: statistics.fmean(compute[(s, k)]) for k in (F, B, I, W) if compute.get((s, k))}
        if F not in m or not (B in m or (I in m and W in m)):
            raise ValueError(f"profile: stage {s} lacks a forward or backward sample (have {sorted(m)})")
        stages.append(StageCost.from_mapping({**m, "act_bytes": int(act_bytes[s])}, f"stage {s}"))
    links = tuple(statistics.fmean(messages[s]) if messages.get(s) else 0.0 for s in range(n_stages - 1))
    groups = list(compute.values())
    if sizes and sample_bytes and ratios(sizes, n_stages, len(sizes[0][0])):
        # The sizes explain part of the spread: the ranking draws only the rest as noise.
        groups = [[t * act_bytes[sk[0]] / b for t, b in zip(ts, sample_bytes.get(sk, ())) if b > 0]
                  for sk, ts in compute.items()]
    return Profile(tuple(stages), links, pooled_cv(groups), pooled_cv(list(messages.values())),
                   tuple(tuple(tuple(int(b) for b in row) for row in step) for step in sizes))


def profile_of_config(cfg: SimConfig, seed: int = PROFILE_SEED) -> Profile:
    """What measuring ``cfg``'s workload would give: every task and message of one step drawn
    under ``seed`` (not a compared run's seed), averaged per stage and link, with their spread.
    The suite's ``auto`` chooses from this, never from the run it is judged on."""
    c = replace(cfg, seed=seed)
    S, M = c.n_ranks * c.n_virtual, c.n_microbatches
    place = c.make_placement()
    full, split = c.duration_model(), c.duration_model()
    comm = c.comm_model()
    samples: dict[tuple[int, str], list[float]] = {}
    sample_bytes: dict[tuple[int, str], list[int]] = {}
    msgs: dict[int, list[float]] = {}
    for s in range(S):
        r = place.rank_of(s)
        for m in range(M):
            for model, kinds in ((full, (F, B)), (split, (F, I, W))):
                for k in kinds:
                    d = model(0, r, Task(s, k, m))
                    if model is full or k != F:
                        samples.setdefault((s, k), []).append(d)
                        sample_bytes.setdefault((s, k), []).append(full.act_bytes(0, s, m))
            nxt = place.next_stage(s)
            if nxt is not None and place.rank_of(nxt) != r:
                r2 = place.rank_of(nxt)
                msgs.setdefault(s, []).extend([comm(0, r, r2, Task(s, F, m)), comm(0, r2, r, Task(nxt, B, m))])
    # The measuring steps' sizes (the runtime measures two steps: the strict schedule's, the split's).
    sizes = [[[full.act_bytes(k, s, m) for m in range(M)] for s in range(S)] for k in range(MEASURED_SIZE_STEPS)]
    act = [round(statistics.fmean(full.act_bytes(0, s, m) for m in range(M))) for s in range(S)]
    return profile_from_samples(samples, msgs, S, act, sizes, sample_bytes)


def all_candidates() -> tuple[str, ...]:
    """What ``auto`` chooses from, in order of preference on a tie: :data:`STRICT` (the
    placement's strict schedule), then the hint table's entries that allow ``auto``
    (:func:`rrfp.scheduler.registry.auto_candidates`): built in, ``strict-split`` (that order
    with each backward split into ``I`` then ``W``), ``backfill`` (conservative backfilling over
    it), ``bf`` (RRFP's BF), ``bfw-mem`` (the memory-aware split-backward policy) and ``wfloat``
    (the split order whose ``W`` tasks float later, :mod:`rrfp.scheduler.wfloat`). Measured on
    the suite at 1F1B's memory, 4 and 8 ranks, the 120 points with variability: adding
    ``wfloat`` raised auto's median 1.049x -> 1.052x at min 1.000x both; adding ``ahead`` as
    well lowered it (median 1.050x, min 0.986x), so it is a hint, not a candidate."""
    return (STRICT, *auto_candidates())


def candidate_names(n_virtual: int, placement: str, candidates: Sequence[str] | None = None) -> list[str]:
    """The candidates (default :func:`all_candidates`) as hint names (``strict`` replaced by the
    placement's strict schedule; dropped when the placement has none)."""
    candidates = all_candidates() if candidates is None else candidates
    base = default_baseline(n_virtual, placement)
    out = [base if c == STRICT else c for c in candidates if c != STRICT or base]
    return list(dict.fromkeys(out))


def known_candidates(n_ranks: int, n_virtual: int, placement: str, n_microbatches: int,
                     candidates: Sequence[str] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """``(known, skipped)``: the candidates the hint registry resolves for this placement, and
    ``(name, why)`` for the others (logged at INFO on ``rrfp.auto``)."""
    from ..scheduler.tasks import Placement

    place = Placement(n_ranks, n_virtual, placement)
    known, skipped = [], []
    for name in candidate_names(n_virtual, placement, candidates):
        try:
            resolve_hint(name, place, n_microbatches)
        except (ValueError, RuntimeError) as e:
            skipped.append((name, str(e).removeprefix(f"hint {name!r}: ").split(":")[0]))
            continue
        known.append(name)
    for name, why in skipped:
        log.info("auto: candidate %s skipped (%s)", name, why)
    return known, skipped


def auto_first_hint(placement: Any, n_microbatches: int, known: Sequence[str] | None = None) -> str:
    """The hint ``auto`` runs first and keeps when it cannot choose: the placement's strict
    schedule (``strict-1f1b`` with one stage per rank), else the first candidate that fits.
    ``placement``: a :class:`~rrfp.scheduler.tasks.Placement`. ``known``: the candidates
    :func:`known_candidates` gave for this shape, when the caller has them (each resolves its
    schedule, and logs the skipped ones).

    Raises:
        ValueError: no candidate of :func:`all_candidates` fits the shape.
    """
    if known is None:
        known, _ = known_candidates(placement.n_ranks, placement.n_virtual, placement.kind, n_microbatches)
    if not known:
        raise ValueError(f"hint {AUTO!r}: none of its candidates ({', '.join(all_candidates())}) fits "
                         f"{placement.n_ranks} ranks x {placement.n_virtual} virtual stages ({placement.kind}), "
                         f"{n_microbatches} microbatches; name a hint")
    return next((c for c in known if c.startswith("strict-")), known[0])


@dataclass
class Ranking:
    """The outcome of :func:`rank`.

    Attributes:
        order: ``(hint, simulated makespan in seconds)``, fastest first; ties keep
            :func:`all_candidates`' order.
        strict: the placement's strict schedule's name (None: none).
        skipped: ``(name, why)`` of candidates the registry did not resolve, or that could
            not run at the user's memory (refused, or deadlocked in the simulation).
    """

    order: list[tuple[str, float]]
    strict: str | None
    skipped: list[tuple[str, str]]

    @property
    def best(self) -> str:
        return self.order[0][0]

    def makespan(self, hint: str) -> float:
        return dict(self.order)[hint]

    def reason(self) -> str:
        """Why the best was chosen, in one line."""
        parts = [f"{h} {t * 1e3:.1f} ms" for h, t in self.order[:3]]
        if self.strict and self.best != self.strict:
            # The speedup is the best's, so it sits beside the best, not after the list's last hint.
            parts[0] += f" ({self.makespan(self.strict) / self.order[0][1]:.3f}x over {self.strict})"
        out = f"simulated step: {', '.join(parts)}"
        if self.skipped:
            out += f"; not available: {', '.join(n for n, _ in self.skipped)}"
        return out


def rank(
    profile: Profile,
    *,
    n_ranks: int,
    n_virtual: int = 1,
    placement: str = "loop",
    n_microbatches: int,
    limit: Any = 32,
    memory_budget: Any = None,
    backpressure: str = "admission",
    seeds: int = 1,
    candidates: Sequence[str] | None = None,
    calibration: Calibration | None = None,
) -> Ranking:
    """Simulate each known candidate on ``profile`` at the user's memory and order them (where
    the profile's measured sizes vary, on each measured step's own sizes, makespans averaged:
    :func:`rrfp.sim.sized.sized_configs`; a named budget resolved on each). A
    candidate that cannot run there (refused at those limits, or a simulation that deadlocks)
    is dropped, logged at INFO on ``rrfp.auto`` and named in :attr:`Ranking.skipped`; so is,
    under a memory budget, one whose simulated peak breaks it on a rank
    (:func:`rrfp.scheduler.memory.over_budget`: a strict order cannot wait for bytes) while
    another candidate holds to it (``"holds 4000 bytes on rank 0, over the memory budget 2500
    bytes"``; where none does, none is dropped for it). :attr:`Ranking.strict` is None once the
    strict schedule is dropped: the trial neither tries nor keeps it.

    Args:
        limit, memory_budget, backpressure: as :class:`~rrfp.sim.compare.SimConfig` (the
            user's in-flight limit and byte budget, or ``"1f1b"``).
        seeds: noise draws per candidate (makespans averaged; draws start at
            :data:`PROFILE_SEED`).
        calibration: what the runtime pays around the profile's tasks
            (:class:`~rrfp.sim.calibration.Calibration`, fitted on the same steps; None:
            nothing).

    Raises:
        ValueError: no candidate is known or none can run, or a bad configuration.
    """
    known, skipped = known_candidates(n_ranks, n_virtual, placement, n_microbatches, candidates)
    if not known:
        names = all_candidates() if candidates is None else candidates
        raise ValueError(f"auto: none of the candidates {', '.join(names)} is a known hint")
    cfg = SimConfig(
        n_ranks=n_ranks, n_microbatches=n_microbatches, n_virtual=n_virtual, placement=placement, limit=limit,
        memory_budget=memory_budget, backpressure=backpressure, costs=profile.costs(),
        noise=_sigma(profile.compute_cv), comm_noise=_sigma(profile.message_cv),
        bandwidth=_NS if any(profile.links) else math.inf, calibration=calibration,
    )
    # One configuration per measured step where the measured sizes vary (sized_configs).
    cfgs = sized_configs(cfg, profile.sizes)
    if memory_budget is not None:  # resolved once for every candidate (on each step's sizes)
        cfgs = [replace(c, memory_budget=c.memory_budgets()) for c in cfgs]
    draws = max(seeds, len(cfgs))
    ones = [_one_microbatch(c) for c in cfgs] if memory_budget is not None else []
    times, over = [], {}
    for i, name in enumerate(known):
        try:
            runs = [(k, run_one(replace(cfgs[k % len(cfgs)], seed=PROFILE_SEED + k), name, record=False)[0])
                    for k in range(draws)]
        except (ValueError, DeadlockError) as e:
            # At the user's limits (wfloat below its order's own) or a policy's bug: that
            # candidate cannot run here, the others still can.
            why = str(e).splitlines()[0]
            log.info("auto: candidate %s dropped (%s)", name, why)
            skipped.append((name, why))
            continue
        over_by = next(filter(None, (_over(cfgs[k % len(cfgs)], ones[k % len(cfgs)], run) for k, run in runs)),
                       None) if ones else None
        if over_by:
            over[name] = over_by
        times.append((statistics.fmean(run.makespan for _, run in runs), i, name))
    if not times:
        raise ValueError(f"auto: no candidate can run here: {'; '.join(f'{n}: {w}' for n, w in skipped)}")
    times = _within_budget(times, over, skipped)
    times.sort()
    strict = default_baseline(n_virtual, placement)
    return Ranking([(n, t) for t, _, n in times], strict if any(n == strict for *_, n in times) else None, skipped)


def _within_budget(times: list, over: dict[str, str], skipped: list) -> list:
    """``times`` (``(makespan, index, name)``) less the candidates in ``over`` (name -> why it
    broke the memory budget), each named in ``skipped``, while another candidate holds to the
    budget: a strict order cannot wait for bytes, so its run holds what its order holds."""
    if not over or len(over) >= len(times):
        return times
    for name, why in over.items():
        log.info("auto: candidate %s dropped (%s)", name, why)
        skipped.append((name, why))
    return [x for x in times if x[2] not in over]


def _one_microbatch(cfg: SimConfig) -> list[int]:
    """Per rank, the most bytes one microbatch holds on it (its forwards on every virtual stage
    of the rank) in ``cfg``'s steps: what the budget's rule lets the oldest microbatch hold."""
    place, model = cfg.make_placement(), cfg.duration_model()
    return [max((sum(model.act_bytes(k, s, m) for s in place.stages_of(r))
                 for k in range(cfg.steps) for m in range(cfg.n_microbatches)), default=0)
            for r in range(cfg.n_ranks)]


def _over(cfg: SimConfig, ones: Sequence[int], run: Any) -> str | None:
    """Why a simulated run broke ``cfg``'s memory budget on its first rank that did
    (:func:`rrfp.scheduler.memory.over_budget`), or None."""
    budgets = cfg.memory_budget  # per rank already: rank() resolves it once for every candidate
    for r, (peak, one) in enumerate(zip(run.peak_memory_rank or [], ones)):
        b = budgets[r] if budgets else None
        if over_budget(peak, one, b):
            return f"holds {mib(peak)} on rank {r}, over the memory budget {mib(b)}"
    return None


def batch_work(cfg: SimConfig) -> float:
    """How large ``cfg``'s step's batch is, as the runtime measures it (the elements of its
    input tensors): the sum over its microbatches of
    :meth:`~rrfp.sim.duration.DurationModel.input_size`, the microbatch's input size relative
    to an average one. Draws are keyed by microbatch, so it does not depend on the hint, and
    the injected jitter and noise, which no input shows, are not in it."""
    model = cfg.duration_model()
    return sum(model.input_size(0, m) for m in range(cfg.n_microbatches))


@dataclass
class AutoRun:
    """What :func:`simulate_auto` did: the ranking, the trial's steps per hint (:data:`~rrfp.sim.trial.Step`,
    one per round), the hint kept, and the two hints of the extra rounds (:func:`~rrfp.sim.trial.undecided`;
    empty: none ran)."""

    ranking: Ranking
    walls: dict[str, list[Step]]
    chosen: str
    extension: list[str] = field(default_factory=list)


def simulate_auto(cfg: SimConfig, *, rounds: int = TRIAL_ROUNDS, seed: int = TRIAL_SEED,
                  candidates: Sequence[str] | None = None) -> AutoRun:
    """``auto`` as it runs on ``cfg``'s workload, with simulated steps for real ones: rank the
    candidates on the profile :func:`profile_of_config` measures, then run the trial's
    ``rounds`` rounds, step ``j`` simulated on ``cfg`` under seed ``seed + j`` (none of them
    ``cfg.seed``'s draws, so the choice never sees the run it is judged on) with its batch work
    (:func:`batch_work`), :data:`~rrfp.sim.trial.EXTRA_ROUNDS` more of two hints where the trial left the
    choice to its noise (:func:`~rrfp.sim.trial.undecided`), and :func:`~rrfp.sim.trial.keep` (between those two, then).

    A named memory budget (``"1f1b"``) is resolved per trial step on that step's own sizes,
    as the run it stands for resolves it.

    Raises:
        ValueError: no candidate is known, or a bad configuration.
    """
    rk = rank(profile_of_config(cfg), n_ranks=cfg.n_ranks, n_virtual=cfg.n_virtual, placement=cfg.placement,
              n_microbatches=cfg.n_microbatches, limit=cfg.limit, memory_budget=cfg.memory_budget,
              backpressure=cfg.backpressure, candidates=candidates)
    trial = trial_candidates([h for h, _ in rk.order], rk.strict)
    walls: dict[str, list[Step]] = {h: [] for h in trial}
    seeds = itertools.count(seed)  # step j of the trial, extra rounds included, draws under seed + j

    def play(hints: list[str], n: int) -> None:
        for r in range(n):
            for h in trial_order(hints, r):
                step = replace(cfg, seed=next(seeds))
                if isinstance(step.memory_budget, str):
                    step = replace(step, memory_budget=step.memory_budgets())
                walls[h].append((run_one(step, h, record=False)[0].makespan, batch_work(step)))

    play(trial, rounds)
    pair = undecided(walls, rk.strict)
    if pair:
        play(pair, EXTRA_ROUNDS)
    return AutoRun(rk, walls, keep(decided_on(walls, pair), rk.strict), pair)
