"""Acceptance: `rrfp train` with no arguments trains (4 ranks, real stdlib text) and learns."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_rrfp_train_defaults_finish_and_loss_drops_30_percent():
    # 290 s is a deadline for a hang, not a speed target (the README's timings are measured).
    p = subprocess.run([sys.executable, "-m", "rrfp", "train"], capture_output=True, text=True, timeout=290)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [l for l in p.stdout.splitlines() if l.startswith("step")]
    assert len(steps) == 40
    losses = [float(re.search(r"loss\s+([\d.]+)", l).group(1)) for l in steps]
    bubbles = [re.search(r"bubble/rank \[([^\]]*)\]", l).group(1).split() for l in steps]
    assert all(len(b) == 4 and all(0.0 <= float(x) <= 1.0 for x in b) for b in bubbles)
    assert losses[-1] <= 0.7 * losses[0], losses
    assert "done: 40 steps" in p.stdout
