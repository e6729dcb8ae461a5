"""``rrfp train --metrics-linger``: a SIGTERM (a Kubernetes pod deletion) while the ranks serve
their final metrics ends the linger early with exit code 0, since training finished
(docs/operations.md). A real launcher and ranks; the signal is sent once rank 0 says every
rank finished (its linger line), never after a sleep."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from linger_waits import record_linger_waits
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


def test_a_stop_asked_while_the_ranks_mark_their_training_over_ends_the_linger_at_once(tmp_path, monkeypatch):
    """Forced order: the launcher's SIGTERM comes while this rank, its training marked over,
    waits in the barrier for a rank that has not marked yet. The launcher then asks a stop
    (its stop file, then SIGTERM to the ranks), which the rank's graceful stop takes. The
    linger that follows must end at once, exit 0 (the launcher then says training finished).
    Before, it lasted its whole --metrics-linger, and the launcher waited for it."""
    import argparse
    import types

    import torch.distributed as dist

    from rrfp.train import worker
    from rrfp.train.linger import FINISHED_ENV
    from rrfp.train.stop import STOP_FILE_ENV, GracefulStop

    stop_file = tmp_path / "stop-requested"
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file))
    monkeypatch.setenv(FINISHED_ENV, str(tmp_path))

    def barrier():  # the launcher's handler, while this rank waits here
        stop_file.write_text("launcher")
        os.kill(os.getpid(), signal.SIGTERM)  # the rank's handler runs here, in the main thread

    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    waits = record_linger_waits(monkeypatch)
    closed: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    try:
        stop = GracefulStop(dist.HashStore(), 1, 2)  # armed: the stop file is in the environment
        code = worker._finished(argparse.Namespace(metrics_linger=600.0), 1,
                                types.SimpleNamespace(close=lambda: closed.append(1)), stop)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (tmp_path / "rank-1").exists() and stop.requested  # marked, then the stop came
    assert code == 0 and closed == [1]
    assert False not in waits, "the linger waited although a SIGTERM had come"
