"""``rrfp node``'s last moments with the order of events forced: a SIGTERM that reaches the
daemon right after its last line, before ``--metrics-linger`` has taken over the signal. The
daemon runs in this process with its launch replaced (no rank, no agent), so the signal comes
exactly there, every time; nothing waits on a clock."""

from __future__ import annotations

import os
import signal

import pytest
from linger_waits import record_linger_waits

from rrfp.cli import main


@pytest.mark.slow  # imports torch's elastic agent and serves HTTP: seconds of CPU
def test_a_sigterm_right_after_the_last_line_ends_the_metrics_linger_at_once(monkeypatch, tmp_path):
    """The daemon says ``rrfp node: done``; a SIGTERM (the operator, Kubernetes deleting the
    pod once the job is done) comes before the linger starts. It must end the linger at once
    with exit code 0. Before: the daemon's stop handler took the signal and the linger then
    waited its whole time (600 s here), or, one step later, the default handler was in and the
    daemon died of the signal (-15) instead of exiting 0."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the daemon sets its ranks' variables here
    for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
              "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    said: list[str] = []
    monkeypatch.setattr("rrfp.lines.say", lambda line, *a: said.append(line))
    waits = record_linger_waits(monkeypatch)

    def launch(config, job, stop, quiet):  # as rrfp.node.cli._launch ends a finished run
        stop.ended = True
        quiet()
        said.append("rrfp node: done")
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, in the main thread
        return 0

    monkeypatch.setattr("rrfp.node.cli._launch", launch)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["node", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "29999",
                     "--node-addr", "127.0.0.1", "--metrics-addr", "127.0.0.1", "--metrics-port", "0",
                     "--metrics-linger", "600", "--run-dir", str(tmp_path / "run"), "--", "--stages", "2"])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 0, said
    assert said[-1] == "rrfp node: done", said
    assert False not in waits, "the linger waited although a SIGTERM had come"
