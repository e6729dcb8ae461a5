"""Simulator speed: 128 ranks x 2 virtual stages, 1024 microbatches, the default hint.

Prints wall and CPU seconds per repeat and the best of them (the usual benchmark figure: the
least disturbed run), tasks per second, and the simulated makespan against the busiest rank's
work. Not a test: the targets (at most the time of commit 3848870, alternated in one run, and
under 2.5 s on a quiet 2-core machine) are for a person to read. Latest figures (docs/simulator.md,
"Speed"): 12.56 G instructions per run (callgrind), 0.86x main at b5a78f0 and 0.73x 3848870; CPU
time alternated in fresh processes at load 4, medians 1.45 s against main's 1.70 s and 3848870's
2.12 s.

    python benchmarks/bench_sim.py                     # the target's configuration
    python benchmarks/bench_sim.py --limit 100000      # without backpressure
    python benchmarks/bench_sim.py --profile           # cProfile, top 20 by own time
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable, TypeVar

from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.hints import DEFAULT_HINT
from rrfp.sim.costs import CostModel
from rrfp.sim.duration import DurationModel
from rrfp.sim.engine import simulate

T = TypeVar("T")


def simulate_once(ranks: int, virtual: int, microbatches: int, hint: str = DEFAULT_HINT, limit: int = 32,
                  record: bool = False):
    """One simulation of the benchmark's workload (``F = 10 ms``, ``B = 20 ms``, ``I = W = 10 ms``)
    under ``hint`` with in-flight limit ``limit``; returns the :class:`~rrfp.sim.engine.SimResult`.

    Raises:
        ValueError: a hint or size that does not fit (from ``resolve_hint``)."""
    spec, h, strict = resolve_hint(hint, Placement(ranks, virtual), microbatches)
    costs = CostModel.uniform(spec.n_stages, F=0.010, B=0.020)
    return simulate(spec, h, DurationModel(costs), strict=strict, inflight_limit=limit, record=record)


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``(fn(), wall seconds, CPU seconds of this process)``."""
    w0, c0 = time.perf_counter(), time.process_time()
    res = fn()
    return res, time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=128)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--hint", default=DEFAULT_HINT, help="default: the default hint (rrfp.scheduler.hints.DEFAULT_HINT)")
    ap.add_argument("--limit", type=int, default=32, help="in-flight limit (RRFP default 32)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="keep a TaskRecord per task")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()

    spec, _, _ = resolve_hint(a.hint, Placement(a.ranks, a.virtual), a.microbatches)
    n_tasks = len(spec.all_tasks())
    print(f"{a.ranks} ranks x {a.virtual} virtual stages, {a.microbatches} microbatches, hint {a.hint}, "
          f"limit {a.limit}: {n_tasks} tasks")

    def once():
        return simulate_once(a.ranks, a.virtual, a.microbatches, a.hint, a.limit, a.record)

    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(once)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    walls = []
    for i in range(a.repeat):
        res, wall, cpu = timed(once)
        walls.append(wall)
        print(f"  run {i + 1}: wall {wall:.2f} s, cpu {cpu:.2f} s")
    best = min(walls)
    work = max(res.busy)
    print(f"best wall {best:.2f} s ({n_tasks / best / 1e6:.2f} M tasks/s); simulated makespan "
          f"{res.makespan:.2f} s = {res.makespan / work:.2f} x the busiest rank's work ({work:.2f} s); "
          f"peak in-flight {max(res.peak_inflight)}")


if __name__ == "__main__":
    main()
