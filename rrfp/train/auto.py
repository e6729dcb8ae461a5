"""``rrfp train --hint auto``: choose the hint on this job's own steps.

The plan, the same on every rank (each decision reads only figures all ranks share through the
default process group, so every rank switches to the same hint before the same step):

1. Step 1 runs the placement's strict schedule (its one-time costs are not measured).
2. Steps 2 and 3 measure: the strict schedule (``F``, ``B``), then the first split-backward
   candidate (``I``, ``W``). Every rank's task records are gathered; per stage and kind the
   mean seconds and the spread; per link the message time, read as the gap between the
   producer's end and the consumer's start (the ranks of one host share a monotonic clock; the
   smallest gap per link, since a larger one includes the consumer's wait).
3. :func:`rrfp.sim.auto.rank` simulates every known candidate on that profile at this job's
   in-flight limit and memory budget.
4. Trial: the strict schedule and the best two by simulation
   (:func:`rrfp.sim.auto.trial_candidates`) run :data:`rrfp.sim.auto.TRIAL_ROUNDS` rounds,
   one step each, in rotating order (paired: each round's steps are neighbours, so machine
   drift cancels); the step time is the slowest rank's, and the step's forward seconds over
   every rank measure its batch's work. :func:`rrfp.sim.auto.keep` decides (the smallest
   median of step times rescaled to the trial's median work; the strict schedule on a tie
   within :data:`rrfp.sim.auto.TIE`, so a policy measured slower than it is never kept), the
   rule the suite's ``auto`` uses too.
5. Every ``recheck_every`` steps one more round is measured and the choice is made again over
   every round so far.

Rank 0 says, one line each, which steps measure and which run the trial (with the candidates)
before they run, and what was kept and why. The candidates are
:data:`rrfp.sim.auto.CANDIDATES`; names this build's registry does not know are skipped and
named in the last line.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..scheduler.hints import resolve_hint
from ..scheduler.tasks import B, F, I, W
from ..sim import auto as sim_auto
from ..sim.auto import AUTO, TIE, TRIAL_ROUNDS

__all__ = ["AUTO", "TIE", "TRIAL_ROUNDS", "AutoHint", "switch_hint"]

RECHECK_EVERY = 50
"""Steps between re-checks: one more trial round (three steps) per 50, about 6% of steps run a
candidate other than the kept one, most of them within a few percent of it."""


def switch_hint(pipe: Any, text: str, limits: Sequence[int], backpressure: str = "admission") -> None:
    """Make ``pipe`` (a :class:`rrfp.runtime.pipeline.Pipeline`) run ``text`` from its next step.

    Raises:
        ValueError: a hint that does not resolve for the pipeline's placement.
    """
    from ..runtime.split import enable_split_backward

    spec, hint, strict = resolve_hint(text, pipe.spec.placement, pipe.n_microbatches, inflight_limit=list(limits),
                                      backpressure=backpressure)
    rt = pipe.runtime
    if spec.split_backward:
        for st in rt.stages.values():
            if st.dw_builder is None:  # idempotent; a full backward still works on routed layers
                enable_split_backward(st.submod)
    pipe.spec = rt.spec = spec
    pipe.hint = rt.hint = hint
    pipe.strict = rt.strict = strict
    rt.hooks.final_kind = W if spec.split_backward else B


class AutoHint:
    """The ``auto`` controller of one rank (plan in the module docstring).

    Args:
        pipe: the rank's pipeline, built with :meth:`first_hint`.
        limits: every rank's in-flight limit.
        memory_budget: bytes per rank (None: none).
        backpressure: the job's backpressure mode.
        say: writes rank 0's line.
        recheck_every: steps between re-checks (0: never).

    A run too short to measure and try the candidates (:meth:`run_length`) runs the strict
    schedule throughout and says so, instead of announcing steps it will never make.
    """

    def __init__(self, pipe: Any, limits: Sequence[int], *, memory_budget: int | None = None,
                 backpressure: str = "admission", say: Callable[[str], None] | None = None,
                 recheck_every: int = RECHECK_EVERY, rank: int = 0, same_backward: bool = False) -> None:
        place = pipe.spec.placement
        self.pipe, self.limits, self.budget, self.backpressure = pipe, list(limits), memory_budget, backpressure
        self.say = say if rank == 0 else None
        self.recheck_every = recheck_every
        self.place, self.M = place, pipe.n_microbatches
        self.known, self.skipped = sim_auto.known_candidates(place.n_ranks, place.n_virtual, place.kind, self.M)
        if same_backward:
            # --deterministic promises the numbers of a run that never stopped, whatever ran
            # when; a split backward computes the same gradients by another path (other bits),
            # so only the placement's strict schedule's backward form stays a candidate.
            form = self._splits(self.known[0])
            self.skipped += [(c, "another backward form than --deterministic keeps")
                             for c in self.known if self._splits(c) != form]
            self.known = [c for c in self.known if self._splits(c) == form]
        self.strict = next((c for c in self.known if c.startswith("strict-")), self.known[0])
        self.split = next((c for c in self.known if self._splits(c)), None)
        self.current = self.strict
        self.plan: list[str] = [self.strict, self.strict] + ([self.split] if self.split else [])
        self.samples: dict[tuple[int, str], list[float]] = {}
        self.gaps: dict[int, list[float]] = {}
        self.act: dict[int, int] = {}
        self.trial: list[str] = []
        self.walls: dict[str, list[sim_auto.Step]] = {}
        self.chosen: str | None = None
        self.ranking: sim_auto.Ranking | None = None
        self._record = pipe.runtime.loop.record
        self.too_short = False

    def run_length(self, steps: int) -> None:
        """This run makes ``steps`` more steps (call before the first): fewer than
        :meth:`steps_needed` keeps the strict schedule throughout, said in one line."""
        self.too_short = steps < self.steps_needed()
        if self.too_short:
            self.plan, self.chosen = [], self.strict
            if self.say:
                self.say(f"rrfp train: hint auto: a run of {steps} step{'s' if steps != 1 else ''} is too short to "
                         f"measure and try candidates (needs at least {self.steps_needed()}); it runs {self.strict}")

    def steps_needed(self) -> int:
        """Steps before a choice at the least: the measuring steps, then the trial's rounds of
        the strict schedule and one more candidate."""
        return (3 if self.split else 2) + 2 * TRIAL_ROUNDS

    def _splits(self, name: str) -> bool:
        return resolve_hint(name, self.place, self.M)[0].split_backward

    @staticmethod
    def strict_limits(placement: Any, n_microbatches: int, backpressure: str = "admission") -> list[int]:
        """Every rank's in-flight limit that holds the placement's strict schedule's own peak
        (:func:`rrfp.runtime.config.schedule_limits`; 1F1B: ``p - r``): the memory ``auto``'s
        candidates run at when the user gives neither an in-flight limit nor a memory budget,
        so that trying a policy never holds more activations than the fixed schedule does."""
        from ..runtime.config import RuntimeConfig, plan

        schedule = AutoHint.first_hint(placement, n_microbatches).removeprefix("strict-")
        config = RuntimeConfig(hint=schedule, placement=placement.kind, backpressure=backpressure)
        return list(plan(config, placement.n_ranks, placement.n_virtual, n_microbatches).limits)

    @staticmethod
    def first_hint(placement: Any, n_microbatches: int) -> str:
        """The hint to build the pipeline with: the placement's strict schedule."""
        known, _ = sim_auto.known_candidates(placement.n_ranks, placement.n_virtual, placement.kind, n_microbatches)
        return next((c for c in known if c.startswith("strict-")), known[0])

    def before_step(self, k: int) -> None:
        """Set the hint of step ``k`` (0-based, counted from this run's first step)."""
        if k == 0 and self.say and self.ranking is None and not self.too_short:
            n = len(self.plan)
            self.say(f"rrfp train: hint auto: steps 1-{n} of this run measure costs ({self.plan[0]} warms up, "
                     f"then {', '.join(self.plan[1:])}), then {TRIAL_ROUNDS} trial rounds of one step per candidate")
        if self.plan:
            want = self.plan[0]
        else:
            want = self.chosen or self.current
        if want != self.current:
            switch_hint(self.pipe, want, self.limits, self.backpressure)
            self.current = want
        # Task records while measuring costs and in trial steps (their forward seconds).
        self.pipe.runtime.loop.record = self._record or bool(self.plan)

    def after_step(self, k: int, stats: Any) -> None:
        """Book step ``k``'s figures (every rank calls it: it holds collectives)."""
        if not self.plan:
            if self.recheck_every and (k + 1) % self.recheck_every == 0 and self.trial:
                self.plan = sim_auto.trial_order(self.trial, len(self.walls.get(self.trial[0], [])))
            return
        step_hint = self.plan.pop(0)
        wall = torch.tensor([float(stats.wall)], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        n_measure = 3 if self.split else 2
        if self.ranking is None:
            if len(self.plan) < n_measure - 1:  # not the warm-up step
                self._gather(stats)
            if not self.plan:
                self._rank()
                self.plan = [h for r in range(TRIAL_ROUNDS) for h in sim_auto.trial_order(self.trial, r)]
                if self.say:
                    assert self.ranking is not None
                    self.say(f"rrfp train: hint auto: steps {k + 2}-{k + 1 + len(self.plan)} of this run are the trial: "
                             f"{', '.join(self.trial)}, {TRIAL_ROUNDS} rounds of one step each "
                             f"({self.ranking.reason()})")
            return
        # The step's forward seconds over every rank: its batch's work (rrfp.sim.auto.scaled).
        fwd = torch.tensor([sum(rec.end - rec.start for rec in stats.records if rec.task.kind == F)], dtype=torch.float64)
        dist.all_reduce(fwd, op=dist.ReduceOp.SUM)
        self.walls.setdefault(step_hint, []).append((float(wall.item()), float(fwd.item())))
        if not self.plan:  # the trial's last round (or a re-check's round) is complete
            self._choose()

    def _gather(self, stats: Any) -> None:
        mine = [(rec.task.stage, rec.task.kind, rec.task.mb, rec.start, rec.end) for rec in stats.records]
        sizer = getattr(self.pipe.runtime, "_sizer", None)
        act = {}
        if sizer is not None:
            for s in self.pipe.runtime.stages:
                got = [sizer(s, m) for m in range(self.M)]
                act[s] = round(statistics.fmean(x for x in got if x)) if any(got) else 0
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, act))
        ends: dict[tuple[int, str, int], float] = {}
        starts: dict[tuple[int, str, int], float] = {}
        for recs, a in everyone:
            self.act.update(a)
            for s, kind, m, t0, t1 in recs:
                self.samples.setdefault((s, kind), []).append(t1 - t0)
                ends[(s, kind, m)], starts[(s, kind, m)] = t1, t0
        rank_of, nxt = self.place.rank_of, self.place.next_stage
        for (s, kind, m), t1 in ends.items():
            if kind == F and nxt(s) is not None and rank_of(nxt(s)) != rank_of(s):
                t0 = starts.get((nxt(s), F, m))
                if t0 is not None:
                    self.gaps.setdefault(s, []).append(max(0.0, t0 - t1))

    def _rank(self) -> None:
        S = self.place.n_stages
        links = {s: [min(g)] for s, g in self.gaps.items() if g}
        prof = sim_auto.profile_from_samples(self.samples, links, S, [self.act.get(s, 0) for s in range(S)])
        budget = self.budget if self.budget is not None and all(self.act.get(s) for s in range(S)) else None
        self.ranking = sim_auto.rank(prof, n_ranks=self.place.n_ranks, n_virtual=self.place.n_virtual,
                                     placement=self.place.kind, n_microbatches=self.M, limit=self.limits,
                                     memory_budget=budget, backpressure=self.backpressure, candidates=self.known)
        self.profile = prof
        self.trial = sim_auto.trial_candidates([h for h, _ in self.ranking.order], self.strict)

    def _choose(self) -> None:
        med = sim_auto.medians(self.walls)
        best = sim_auto.keep(self.walls, self.strict)
        changed = best != self.chosen
        self.chosen = best
        if self.say and changed:
            walls = ", ".join(f"{h} {1e3 * med[h]:.1f} ms" for h in sorted(med, key=med.get))
            assert self.ranking is not None
            n = len(self.walls[best])
            self.say(f"rrfp train: hint auto chose {best}: median step over {n} trial step{'s' if n != 1 else ''} "
                     f"(at the trial's median forward work): {walls} "
                     f"(measured {self.profile.describe()}; {self.ranking.reason()})")
