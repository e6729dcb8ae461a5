"""The ``auto`` hint on real steps: choose the hint on this job's own steps.

The default of :class:`~rrfp.runtime.doors.pipeline.Pipeline`, :class:`~rrfp.runtime.doors.local.LocalPipeline`
and ``rrfp train``. The plan, the same on every rank (each decision reads only figures all ranks
share, :class:`~rrfp.runtime.features.share.Share`, so every rank switches to the same hint
before the same step):

1. Step 1 runs the placement's strict schedule (its one-time costs are not measured).
2. Steps 2 and 3 measure: the strict schedule (``F``, ``B``), then the first split-backward
   candidate (``I``, ``W``). Every rank's task records are gathered; per stage and kind the
   mean seconds and the spread; under a memory budget, every microbatch's activation bytes as
   the rank's sizer measured them (the ranking simulates those sizes, and a microbatch's seconds
   in proportion to them: :mod:`rrfp.sim.sized`); what the runtime pays around them, the calibrated model of
   :mod:`rrfp.sim.calibration` (:func:`~rrfp.sim.calibration.fit`: the runtime's time per
   task and per input received from another rank, and per link the mean time a consumer that
   waited for a message waited, from the producer's end to its own start, less the receiving
   the task that consumes it spends, as in ``rrfp bench``'s predictions
   (:attr:`~rrfp.sim.calibration.Calibration.recv_in_hop`); the ranks of one host share a
   monotonic clock).
3. :func:`rrfp.sim.auto.rank` simulates every known candidate on that profile and calibration
   at every rank's own in-flight limit and memory budget (shared while measuring).
4. Trial: the strict schedule and the best two by simulation
   (:func:`rrfp.sim.trial.trial_candidates`) run :data:`rrfp.sim.trial.TRIAL_ROUNDS` rounds,
   one step each, in rotating order (paired: each round's steps are neighbours, so machine
   drift cancels); the step time is the slowest rank's, and the elements of the step's input
   tensors measure its batch's work (a figure no hint changes). :func:`rrfp.sim.trial.keep`
   decides (the smallest median of step times adjusted to the trial's median batch work; among the hints within
   :data:`rrfp.sim.trial.TIE` of it, or within the trial steps' own spread where that is
   larger (:func:`rrfp.sim.trial.margin`), the strict schedule, else the first in the fixed order of
   :func:`rrfp.sim.auto.all_candidates`, so a policy measured slower than the strict schedule is
   never kept and noise below the tie cannot flip the choice), the rule the suite's ``auto``
   uses too. Where the fastest beat the hint kept so by more than the tie but not by the
   steps' spread (:func:`rrfp.sim.trial.undecided`), the two run
   :data:`rrfp.sim.trial.EXTRA_ROUNDS` more rounds first (once, where the run has room) and
   the choice is made between them, the margin narrowed as their medians' noise is.
5. Every ``recheck_every`` steps (default :data:`RECHECK_EVERY`; 0: never) one more round is
   measured and the choice is made again over every round so far; it switches only to a hint
   measured faster than the kept one by more than that margin (the kept one is the incumbent
   of :func:`~rrfp.sim.trial.keep`).

Under a memory budget a strict order cannot wait for bytes (it holds what its order holds), so
the measuring steps run the first candidates the budget gates instead (``bf``, then ``bfw-mem``
for ``I`` and ``W``: :meth:`AutoHint._gate`), the ranking drops a candidate whose simulated peak
breaks the budget while another holds to it (:func:`rrfp.sim.auto.rank`; then the strict schedule
is neither tried nor kept), and a run too short to choose runs ``bf``. Whether any rank has a
budget is shared after the first step, which alone runs each process's own plan.

Between re-checks a step runs what the kept hint run directly runs: a switch to a full backward
gives the stage modules' affine layers their own forwards back (the split candidates route them
through a Python autograd Function, 5-8% slower forwards on the bench's stages: :meth:`RankRuntime.set_hint
<rrfp.runtime.engine.rank.RankRuntime.set_hint>`), and task records are kept only while
measuring (or where the caller asked for them).

A choice recorded by an earlier run (``rrfp train`` writes it to the checkpoint's ``rrfp.json``
as ``"hint"``) is kept by :meth:`AutoHint.adopt` without measuring or a trial: a resumed run
runs what the run before it chose.

One process says, one line each, which steps measure and which run the trial (with the
candidates) before they run, and what was kept and why. The candidates are
:func:`rrfp.sim.auto.all_candidates` (the hint table's entries that allow auto); names that do
not fit the shape are skipped and named in the last line.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence

from ...errors import PipelineError
from ...scheduler.hints import resolve_hint
from ...scheduler.tasks import PipelineSpec, Task, TaskRecord
from ...sim import auto as sim_auto
from ...sim import trial as sim_trial
from ...sim.auto import AUTO, auto_first_hint
from ...sim.trial import EXTRA_ROUNDS, TIE, TRIAL_ROUNDS
from ...sim.calibration import Calibration, Fit, RankStep, fit
from .recheck import RECHECK_EVERY, check_recheck, recheck_steps
from .share import Share

__all__ = ["AUTO", "RECHECK_EVERY", "TIE", "TRIAL_ROUNDS", "AutoHint", "check_recheck", "recheck_steps"]

def _size_item(item: Sequence[Any], n_stages: int, n_microbatches: int) -> tuple[int, int, int]:
    """``(stage, microbatch, bytes)`` of a gathered ``("s", stage, microbatch, bytes)`` item.

    Raises:
        PipelineError: an item this code cannot send (a peer running other code), named the
            same way on every process (a list, as msgpack delivers a peer's tuple, reads as one).
    """
    ok = len(item) == 4 and all(type(x) is int for x in item[1:])
    if not (ok and 0 <= item[1] < n_stages and 0 <= item[2] < n_microbatches and 0 <= item[3] <= 2**53):
        raise PipelineError(f"auto: a malformed activation size item {tuple(item)!r}: expected ('s', stage "
                            f"0..{n_stages - 1}, microbatch 0..{n_microbatches - 1}, bytes 0..2**53)")
    return item[1], item[2], item[3]


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _check_item(item: Any, n_stages: int, n_microbatches: int, n_ranks: int) -> None:
    """Refuse a gathered item this code cannot send (a peer running other code) before any
    figure is taken from it: every process sees the same items, so each raises the same error.

    Raises:
        PipelineError: naming the item and the form expected of its kind.
    """
    shown = tuple(item) if isinstance(item, (list, tuple)) else item
    kind = shown[0] if isinstance(shown, tuple) and shown else None
    S, M = f"stage 0..{n_stages - 1}", f"microbatch 0..{n_microbatches - 1}"
    forms = {"r": f"('r', {S}, kind F/B/I/W, {M}, start, end (finite seconds, start <= end), last step (bool))",
             "l": f"('l', rank 0..{n_ranks - 1}, in-flight limit >= 1, memory budget (None or positive bytes))",
             "a": f"('a', {S}, mean bytes 0..2**53)"}
    ok = False
    if kind == "r" and len(shown) == 7:
        _, s, k, m, t0, t1, last = shown
        ok = (type(s) is int and 0 <= s < n_stages and k in ("F", "B", "I", "W") and type(m) is int
              and 0 <= m < n_microbatches and _number(t0) and _number(t1) and t0 <= t1 and type(last) is bool)
    elif kind == "l" and len(shown) == 4:
        _, r, lim, b = shown
        ok = (type(r) is int and 0 <= r < n_ranks and type(lim) is int and lim >= 1
              and (b is None or (_number(b) and 0 < b <= 2**62)))
    elif kind == "a" and len(shown) == 3:
        ok = type(shown[1]) is int and 0 <= shown[1] < n_stages and type(shown[2]) is int and 0 <= shown[2] <= 2**53
    elif kind == "s":
        return  # _size_item's
    if not ok:
        expected = forms.get(kind, "a sequence whose first field is 'r', 'l', 'a' or 's'")
        raise PipelineError(f"auto: a malformed item {shown!r}: expected {expected}")


def step_figures(hint: str, stats: Sequence[Any]) -> tuple[float, float]:
    """This process's part of a step's figures: ``(seconds, batch work)``, its ranks' slowest
    step time and the elements of the step's input tensors they fed
    (:attr:`~rrfp.runtime.engine.rank.StepStats.input_elems`; 0 on a process without stage 0)."""
    wall = max((float(st.wall) for st in stats), default=0.0)
    return wall, float(sum(st.input_elems for st in stats))


class AutoHint:
    """The ``auto`` controller of one process (plan in the module docstring): the front door
    (or ``rrfp train``, per optimizer step) calls :meth:`before_step` and :meth:`after_step`
    around each training step; forward-only steps are not counted.

    Args:
        pipe: the front door, built with the placement's strict schedule (``Plan.auto``).
        share: how the ranks share figures (:mod:`rrfp.runtime.features.share`:
            ``LocalShare``, ``DistShare``, ``ControlShare``).
        say: writes the process's lines (None: silent; give it on one process only).
        recheck_every: steps between re-checks (0: never); a re-check switches only to a
            hint measured faster than the kept one beyond :func:`rrfp.sim.trial.margin`.
        same_backward: only candidates with the strict schedule's backward form (bitwise
            reproducible runs: a split backward computes the same gradients by another path).

    Attributes:
        chosen: the hint kept (None until the trial's last round, and throughout a run
            :meth:`run_length` found too short to choose, which runs the strict schedule);
            current: the hint the next step runs; trial: the trial's hints; extension: the
            two hints of the trial's extra rounds (empty: none ran).
        adopted: the choice was taken from an earlier run (:meth:`adopt`), not measured here.
        measure: ``measure(hint, stats) -> (seconds, batch work)`` of this process's
            ranks' stats of a step (default :func:`step_figures`); tests replace it to force
            step times.

    Raises:
        ValueError: ``recheck_every`` not an integer >= 0.
    """

    def __init__(self, pipe: Any, share: Share, *, say: Callable[[str], None] | None = None,
                 recheck_every: int = RECHECK_EVERY, same_backward: bool = False) -> None:
        check_recheck(recheck_every)
        place = pipe.spec.placement
        self.pipe, self.share = pipe, share
        self.limits, self.budget = list(pipe.plan.limits), pipe.plan.budget
        self.backpressure = pipe.config.backpressure
        self.say = say
        self.recheck_every = recheck_every
        self.place, self.M = place, pipe.n_microbatches
        self.known, self.skipped = sim_auto.known_candidates(place.n_ranks, place.n_virtual, place.kind, self.M)
        self.strict = auto_first_hint(place, self.M, known=self.known)
        if same_backward:
            form = self._splits(self.strict)
            self.skipped += [(c, "another backward form than a deterministic run keeps")
                             for c in self.known if self._splits(c) != form]
            self.known = [c for c in self.known if self._splits(c) == form]
        self.split = next((c for c in self.known if self._splits(c)), None)
        # What runs when no choice is made (a run too short): the strict schedule, or under a
        # memory budget the first candidate the budget gates (_gate).
        self.fallback = self.strict
        self.gated = False
        self.current = self.strict
        self.plan: list[str] = [self.strict, self.strict] + ([self.split] if self.split else [])
        if self.budget is not None:
            self._gate()
        self.samples: dict[tuple[int, str], list[float]] = {}
        self.measured: list[tuple[bool, list[TaskRecord]]] = []  # (split backward?, records) per measured step
        self.act: dict[int, int] = {}
        # Per measured step, stage -> microbatch -> the bytes its forward held (the sizer's).
        self.sizes: list[dict[int, dict[int, int]]] = []
        self.sample_bytes: dict[tuple[int, str], list[int]] = {}  # beside samples: each one's bytes
        self.rank_memory: dict[int, tuple[int, int | None]] = {}  # rank -> its own (limit, budget)
        self.trial: list[str] = []
        self.walls: dict[str, list[sim_trial.Step]] = {}
        self.extension: list[str] = []  # the two hints of the trial's extra rounds (none: none ran)
        self.chosen: str | None = None
        self.ranking: sim_auto.Ranking | None = None
        self.measure: Callable[[str, Sequence[Any]], tuple[float, float]] = step_figures
        self._record = [rt.loop.record for rt in pipe.runtimes]
        self.too_short = self.adopted = False
        self.run_steps: int | None = None
        self.steps = 0

    def run_length(self, steps: int) -> None:
        """This run makes ``steps`` more steps (call before the first): fewer than
        :meth:`steps_needed` keeps the strict schedule throughout, said in one line.

        Raises:
            ValueError: ``steps`` not an integer >= 0.
            RuntimeError: called after this controller's first step.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"run_length({steps!r}): expected the run's number of steps, an integer >= 0")
        if self.steps:
            raise RuntimeError(f"run_length({steps}) after {self.steps} steps: call it before the first step")
        self.run_steps = steps
        if self.adopted:
            return  # nothing to measure: the adopted choice runs throughout
        self.too_short = steps < self.steps_needed()
        if self.too_short:
            self.plan = []
            if self.say:
                self.say(f"hint auto: a run of {steps} step{'s' if steps != 1 else ''} is too short to "
                         f"measure and try candidates (needs at least {self.steps_needed()}); it runs {self.fallback}"
                         f"{self._gated_why()}")

    def adopt(self, hint: Any, source: str = "an earlier run") -> bool:
        """Keep ``hint``, the choice an earlier run of this job made (``rrfp train`` reads it
        from the checkpoint it resumes, ``rrfp.json``'s ``"hint"``), without measuring or a
        trial: from the next step every rank this process runs it (switched through
        :meth:`FrontDoor.set_hint <rrfp.runtime.doors.front.FrontDoor.set_hint>`), and no
        re-check runs. Call it on every process of the pipeline with the same ``hint``,
        before the first step. ``source`` names where the choice was read, for the line.

        Returns:
            True: adopted. False (said in one line): ``hint`` is not one of this pipeline's
            candidates (``known``: another placement's, another build's, or another backward
            form than a deterministic run keeps); the run measures and chooses as usual.

        Raises:
            RuntimeError: called after this controller's first step.
        """
        if self.steps:
            raise RuntimeError(f"adopt({hint!r}) after {self.steps} steps: call it before the first step")
        if hint not in self.known:
            if self.say:
                self.say(f"hint auto: {source} kept {str(hint)[:80]!r}, not a candidate of this pipeline "
                         f"({', '.join(self.known)}); measuring anew")
            return False
        if hint != self.current:
            self.pipe.set_hint(hint)
            self.current = hint
        self.plan, self.chosen, self.too_short, self.adopted = [], hint, False, True
        if self.say:
            self.say(f"hint auto: keeps {hint}, the choice of {source} (no measuring, no trial, no re-check; "
                     f"--hint {hint} pins it)")
        return True

    def steps_needed(self) -> int:
        """Steps before a choice at the least: the measuring steps, then the trial's rounds of
        the strict schedule and one more candidate."""
        return (3 if self.split else 2) + 2 * TRIAL_ROUNDS

    def unchosen(self) -> str | None:
        """One line for a pipeline closed before a choice (None: a choice was made or no step ran)."""
        if self.chosen is not None or self.too_short or not self.steps:
            return None
        left = len(self.plan) if self.ranking is not None else max(1, self.steps_needed() - self.steps)
        return (f"hint auto: closed after {self.steps} step{'s' if self.steps != 1 else ''}, "
                f"{'' if self.ranking is not None else 'at least '}{left} more were needed for a choice; "
                f"the last ran {self.current} "
                f"(run_length() keeps {self.fallback} throughout a run too short to choose)")

    def _splits(self, name: str) -> bool:
        return resolve_hint(name, self.place, self.M)[0].split_backward

    def _held(self, name: str) -> bool:
        # A policy in readiness mode: the memory budget gates every forward it runs (a strict
        # order runs its order, and wfloat keeps its order's forwards: both hold what their
        # order holds where that is more than the budget).
        _, hint, strict = resolve_hint(name, self.place, self.M)
        return not strict and hint.order is None

    def _gate(self) -> None:
        """Under a memory budget, measure with (and fall back to) the first candidates the budget
        gates, a full and a split backward: a strict order cannot wait for bytes, so it holds what
        its order holds whatever the budget. Nothing changes where none is a candidate."""
        full = next((c for c in self.known if self._held(c) and not self._splits(c)), None)
        split = next((c for c in self.known if self._held(c) and self._splits(c)), None)
        if not full or (split is None) != (self.split is None):
            return  # (the count of measuring steps stays what every process planned)
        self.gated, self.fallback, self.split = True, full, split
        n = len(self.plan) - (1 if split else 0)  # the full backward's steps left
        self.plan = [full] * n + ([split] if split else []) if self.plan else []

    async def _agree_on_gating(self) -> None:
        # After the first step every process knows whether any rank was given a budget: all then
        # measure alike (ranks of one step running a strict order and a gated hint could wait on
        # each other for good). Only the first step can differ, where processes were given a
        # budget and others none.
        if await self.share.max(1 if self.budget is not None else 0) and not self.gated:
            self._gate()
            if self.gated and self.say:
                runs = ", ".join(dict.fromkeys(self.plan[1:])) or self.fallback  # plan[0]: the step just run
                self.say(f"hint auto: a rank was given a memory budget: {runs} from the next step{self._gated_why()}")

    def _gated_why(self) -> str:
        if self.fallback == self.strict:
            return ""
        return (f" (under the memory budget: {self.strict} cannot wait for bytes, "
                f"{self.fallback} holds to the budget)")

    def before_step(self, k: int) -> None:
        """Set the hint of step ``k`` (0-based, counted from this run's first step)."""
        if k == 0 and self.say and self.ranking is None and self.plan:
            n = len(self.plan)
            self.say(f"hint auto: steps 1-{n} of this run measure costs ({self.plan[0]} warms up, "
                     f"then {', '.join(self.plan[1:])}), then {TRIAL_ROUNDS} trial rounds of one step per candidate")
        want = self.plan[0] if self.plan else (self.chosen or self.fallback)
        if want != self.current:
            self.pipe.set_hint(want)
            self.current = want
        # Task records while measuring costs (the trial reads only step times).
        for rt, keep in zip(self.pipe.runtimes, self._record):
            rt.loop.record = keep or (bool(self.plan) and self.ranking is None)

    async def after_step(self, k: int, stats: Sequence[Any]) -> None:
        """Book step ``k``'s figures from this process's ranks' ``stats`` (every process
        calls it: it shares figures through :attr:`share`)."""
        self.steps = k + 1
        if k == 0 and not self.adopted:
            await self._agree_on_gating()
        if not self.plan:
            if self.recheck_every and (k + 1) % self.recheck_every == 0 and self.chosen and self.trial:
                self.plan = sim_trial.trial_order(self.trial, len(self.walls.get(self.trial[0], [])))
            return
        step_hint = self.plan.pop(0)
        if self.ranking is None:
            if len(self.plan) < (3 if self.split else 2) - 1:  # not the warm-up step
                await self._gather(stats, self._splits(step_hint))
            if not self.plan:
                self._rank()
                self.plan = [h for r in range(TRIAL_ROUNDS) for h in sim_trial.trial_order(self.trial, r)]
                if self.run_steps is not None and k + 1 + len(self.plan) > self.run_steps:
                    # A trial of three candidates that the run would end inside: none is kept.
                    self.plan, self.too_short = [], True
                    if self.say:
                        self.say(f"hint auto: a run of {self.run_steps} steps is too short to try "
                                 f"{', '.join(self.trial)} ({len(self.trial) * TRIAL_ROUNDS} trial steps after "
                                 f"{k + 1} measuring); it runs {self.fallback}{self._gated_why()}")
                    return
                if self.say:
                    assert self.ranking is not None
                    self.say(f"hint auto: steps {k + 2}-{k + 1 + len(self.plan)} of this run are the trial: "
                             f"{', '.join(self.trial)}, {TRIAL_ROUNDS} rounds of one step each "
                             f"({self.ranking.reason()})")
            return
        # The step's input elements over every rank: its batch's work (rrfp.sim.trial.scaled).
        wall, work = self.measure(step_hint, stats)
        wall, work = await self.share.max(wall), await self.share.sum(work)
        self.walls.setdefault(step_hint, []).append((wall, work))
        if not self.plan:  # the trial's last round (or a re-check's round) is complete
            if self.chosen is None and not self.extension and self._extend(k):
                return
            self._choose()

    def _extend(self, k: int) -> bool:
        # The trial left the choice to its steps' noise: its fastest and the hint keep() keeps
        # run EXTRA_ROUNDS more rounds (rrfp.sim.trial.undecided), once, where the run has room.
        pair = sim_trial.undecided(self.walls, self.strict, prefer=self.known)
        n = len(pair) * EXTRA_ROUNDS
        if not pair or (self.run_steps is not None and k + 1 + n > self.run_steps):
            return False
        self.extension = pair
        self.plan = [h for r in range(EXTRA_ROUNDS) for h in sim_trial.trial_order(pair, r)]
        if self.say:
            med = sim_trial.medians(self.walls)
            self.say(f"hint auto: steps {k + 2}-{k + 1 + n} of this run try {pair[1]} and {pair[0]} "
                     f"{EXTRA_ROUNDS} more rounds each: {pair[1]} measured {100 * (1 - med[pair[1]] / med[pair[0]]):.1f}% "
                     f"faster, within the steps' spread ({100 * sim_trial.margin(self.walls):.1f}%)")
        return True

    async def _gather(self, stats: Sequence[Any], split: bool) -> None:
        # Last field: the record is of the rank's last pipeline step, the one whose bytes the sizer
        # holds (rrfp train --grad-accum hands several pipeline steps' records in one step's stats).
        mine: list = []
        for st in stats:
            last = max((rec.step for rec in st.records), default=None)
            mine += [("r", rec.task.stage, rec.task.kind, rec.task.mb, rec.start, rec.end, rec.step == last)
                     for rec in st.records]
        for rt in self.pipe.runtimes:
            # Each rank's own in-flight limit and budget: another process may have been given
            # other values, and every rank must rank on the same ones (or their trials differ).
            mine.append(("l", rt.rank, int(rt.inflight_limit), rt.memory_budget))
            sizer = rt.sizer  # the memory budget's measured activation bytes (None: no budget)
            if sizer is not None:
                for s in rt.stages:
                    got = [sizer(s, m) for m in range(self.M)]
                    mine.append(("a", s, round(statistics.fmean(x for x in got if x)) if any(got) else 0))
                    # Each microbatch's own bytes: the ranking simulates the sizes this job has.
                    mine += [("s", s, m, int(b)) for m, b in enumerate(got) if b]
        items = await self.share.gather(mine)
        for item in items:
            _check_item(item, self.place.n_stages, self.M, self.place.n_ranks)
        sizes: dict[int, dict[int, int]] = {}
        for item in items:
            if item[0] == "s":
                s, m, b = _size_item(item, self.place.n_stages, self.M)
                sizes.setdefault(s, {})[m] = b
        self.sizes.append(sizes)
        recs: list[TaskRecord] = []
        for item in items:
            if item[0] == "a":
                self.act[item[1]] = item[2]
                continue
            if item[0] == "l":
                self.rank_memory[item[1]] = (item[2], item[3])
                continue
            if item[0] == "s":
                continue
            _, s, kind, m, t0, t1, sized = item
            self.samples.setdefault((s, kind), []).append(t1 - t0)
            # 0: bytes not measured (profile_from_samples leaves the sample out of the spread's pairs)
            self.sample_bytes.setdefault((s, kind), []).append(sizes.get(s, {}).get(m, 0) if sized else 0)
            recs.append(TaskRecord(self.place.rank_of(s), self.steps, Task(s, kind, m), t0, t1))
        self.measured.append((split, recs))

    def measured_sizes(self) -> list[list[list[int]]]:
        """Per measured step, per stage, each microbatch's activation bytes as the ranks measured
        them (:attr:`rrfp.sim.auto.Profile.sizes`); empty unless every stage's every microbatch
        was measured in every measuring step (a rank without a memory budget measures none)."""
        S, M = self.place.n_stages, self.M
        if not self.sizes or any(len(st.get(s, ())) != M for st in self.sizes for s in range(S)):
            return []
        return [[[st[s][m] for m in range(M)] for s in range(S)] for st in self.sizes]

    def _fit(self) -> Fit | None:
        """What the runtime paid around the measured tasks (:func:`rrfp.sim.calibration.fit`;
        the ranks of one host share a monotonic clock), or None with too few tasks to tell."""
        steps = []
        for split, recs in self.measured:
            spec = PipelineSpec(self.place, self.M, split)
            by_rank: dict[int, list[TaskRecord]] = {}
            for r in recs:
                by_rank.setdefault(r.rank, []).append(r)
            steps.append((spec, [RankStep(r, rs) for r, rs in by_rank.items()]))
        try:
            fits = [fit([ranks], spec) for spec, ranks in steps]
        except ValueError:
            return None
        task, recv = (statistics.fmean(getattr(f.calibration, k) for f in fits) for k in ("task", "recv"))
        # A link's figure is what a waiting consumer waited, its receiving included; the task
        # that receives spends recv: the message flies the rest (Calibration.recv_in_hop, the
        # model rrfp bench predicts with), else a waited-for input would count its receiving twice.
        cal = Calibration(task=task, recv=recv, recv_in_hop=True)
        links = {s: cal.flight(statistics.median([f.links[s] for f in fits if s in f.links]))
                 for s in {s for f in fits for s in f.links}}
        return Fit(cal, links, {})

    def memory(self) -> tuple[list[int], list[int | None] | None]:
        """``(limits, budgets)``: per rank, the in-flight limit and memory budget the ranking
        uses, each rank's own as it shared them while measuring (this process's plan for a rank
        that did not); a budget only where that rank's activation bytes were measured (None:
        no budget anywhere)."""
        P, place = self.place.n_ranks, self.place
        limits = [self.rank_memory.get(r, (self.limits[r], None))[0] for r in range(P)]
        budgets = [self.rank_memory[r][1] if r in self.rank_memory else self.budget for r in range(P)]
        budgets = [b if b is not None and all(self.act.get(s) for s in place.stages_of(r)) else None
                   for r, b in enumerate(budgets)]
        return limits, (budgets if any(b is not None for b in budgets) else None)

    def _rank(self) -> None:
        S = self.place.n_stages
        # The calibrated model (rrfp.sim.calibration): each task's measured cost, the runtime's
        # time per task and per received input beside it, per link what a waiting consumer waited.
        fitted = self._fit()
        links = {s: [h] for s, h in fitted.links.items()} if fitted else {}
        prof = sim_auto.profile_from_samples(self.samples, links, S, [self.act.get(s, 0) for s in range(S)],
                                             self.measured_sizes(), self.sample_bytes)
        limits, budgets = self.memory()
        self.ranking = sim_auto.rank(prof, n_ranks=self.place.n_ranks, n_virtual=self.place.n_virtual,
                                     placement=self.place.kind, n_microbatches=self.M, limit=limits,
                                     memory_budget=budgets, backpressure=self.backpressure, candidates=self.known,
                                     calibration=fitted.calibration if fitted else None)
        self.profile = prof
        if self.ranking.strict is None and budgets is not None:
            # The strict schedule broke the budget in the ranking's simulation (rrfp.sim.auto.rank
            # drops a candidate that does where another holds to it): neither tried nor kept.
            self.fallback = self.ranking.best
        self.trial = sim_trial.trial_candidates([h for h, _ in self.ranking.order], self.ranking.strict)

    @staticmethod
    def _narrowed(trial: dict) -> str:
        # Said, or a reader sees the extra rounds' "spread (27.0%)" become "beyond 10.3%" unexplained.
        n = sim_trial.margin_steps(trial)
        return f" x sqrt({TRIAL_ROUNDS}/{n}), {n} steps each" if n > TRIAL_ROUNDS else ""

    def _choose(self) -> None:
        # A re-check's incumbent stays unless another hint was measured faster beyond the margin.
        before = self.chosen
        # The first choice after an extension is between its two hints (the third lost already).
        trial = sim_trial.decided_on(self.walls, self.extension if before is None else [])
        med = sim_trial.medians(trial)
        best = sim_trial.keep(trial, self.strict, incumbent=before, prefer=self.known)
        changed = best != before
        self.chosen = best
        need = sim_trial.margin(trial)
        if self.say and changed and before is not None:
            self.say(f"hint auto: the re-check after step {self.steps} measured {best} faster than {before} by more "
                     f"than {100 * need:.1f}%: it runs {best} from the next step")
        if self.say and changed:
            walls = ", ".join(f"{h} {1e3 * med[h]:.1f} ms" for h in sorted(med, key=med.get))
            assert self.ranking is not None
            n = len(self.walls[best])
            self.say(f"hint auto chose {best}: median step over {n} trial step{'s' if n != 1 else ''} "
                     f"(at the trial's median batch work): {walls}; faster counts beyond {100 * need:.1f}% "
                     f"(the tie {100 * TIE:g}% or the steps' spread{self._narrowed(trial)}) "
                     f"(measured {self.profile.describe()}; {self.ranking.reason()})")
