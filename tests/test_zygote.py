"""The zygote ``rrfp train`` forks its ranks from (rrfp/train/zygote.py): a clean image to fork,
and ranks that end, fail and are named as torchrun's were."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from handover import process

from rrfp.train.zygote import PRELOAD, Failure, LocalJob


def _report(out: str) -> None:
    """In a fork of the session's zygote: what the zygote held when it forked."""
    import json

    import torch

    from rrfp.train import zygote

    parent = os.getppid()
    with open(out, "w") as f:
        json.dump({"threads": len(os.listdir(f"/proc/{parent}/task")), "cuda": torch.cuda.is_initialized(),
                   "preloaded_in_parent": zygote._BORN_IN == parent,
                   "missing": [m for m in PRELOAD if m not in sys.modules]}, f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(600)
def test_the_zygote_holds_one_thread_no_cuda_and_every_preloaded_module(tmp_path):
    # A fork copies only the calling thread, and a child of a process with a CUDA context
    # cannot use CUDA: the zygote (here the test session's, a superset of rrfp train's
    # preload) must have neither once its imports are done. Every module of PRELOAD must
    # import there, or each rank imports it again (multiprocessing skips a failed preload).
    import json

    p = process(_report, str(tmp_path / "r.json"))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    got = json.loads((tmp_path / "r.json").read_text())
    assert got == {"threads": 1, "cuda": False, "preloaded_in_parent": True, "missing": []}


def test_a_failure_reads_the_ranks_error_file_as_torchs_process_failure_does(tmp_path):
    # What describe_failures reads: the message and time a rank wrote (guard.write_error_file),
    # the rrfp record; a rank killed by a signal wrote none and gets torch's made-up message.
    import json

    from rrfp.train.cli import describe_failures

    (tmp_path / "e1.json").write_text(json.dumps({"message": "rrfp train: rank 1: error: PeerLost: rank 2 (pp 2, dp 0, "
                                                  "tp 0) lost: connection closed", "timestamp": 7,
                                                  "rrfp": {"rank": 1, "blame": 2, "time": 7.5}}))
    written = Failure(1, 101, 1, str(tmp_path / "e1.json"))
    killed = Failure(2, 102, -signal.SIGKILL, str(tmp_path / "none.json"))
    assert written.timestamp == 7 and written.error_file_data["rrfp"]["blame"] == 2
    assert killed.message == "Signal 9 (SIGKILL) received by PID 102" and killed.error_file_data == {}
    assert describe_failures({1: written, 2: killed}, set(), (1, 1)) == \
        "rank 2 (pp 2, dp 0, tp 0) died (SIGKILL); rank 1 stopped too"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_killed_from_outside_is_named_and_the_other_is_stopped(tmp_path):
    # Two forked ranks of a run that would train for ever; rank 1 is SIGKILLed as soon as it
    # is forked. The launcher reports rank 1's signal as not its own, stops rank 0 (which
    # waits for rank 1) with SIGTERM, and names rank 1, as torchrun's agent did.
    from rrfp.train.cli import describe_failures

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with LocalJob(["train", "--stages", "2", "--steps", "100000", "--batch-size", "4", "--microbatches", "2",
                   "--max-len", "32", "--hint", "bf", "--quiet"], 2, env, str(tmp_path)) as job:
        job.start()
        pids = [p.pid for p in job.procs]
        os.kill(pids[1], signal.SIGKILL)
        failures = job.wait()
    assert failures[1].exitcode == -signal.SIGKILL and pids[1] not in job.signalled
    assert failures[0].exitcode == -signal.SIGTERM and pids[0] in job.signalled
    assert describe_failures(failures, job.signalled, (1, 1)) == "rank 1 (pp 1, dp 0, tp 0) died (SIGKILL); rank 0 stopped too"
    assert all(p.exitcode is not None for p in job.procs)


def test_asking_which_ranks_run_from_the_sigterm_handler_never_takes_a_ranks_exit_code(tmp_path, monkeypatch):
    """The launcher's SIGTERM handler (rrfp.train.stop.StopForwarder) asks the job which ranks
    run, to pass the signal on. Forced order: it runs while the main thread, reading a rank's
    end, is between the zygote's pipe becoming readable and its read (multiprocessing's
    forkserver ``Popen.poll``), the bytecode boundary where Python runs a handler. The rank's
    exit code stays its own, 3. Before, the handler read it itself, the main thread found the
    pipe empty, and the rank "exited 255": a finished or cleanly stopped run then failed."""
    import multiprocessing
    import multiprocessing.connection as mpc

    job = LocalJob(["unused"], 1, {}, str(tmp_path))
    p = multiprocessing.get_context("forkserver").Process(target=os._exit, args=(3,))
    p.start()
    job.procs.append(p)
    real_wait, asked, inside = mpc.wait, [], []

    def wait(objects, timeout=None):
        ready = real_wait(objects, timeout)
        if p.sentinel in ready and sys._getframe(1).f_code.co_name == "poll" and not inside:
            inside.append(1)  # the handler's own reads come here too: once
            asked.append(job.running())  # the SIGTERM handler, between the readiness and the read
        return ready

    monkeypatch.setattr(mpc, "wait", wait)
    failures = job.wait()
    assert {r: f.exitcode for r, f in failures.items()} == {0: 3}
    assert asked == [[p.pid]]  # still running as far as the launcher has read
    assert job.running() == []


def test_a_sigterm_after_every_rank_exited_0_is_a_finished_run(tmp_path, monkeypatch, capsys):
    """Forced order: the launcher's SIGTERM comes once its wait has seen the last rank exit 0,
    before the launch is marked over; no rank runs, so the forwarder raises. The run finished:
    one line saying so, exit 0 (before: "stopped by SIGTERM", exit 143, and the job would be
    restarted). The job's one rank is a process that exits 0 at once."""
    import argparse
    import multiprocessing

    from rrfp.train import cli

    def start(job):
        p = multiprocessing.get_context("forkserver").Process(target=os._exit, args=(0,))
        p.start()
        job.procs.append(p)

    real_wait = LocalJob.wait

    def wait(job):
        assert real_wait(job) == {}
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the launcher's handler, right here
        raise AssertionError("the forwarder did not raise with no rank running")

    monkeypatch.setattr(LocalJob, "start", start)
    monkeypatch.setattr(LocalJob, "wait", wait)
    code = cli._launch_local(["train"], 1, dict(os.environ), argparse.Namespace(metrics_linger=0.0), None)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "rrfp train: SIGTERM came after the last step: training finished; nothing saved (no --checkpoint-dir)\n"
    assert err == ""


def test_a_sigterm_before_the_launchers_forwarder_is_in_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Forced order: the SIGTERM comes after LocalJob put its handler in, before the
    launcher's forwarder is in. One line and 128 + SIGTERM, no rank started (before: the
    exception left the launcher as a traceback)."""
    import argparse

    from rrfp.train import cli, stop

    def forwarder(*a, **k):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the launcher's handler, right here

    monkeypatch.setattr(stop, "StopForwarder", forwarder)
    monkeypatch.setattr(LocalJob, "start", lambda job: pytest.fail("no rank may start"))
    code = cli._launch_local(["train"], 1, dict(os.environ), argparse.Namespace(metrics_linger=0.0), None)
    out, err = capsys.readouterr()
    assert code == 128 + signal.SIGTERM and out == ""
    assert err == "rrfp train: stopped by SIGTERM; the ranks were stopped too\n"

