"""Which flags each mode of ``rrfp simulate`` reads, and how much work a study may ask for.

``rrfp simulate`` runs in one of three modes: one simulation per hint (the default),
``--sweep`` (the scaling study) or ``--suite`` (the scenario suite, docs/suite.md). A flag the
chosen mode does not read would change nothing, silently; so after parsing, every flag whose
value differs from its default is checked against the mode's table (:data:`NOT_READ`) and
refused in one line naming the flags and why. A few flags matter only beside another one
(:data:`NEEDS`). Sweeps and suites are bounded in total work (:data:`MAX_STUDY_TASKS`), not
only per simulation.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..errors import UsageError

ONLY_SWEEP = ("depths", "mb_per_stage", "jitter_levels", "imbalance", "out")
ONLY_SUITE = ("suite_ranks", "suite_scenarios", "suite_jobs")
SUITE_READS = frozenset({"suite", "suite_ranks", "suite_scenarios", "suite_jobs", "hint", "hints", "plugin", "seed",
                         "seeds", "markdown"})
"""What ``--suite`` reads; its scenarios fix every other setting (docs/suite.md). ``--plugin``
makes the hints it registers names that ``--hint`` takes."""

NOT_READ: dict[str, dict[str, str]] = {
    "single": {**{d: "a --sweep axis" for d in ONLY_SWEEP}, **{d: "sets up --suite" for d in ONLY_SUITE},
               "seeds": "a single run simulates --seed; --seeds counts the seeds of --sweep and --suite"},
    "sweep": {**{d: "sets up --suite" for d in ONLY_SUITE},
              "ranks": "--depths sets them", "microbatches": "--mb-per-stage sets them",
              "jitter": "--jitter-levels sets it", "encoder_scale": "--imbalance sets it",
              "csv": "a sweep writes --out PREFIX.csv", "markdown": "a sweep writes --out PREFIX.md",
              "trace": "a sweep writes no traces"},
}
"""Per mode other than the suite: the flags it does not read, and why (the suite reads only
:data:`SUITE_READS`)."""

NEEDS = {"samples_per_mb": ("images",), "encoder_stages": ("images", "encoder_scale", "imbalance")}
"""A flag that matters only when one of the others is given: ``--samples-per-mb`` draws image
counts (``--images``); ``--encoder-stages`` says which stages ``--images`` and the encoder
imbalance scale."""

MAX_STUDY_TASKS = 50_000_000
"""Most tasks a sweep or a suite may simulate in all (a few minutes of one core at about
120,000 tasks per second; the default suite simulates about 18 million)."""


def mode(args: argparse.Namespace) -> str:
    """``single``, ``sweep`` or ``suite``.

    Raises:
        UsageError: both ``--sweep`` and ``--suite``.
    """
    if args.sweep and args.suite:
        raise UsageError("--sweep and --suite: expected one of them (a sweep and a suite are separate studies)")
    return "suite" if args.suite else "sweep" if args.sweep else "single"


def check_flags(args: argparse.Namespace, register: Callable[[Any], None]) -> None:
    """Refuse flags the mode of ``args`` does not read. ``register`` adds ``simulate`` to a
    subparsers object (its defaults tell which flags were given).

    Raises:
        UsageError: one line naming the flags and why.
    """
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    defaults = vars(parser.parse_args(["simulate"]))
    flag = {a.dest: a.option_strings[-1] for a in sub.choices["simulate"]._actions if a.option_strings}
    given = {d for d, default in defaults.items() if d in flag and getattr(args, d, default) != default}
    m = mode(args)
    if m == "suite":
        ignored = [flag[d] for d in flag if d in given and d not in SUITE_READS]
        if ignored:
            costs = any(f.startswith(("--cost", "--act-bytes", "--msg-bytes")) for f in ignored)
            why = "its scenarios have fixed costs" if costs else "its scenarios fix every other setting"
            raise UsageError(f"--suite does not take {', '.join(ignored)}: {why} (docs/suite.md); it reads "
                             "--hint/--hints, --plugin, --suite-ranks, --suite-scenarios, --suite-jobs, --seed, "
                             "--seeds and --markdown")
        return
    ignored = [d for d in flag if d in given and d in NOT_READ[m]]
    if ignored:
        what = "a single run (without --sweep or --suite)" if m == "single" else "--sweep"
        raise UsageError(f"{what} does not read " + ", ".join(f"{flag[d]} ({NOT_READ[m][d]})" for d in ignored))
    for d, needs in NEEDS.items():
        if d in given and not given & set(needs):
            raise UsageError(f"{flag[d]} changes nothing without {' or '.join(flag[n] for n in needs if n in flag)}")


def check_study(tasks: int, what: str) -> None:
    """Refuse a sweep or suite of more than :data:`MAX_STUDY_TASKS` tasks in all.

    Raises:
        UsageError: one line naming ``what`` (the flags that size it) and the count.
    """
    if tasks > MAX_STUDY_TASKS:
        raise UsageError(f"{what}: {tasks:,} tasks to simulate in all, expected at most {MAX_STUDY_TASKS:,} "
                         "(fewer or shallower points)")


def sweep_tasks(depths: list[int], mb_per_stage: list[int], n_virtual: int, steps: int, repeats: int) -> int:
    """Tasks a sweep simulates: F, B/I and W per stage, microbatch and step at every point,
    ``repeats`` times (jitter levels x imbalances x seeds x hints)."""
    return sum(3 * p * n_virtual * m * p * steps for p in depths for m in mb_per_stage) * repeats


def suite_tasks(ranks: list[int], n_scenarios: int, n_seeds: int, n_hints: int) -> int:
    """Tasks a suite simulates, from its layouts and memory settings (:mod:`rrfp.sim.suite`):
    ``M = 4 x ranks`` microbatches, each hint and the baseline per scenario, layout, memory
    and seed."""
    from .suite import LAYOUTS, MEMORIES

    per_rank = sum(v for v, _ in LAYOUTS) * len(MEMORIES)
    return sum(3 * p * 4 * p * per_rank for p in ranks) * n_scenarios * n_seeds * (n_hints + 1)
