"""``rrfp node``'s last moments with the order of events forced: a SIGTERM that reaches the
daemon right after its last line, before ``--metrics-linger`` has taken over the signal, or
while its agent waits for the other nodes after training. The daemon (or its launch) runs in
this process with the agent replaced, so the signal comes exactly there, every time; nothing
waits on a clock."""

from __future__ import annotations

import os
import signal
import types

import pytest
from linger_waits import record_linger_waits

from rrfp.cli import main
from rrfp.lines import say


@pytest.mark.slow  # imports torch's elastic agent and serves HTTP: seconds of CPU
def test_a_sigterm_right_after_the_last_line_ends_the_metrics_linger_at_once(monkeypatch, tmp_path, capsys):
    """The daemon says ``rrfp node: done``; a SIGTERM (the operator, Kubernetes deleting the
    pod once the job is done) comes before the linger starts. It must end the linger at once
    with exit code 0. Before: the daemon's stop handler took the signal and the linger then
    waited its whole time (600 s here), or, one step later, the default handler was in and the
    daemon died of the signal (-15) instead of exiting 0."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the daemon sets its ranks' variables here
    for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
              "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    waits = record_linger_waits(monkeypatch)

    def launch(config, job, stop, quiet):  # as rrfp.node.cli._launch ends a finished run
        stop.ended = True
        quiet()
        say("rrfp node: done")
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
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.splitlines()[-1] == "rrfp node: done" and err == "", out + err
    assert False not in waits, "the linger waited although a SIGTERM had come"


def test_a_sigterm_while_the_agent_waits_for_the_other_nodes_after_training_is_a_finished_run(monkeypatch, tmp_path,
                                                                                               capsys):
    """Every rank of this node finished; torch's agent waits in its exit barrier for the other
    nodes' agents, with no rank running. A SIGTERM then (Kubernetes deleting the pods of a job
    whose last node is finishing) is a finished run: one line saying so, exit 0. Before, the
    forwarder saw no rank and raised torch's SignalException, and the daemon said the stop
    committed no checkpoint (on stderr) and exited 143, so the job was restarted. Forced
    order: the agent is replaced by one that reports the group finished, then takes the
    signal where the exit barrier would wait."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from rrfp.node import cli
    from rrfp.train.stop import StopForwarder

    stop = StopForwarder(tmp_path / "stop-requested", "unused", children=lambda: [])  # no rank runs

    def launcher(config, entry):
        def run(*args):
            LocalElasticAgent._monitor_workers(None, None)  # the group finished
            stop(signal.SIGTERM, None)  # its handler, inside the exit barrier
            raise AssertionError("the SIGTERM did not end the exit barrier's wait")
        return run

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers",
                        lambda agent, group: RunResult(state=WorkerState.SUCCEEDED))
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launcher)
    job = types.SimpleNamespace(nnodes=2, train_args=[], targs=types.SimpleNamespace(checkpoint_dir=None, dp=1, tp=1))
    code = cli._launch(types.SimpleNamespace(rdzv_configs={"join_timeout": 20}), job, stop, lambda: None)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert (out, err) == ("rrfp node: SIGTERM came after the last step: training finished; nothing saved "
                          "(no --checkpoint-dir)\n", "")
    assert not (tmp_path / "stop-requested").exists()


def test_a_sigterm_before_any_rank_started_says_no_rank_ran(monkeypatch, tmp_path, capsys):
    """A SIGTERM while the agent joins the rendezvous (no rank started yet) stops the daemon,
    exit 143, saying that no rank ran and what is saved. Before, it said on stderr that 'a rank
    ended before the step in progress could end': there was no rank and no step. Forced order:
    the agent is replaced by one that takes the signal where the rendezvous would wait."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from rrfp.node import cli
    from rrfp.train.stop import PREEMPTED, StopForwarder

    stop = StopForwarder(tmp_path / "stop-requested", "unused", children=lambda: [])  # no rank runs
    monitored = []

    def launcher(config, entry):
        def run(*args):
            stop(signal.SIGTERM, None)  # its handler, inside the rendezvous
            raise AssertionError("the SIGTERM did not end the rendezvous' wait")
        return run

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda agent, group: monitored.append(1))
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launcher)
    job = types.SimpleNamespace(nnodes=2, train_args=[], targs=types.SimpleNamespace(checkpoint_dir=None, dp=1, tp=1))
    code = cli._launch(types.SimpleNamespace(rdzv_configs={"join_timeout": 20}), job, stop, lambda: None)
    out, err = capsys.readouterr()
    assert code == PREEMPTED and monitored == [], out + err
    assert (out, err) == ("rrfp node: stopped on SIGTERM while no rank ran (joining the rendezvous, or between a "
                          "failure and a restart): no step was in progress; nothing saved (no --checkpoint-dir)\n", "")
    assert not (tmp_path / "stop-requested").exists()
