"""How closely the simulator predicts the real runtime: the makespan of one step with the same
injected task durations (tests/test_sim_vs_runtime.py's setting), real over simulated.

    python benchmarks/bench_sim_vs_runtime.py      # goal: within 5% on a quiet machine

A timing goal, so it lives here and not in the tests (a loaded machine stretches the real run).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_sim_vs_runtime import measure  # noqa: E402


def main() -> None:
    worst = 0.0
    for hint in ("bf", "bfw", "strict-1f1b"):
        measured, predicted, _, _ = measure(hint)
        err = abs(measured - predicted) / predicted
        worst = max(worst, err)
        print(f"{hint:12s} real {measured:.3f} s  simulated {predicted:.3f} s  ratio {measured / predicted:.3f}")
    print(f"worst difference {worst:.1%} (goal <= 5%: {'met' if worst <= 0.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
