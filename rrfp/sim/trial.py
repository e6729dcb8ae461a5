"""``auto``'s trial: which hint to keep from measured steps (RRFP's readiness hints, chosen by
measurement; the rule :mod:`rrfp.sim.auto` and :mod:`rrfp.runtime.features.auto` share).

The strict schedule and the best two of the ranking (:func:`trial_candidates`) run
:data:`TRIAL_ROUNDS` rounds of one step each, in rotating order (:func:`trial_order`). Each
step's time is adjusted to the trial's median batch work (:func:`scaled`); :func:`keep` keeps
the smallest median, and among hints within :func:`margin` of it (:data:`TIE`, or the steps' own
:func:`spread` where larger) the strict schedule, a re-check's incumbent, or else the first in a
fixed order (:func:`preference`). Where only the spread kept another hint than the fastest
(:func:`undecided`), the two run :data:`EXTRA_ROUNDS` more rounds and are decided on those
steps alone (:func:`decided_on`).

Pure module: no torch, no asyncio, no simulator (its inputs are step times, real or simulated).
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Mapping, Sequence

from ..scheduler.registry import auto_candidates

TRIAL_ROUNDS = 3
"""Rounds of the trial, one step per candidate each. Three: the trial has at most three
candidates (the strict schedule and the best two), so the rotation puts each of three once in
every position of a round (a position effect, e.g. the step after a switch, cancels), and the
median of three step times ignores one outlier step (a collection pause, a neighbour's burst).
The cost is at most nine steps, most of them of candidates within a few percent of the kept
one; more rounds would not resolve smaller differences against a step-to-step spread of
several percent, the part of which a batch's size makes the adjustment to equal batch work
(:func:`scaled`) removes instead."""

TIE = 0.01
"""Hints whose median trial step times are within this fraction of the fastest's are tied
(or within the trial steps' measured :func:`spread`, where larger): the strict schedule, a
re-check's incumbent, or else the first in :func:`~rrfp.sim.auto.all_candidates`' order is kept among them
(:func:`keep`); a switch needs a measured gain beyond it."""

def trial_candidates(order: Sequence[str], strict: str | None, n: int = 2) -> list[str]:
    """The trial's hints: ``strict`` (when there is one), then the best ``n`` of ``order``
    (fastest first), each once."""
    return list(dict.fromkeys([*([strict] if strict else []), *order[:n]]))


def trial_order(trial: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: ``trial`` rotated by ``r`` (each candidate leads one round in turn)."""
    k = r % len(trial)
    return [*trial[k:], *trial[:k]]


Step = tuple[float, float]
"""One trial step: ``(seconds, batch work)``, the step's time (the slowest rank's) and how large
its batch was, a figure no hint changes: on real steps the elements of the microbatches' input
tensors (:attr:`rrfp.runtime.engine.rank.StepStats.input_elems`, summed over the ranks), in the
simulator the same measure of the draws (:func:`batch_work`); 0: not measured."""


def scaled(trial: Mapping[str, Sequence[Step]]) -> dict[str, list[float]]:
    """Per hint, its trial steps' times adjusted to the trial's median batch work:
    ``seconds - slope * (batch work - median batch work)``.

    Each trial step runs another batch (a batch of short sequences is a short step under any
    hint); the adjustment removes that from the comparison, as a paired run on one batch would.
    ``slope`` is seconds per unit of work, the median over every pair of steps of one hint of
    their difference in seconds over their difference in work (Theil-Sen: pairs of one hint, so
    a hint's own speed is not read as the work's; one odd step does not move it); 0 where no
    two steps of a hint differ in work, never below 0, and never above the smallest step's
    seconds per unit of work (so an adjusted time stays above ``seconds * median / work``). A
    slope, not a proportion: a step has a part the batch's size does not change (an image
    encoder's stage while the captions' lengths vary), which a rescaling in proportion to the
    work over-corrects.

    The work must be a figure of the batch alone: the forwards' own seconds, used before,
    change with the hint (a split backward's routed forwards; eight microbatches in flight
    where the strict schedule holds two, on shared cores: bfw-mem's forwards took 25% longer on
    ``rrfp bench``'s compute2), so an adjustment by them credited a hint with its own slowdown.
    Steps without a work figure (0) keep their time."""
    ref = statistics.median([f for steps in trial.values() for _, f in steps if f > 0] or [0.0])
    slopes = [(t1 - t2) / (f1 - f2) for steps in trial.values()
              for (t1, f1), (t2, f2) in itertools.combinations(steps, 2) if f1 > 0 and f2 > 0 and f1 != f2]
    # At most the smallest step's seconds per unit of work: a step's time grows at most in
    # proportion to its batch (a fixed part only lowers the rate), so no adjusted time falls
    # below 0 where a pair of nearly equal works turned noise into a steep slope.
    rate = min((t / f for steps in trial.values() for t, f in steps if f > 0 and t > 0), default=0.0)
    slope = min(rate, max(0.0, statistics.median(slopes))) if slopes else 0.0
    return {h: [t - slope * (f - ref) if f > 0 else t for t, f in steps] for h, steps in trial.items()}


def medians(trial: Mapping[str, Sequence[Step]]) -> dict[str, float]:
    """Per hint, the median of its :func:`scaled` trial step times (hints without any left out)."""
    return {h: statistics.median(w) for h, w in scaled(trial).items() if w}


SPREAD_MAD = 1.4826
"""A normal distribution's standard deviation over its median absolute deviation."""


def spread(trial: Mapping[str, Sequence[Step]]) -> float:
    """How much trial steps of one hint differ from step to step, as a fraction: each
    :func:`scaled` step's deviation from its hint's median, relative to it (with an odd count
    the median's own step left out), pooled over the hints; their median times
    :data:`SPREAD_MAD`, the standard deviation of normal noise, which one outlier step does not
    widen. 0 without a hint of two steps."""
    devs: list[float] = []
    for w in scaled(trial).values():
        if len(w) < 2:
            continue
        m = statistics.median(w)
        d = sorted(abs(x / m - 1) for x in w) if m > 0 else []
        devs += d[1:] if len(w) % 2 else d
    return SPREAD_MAD * statistics.median(devs) if devs else 0.0


def margin(trial: Mapping[str, Sequence[Step]], tie: float = TIE) -> float:
    """The gain (a fraction of a hint's median) a faster hint needs to count as faster: the
    larger of ``tie`` and the trial's :func:`spread` times ``sqrt(TRIAL_ROUNDS / n)``, so that a
    difference the noise of the steps makes is not read as one between hints. ``n`` is the
    fewest steps a hint of ``trial`` has, counted from :data:`TRIAL_ROUNDS` to
    ``TRIAL_ROUNDS + EXTRA_ROUNDS``: the spread is one step's, and a median's noise falls as
    ``1/sqrt(n)``, so after the trial's rounds the margin is the spread itself and after
    :data:`EXTRA_ROUNDS` more it is ``sqrt(1/2)`` of it."""
    return max(tie, spread(trial) * math.sqrt(TRIAL_ROUNDS / margin_steps(trial)))


def margin_steps(trial: Mapping[str, Sequence[Step]]) -> int:
    """:func:`margin`'s ``n``: a hint's fewest steps, within ``TRIAL_ROUNDS .. + EXTRA_ROUNDS``."""
    n = min((len(v) for v in trial.values() if v), default=TRIAL_ROUNDS)
    return min(max(n, TRIAL_ROUNDS), TRIAL_ROUNDS + EXTRA_ROUNDS)


EXTRA_ROUNDS = 3
"""Rounds of two hints more where the trial's steps were too noisy to decide
(:func:`undecided`): the fastest by median beat the hint :func:`keep` keeps by more than the
tie, but not by the steps' spread. Three rounds of the two double their steps, which narrows
the margin by ``sqrt(1/2)`` (:func:`margin`): at most six more steps, once per run (not on a
re-check). Decided by the suite and the oracle together: within 2% of the best candidate at
363 of 378 points (355 without), the oracle's V=2 minimum 0.963 (0.931)."""


def undecided(trial: Mapping[str, Sequence[Step]], strict: str | None, tie: float = TIE, *,
              prefer: Sequence[str] | None = None) -> list[str]:
    """The two hints :data:`EXTRA_ROUNDS` more rounds decide between: ``[kept, fastest]`` where
    :func:`keep` keeps another hint than the fastest by median and the fastest beat it by more
    than ``tie`` (only the steps' spread kept it); ``[]`` where the trial decided."""
    med = medians(trial)
    if not med:
        return []
    fastest = min(med, key=lambda h: med[h])
    kept = keep(trial, strict, tie, prefer=prefer)
    return [kept, fastest] if kept != fastest and med[fastest] < (1 - tie) * med[kept] else []


def decided_on(trial: Mapping[str, Sequence[Step]], extension: Sequence[str]) -> Mapping[str, Sequence[Step]]:
    """The steps the first choice is made on: after extra rounds (``extension``, the pair
    :func:`undecided` named) their two hints' alone, the third having lost in the trial; else
    the whole trial."""
    return {h: trial[h] for h in extension} if extension else trial


def preference(hints: Sequence[str], strict: str | None, prefer: Sequence[str] | None = None) -> list[str]:
    """``hints`` in ``auto``'s fixed order of preference: ``strict`` first, then the order of
    ``prefer`` (default: :func:`~rrfp.sim.auto.all_candidates`' order), then any others by name. It decides among
    hints measured within :data:`TIE` of each other (:func:`keep`), so noise below the tie
    cannot flip a choice."""
    order = list(prefer) if prefer is not None else list(auto_candidates())
    rank_of = {h: i for i, h in enumerate(dict.fromkeys(order))}
    return sorted(hints, key=lambda h: (h != strict, rank_of.get(h, len(rank_of)), h))


def keep(trial: Mapping[str, Sequence[Step]], strict: str | None, tie: float = TIE, *,
         incumbent: str | None = None, prefer: Sequence[str] | None = None) -> str:
    """Which hint to keep from trial steps. The hint of the smallest median of :func:`scaled`
    step times is the fastest; a hint whose median the fastest does not beat by more than
    :func:`margin` (``tie``, or the steps' measured :func:`spread` where larger; a fraction of
    that hint's median) is *tied* with it. Among the tied: the
    ``incumbent`` (a re-check never switches to a hint within the tie), else the first in
    :func:`preference` (``strict``, then ``prefer``'s order). So a policy measured slower than
    ``strict`` is never kept, nor one faster by less than the tie or than the steps' own
    noise, and two policies within the tie of each other are decided by the fixed order.

    Args:
        trial: hint -> its trial steps (:data:`Step`; one per round).
        strict: the placement's strict schedule (None: none).
        incumbent: the hint kept so far (a re-check's; None: the first choice).
        prefer: the order of preference after ``strict`` (default: :func:`~rrfp.sim.auto.all_candidates`').

    Raises:
        ValueError: no hint has a step.
    """
    med = medians(trial)
    if not med:
        raise ValueError("auto: no trial step time to choose from")
    fastest, need = min(med.values()), margin(trial, tie)
    tied = [h for h, t in med.items() if t == fastest or fastest > (1 - need) * t]
    if incumbent in tied:
        return incumbent  # type: ignore[return-value]
    return preference(tied, strict, prefer)[0]
