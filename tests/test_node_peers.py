"""``rrfp node`` when a peer host vanishes (issue 32 item 4): the daemon left behind says what
it waits for while its agent waits in the rendezvous, and gives up after ``--join-timeout``
with one line and exit code 1 (main: more than 180 s without a word, torch's 600 s bound).

Every wait is on an event (a line a process printed, a process exit) under a timeout."""

from __future__ import annotations

import os
import re
import sys

import pytest

from node_hosts import ADDRS, needs_loopback, node_env
from procs import Proc


def test_the_wait_line_says_what_for_how_long_and_when_it_gives_up():
    from rrfp.node.peers import RendezvousWait

    w = RendezvousWait(lambda: False, "10.0.0.1:29500 (job)", 2, 600, print)
    assert w.every == 30.0 and RendezvousWait(lambda: False, "x", 2, 20, print).every == 5.0
    assert w.line(90.4) == ("rrfp node: waiting for all 2 nodes to join the rendezvous at 10.0.0.1:29500 (job) for "
                            "90 s (a peer host gone or not started yet); giving up in 510 s (--join-timeout 600)")



def test_stop_returns_only_after_a_line_being_said_and_none_follows():
    """CI saw "waiting ... giving up in 0 s" printed after the daemon's last line: the wait
    thread was mid-line when the agent gave up. Forced order: stop() is called while the
    thread is inside say(); it must not return before that line is out, and no line after."""
    import threading

    from rrfp.node.peers import RendezvousWait

    inside, release, said = threading.Event(), threading.Event(), []

    def say(line):
        inside.set()
        assert release.wait(60)
        said.append(line)

    w = RendezvousWait(lambda: False, "x", 2, 0.04, say).start()  # a line every 0.01 s
    assert inside.wait(60)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (w.stop(), stopped.set()))
    stopper.start()
    assert not stopped.wait(0.2)  # the line being said holds stop() back
    release.set()
    stopper.join(60)
    assert stopped.is_set() and not w._thread.is_alive() and len(said) == 1


def test_the_daemons_last_line_comes_after_the_wait_lines_are_ended(monkeypatch):
    """_launch ends the wait lines (``quiet``) before it says how the launch ended."""
    import types

    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from rrfp.node import cli
    from rrfp.train import cli as _  # noqa: F401 - imported before say is patched, or it keeps the patch

    order = []

    def launcher(config, entry):
        def run(*args):
            raise RendezvousTimeoutError("timed out")
        return run

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", launcher)
    monkeypatch.setattr("rrfp.lines.say", lambda line, *a: order.append(line))
    job = types.SimpleNamespace(nnodes=2, train_args=[], targs=types.SimpleNamespace(checkpoint_dir=None, dp=1, tp=1))
    stop = types.SimpleNamespace(requested=False, ended=False, stop_file=types.SimpleNamespace(exists=lambda: False),
                                 peer_asked=lambda: False)
    config = types.SimpleNamespace(rdzv_configs={"join_timeout": 20})
    assert cli._launch(config, job, stop, lambda: order.append("quiet")) == 1
    assert order == ["quiet", "rrfp node: error: not every node of the 2 joined the rendezvous within "
                              "--join-timeout 20 s (a peer host gone?); giving up"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_loopback
def test_a_daemon_whose_peer_host_was_sigkilled_says_what_it_waits_for_and_gives_up():
    """Two daemons, one rank each, train; node 1's daemon is SIGKILLed (its rank dies with
    it). Node 0's rank loses its peer, its agent restarts it and waits in the rendezvous:
    every 5 s (a quarter of --join-timeout 20) node 0 says it waits for all 2 nodes, then
    gives up in one line, exit 1."""
    procs: list[Proc] = []
    port = 0
    try:
        for node, addr in enumerate(ADDRS):
            argv = [sys.executable, "-m", "rrfp", "node", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
                    ADDRS[0], "--master-port", str(port), "--node-addr", addr, "--metrics-addr", addr,
                    "--metrics-port", "0", "--job-id", f"peers{os.getpid()}", "--node-rank", str(node),
                    "--join-timeout", "20", "--", "--pp", "2", "--steps", "100000", "--batch-size", "4",
                    "--microbatches", "2", "--max-len", "32", "--threads", "1"]
            procs.append(Proc(argv, node_env()))
            if node == 0:
                line = procs[0].wait_for(", rendezvous ", 600)
                port = int(line.split(", rendezvous ")[1].split(" ")[0].rsplit(":", 1)[1])
        procs[0].wait_for(" loss ", 600)  # a step line: both nodes train
        seen = len(procs[0].lines)
        procs[1].kill()
        assert procs[0].finish(600) == 1, procs[0].output()
        after = procs[0].lines[seen:]
        waits = [ln for ln in after if ln.startswith("rrfp node: waiting for all 2 nodes to join the rendezvous at ")]
        assert waits and all(re.search(r"for \d+ s \(a peer host gone or not started yet\); giving up in \d+ s "
                                       r"\(--join-timeout 20\)$", ln) for ln in waits), procs[0].output()
        ours = [ln for ln in after if ln.startswith("rrfp node: ")]  # torch's agent may log after it
        assert ours[-1] == ("rrfp node: error: not every node of the 2 joined the rendezvous within --join-timeout "
                             "20 s (a peer host gone?); giving up"), procs[0].output()
    finally:
        for p in procs:
            p.kill()
