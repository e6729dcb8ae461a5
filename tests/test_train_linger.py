"""``rrfp train --metrics-linger``: a SIGTERM (a Kubernetes pod deletion) while the ranks serve
their final metrics ends the linger early with exit code 0, since training finished
(docs/operations.md). A real launcher and ranks; the signal is sent once rank 0 says every
rank finished (its linger line), never after a sleep."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from procs import Proc
from runs import SMALL


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigterm_during_the_metrics_linger_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    run = Proc([sys.executable, "-m", "rrfp", "train", *SMALL, "--stages", "2", "--steps", "2", "--metrics-port", "0",
                "--metrics-linger", "3600"], {**env, "OMP_NUM_THREADS": "1"})
    try:
        run.wait_for("rrfp train: training finished; serving the final metrics for 3600 s", 900)
        run.p.send_signal(signal.SIGTERM)
        rc = run.finish(600)  # a hang bound only: the linger would last an hour
    finally:
        run.kill()
    assert rc == 0, run.output()
    assert "rrfp train: SIGTERM ended --metrics-linger; training had finished" in run.output()
    assert "stopped by" not in run.output() and "error" not in run.output(), run.output()
