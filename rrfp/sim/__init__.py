"""Discrete-event simulation of pipeline-parallel training on the real scheduler (no torch).

- :mod:`rrfp.sim.engine`: :func:`simulate` drives :class:`rrfp.scheduler.arbiter.Arbiter`
  per rank with task completions and message arrivals.
- :mod:`rrfp.sim.costs`: per-stage costs from flags, TOML or a profile JSON.
- :mod:`rrfp.sim.jitter`: keyed randomness and the paper's injected jitter (J0-J3).
- :mod:`rrfp.sim.duration`: ``duration(step, rank, task)`` and ``delay(step, src, dst, task)``.
- :mod:`rrfp.sim.metrics`: lower bound, bubbles, memory, tables.
- :mod:`rrfp.sim.compare`: several hints side by side, and sweeps.
- :mod:`rrfp.sim.cli`: ``rrfp simulate``.

Guide: docs/simulator.md.
"""

from .compare import SimConfig, compare, run_one, sweep
from .costs import CostModel, StageCost, load_costs, load_profile, save_profile
from .duration import CommModel, Dist, DurationModel
from .engine import DeadlockError, SimResult, TaskRecord, simulate
from .jitter import LEVELS, InjectedJitter, JitterLevel, injected_delay, keyed_uniform
from .metrics import RunSummary, lower_bound

__all__ = [
    "LEVELS", "CommModel", "CostModel", "DeadlockError", "Dist", "DurationModel", "InjectedJitter",
    "JitterLevel", "RunSummary", "SimConfig", "SimResult", "StageCost", "TaskRecord", "compare",
    "injected_delay", "keyed_uniform", "load_costs", "load_profile", "lower_bound", "run_one",
    "save_profile", "simulate", "sweep",
]
