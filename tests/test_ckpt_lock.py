"""Sharing a checkpoint folder: one owner job holds a lock; a second live job is refused in
one line before any process starts; the same job (a replaced pod) and the successor of a dead
job take it over; no job deletes another job's half-written folder."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from rrfp.cli import main
from rrfp.train import checkpoint as ck
from rrfp.train import ckpt_lock
from rrfp.train.ckpt_lock import LOCK_FILE, FolderInUse, Lease
from test_cli_bad_input import no_launch  # noqa: F401 - the fixture: nothing may start a process

SMALL = ["--stages", "2", "--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1"]


@pytest.fixture(autouse=True)
def environment(monkeypatch):
    """No checkpoint job identity inherited from the environment, and nothing a command run
    in this process sets there (``rrfp node`` sets its ranks' variables) left behind."""
    saved = dict(os.environ)
    monkeypatch.delenv(ckpt_lock.JOB_ENV, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _lock(d) -> dict:
    return json.loads((d / LOCK_FILE).read_text())


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


def _tmp(d, job: str, step: int = 20):
    t = d / f".tmp-step-{step:08d}-{ckpt_lock.job_tag(job)}-0123456789ab"
    t.mkdir(parents=True)
    (t / "__0_0.distcp").write_bytes(b"half written")
    return t


@pytest.mark.parametrize("command", ["train", "node"])
def test_a_second_job_on_the_folder_is_refused_in_one_line(tmp_path, capsys, no_launch, command):
    d = tmp_path / "ck"
    d.mkdir()
    first = Lease(d, "job-A")  # a live job: this very process, renewing its lock
    first.acquire()
    first.start()
    before = _lock(d)
    argv = ["train", *SMALL, "--checkpoint-dir", str(d)]
    if command == "node":
        argv = ["node", "--metrics-port", "0", "--master-port", "29999", "--", *argv[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(
        re.escape(f"rrfp {command}: error: --checkpoint-dir={str(d)!r}: in use by job 'job-A' (pid {os.getpid()} on "
                  f"{socket.gethostname()}, lock {d / LOCK_FILE} renewed ") + r"\d+" + re.escape(
                      " s ago): expected a folder no other job writes (a lock not renewed for 60 s is taken over)"),
        err[0]), err
    assert _lock(d) == before and ckpt_lock.JOB_ENV not in os.environ
    first.release()
    assert not (d / LOCK_FILE).exists()


def test_the_same_job_takes_over_and_another_releases_nothing_of_it(tmp_path):
    """A replaced pod (same job identity, another host) takes the lock over; the old holder's
    release leaves the new holder's lock in place."""
    old = Lease(tmp_path, "job@head-0:29500", host="pod-a", pid=11)
    old.acquire()
    new = Lease(tmp_path, "job@head-0:29500", host="pod-b", pid=12)
    new.acquire()
    assert (_lock(tmp_path)["host"], _lock(tmp_path)["pid"]) == ("pod-b", 12)
    with pytest.raises(FolderInUse, match=r"in use by job 'job@head-0:29500' \(pid 12 on pod-b"):
        Lease(tmp_path, "other@head-0:29501", host="pod-c", pid=13).acquire()
    old.release()
    assert _lock(tmp_path)["host"] == "pod-b"
    new.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_stale_lock_is_taken_over_and_only_the_dead_jobs_leftovers_go(tmp_path):
    now = [1000.0]
    dead = Lease(tmp_path, "dead-job", host="pod-a", pid=11, clock=lambda: now[0])
    dead.acquire()
    mine, theirs = _tmp(tmp_path, "dead-job"), _tmp(tmp_path, "third-job", 30)
    mtime = (tmp_path / LOCK_FILE).stat().st_mtime
    late = Lease(tmp_path, "new-job", host="pod-b", pid=12, clock=lambda: mtime + 59)
    with pytest.raises(FolderInUse, match="renewed 59 s ago"):
        late.acquire()
    later = Lease(tmp_path, "new-job", host="pod-b", pid=12, clock=lambda: mtime + 61)
    later.acquire()  # not renewed for over LEASE_S: its job is dead
    assert _lock(tmp_path)["job"] == "new-job"
    assert not mine.exists() and (theirs / "__0_0.distcp").read_bytes() == b"half written"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(LOCK_FILE)) == [LOCK_FILE]


def test_a_lock_dated_ahead_of_this_hosts_clock(tmp_path):
    """A holder's clock (or file server's) ahead of ours by up to a lease is skew: the lock is
    live and its refusal says how far ahead; further ahead, it is taken over like a stale one."""
    Lease(tmp_path, "other-job", host="pod-a", pid=11).acquire()
    mtime = (tmp_path / LOCK_FILE).stat().st_mtime
    behind = Lease(tmp_path, "new-job", host="pod-b", pid=12, clock=lambda: mtime - 42)
    with pytest.raises(FolderInUse, match="renewed 42 s ahead of this host's clock"):
        behind.acquire()
    assert _lock(tmp_path)["job"] == "other-job"
    far_behind = Lease(tmp_path, "new-job", host="pod-b", pid=12, clock=lambda: mtime - 3600)
    far_behind.acquire()
    assert _lock(tmp_path)["job"] == "new-job"


def test_a_lock_of_a_dead_pid_on_this_host_is_taken_over_at_once(tmp_path):
    host = socket.gethostname()
    Lease(tmp_path, "crashed", host=host, pid=_dead_pid()).acquire()
    Lease(tmp_path, "next", host=host, pid=os.getpid()).acquire()
    assert _lock(tmp_path)["job"] == "next"
    with pytest.raises(FolderInUse, match="in use by job 'next'"):  # alive: refused
        Lease(tmp_path, "third", host=host, pid=os.getpid() + 0).acquire()


@pytest.mark.parametrize("text, needle", [("{", "is unreadable"), ('["x"]', "is not an rrfp lock")])
def test_a_damaged_lock_is_refused_not_overwritten(tmp_path, text, needle):
    (tmp_path / LOCK_FILE).write_text(text)
    with pytest.raises(FolderInUse, match=needle + ".*remove it if no job writes this folder"):
        Lease(tmp_path, "job").acquire()
    assert (tmp_path / LOCK_FILE).read_text() == text


def test_a_holder_whose_lock_was_taken_does_not_commit(tmp_path, monkeypatch):
    """A hung holder's lease ran out and another job took the folder: the hung job's renewal
    notes it, and its commit check names the new owner."""
    mine = Lease(tmp_path, "slow-job")
    mine.acquire()
    monkeypatch.setenv(ckpt_lock.JOB_ENV, "slow-job")
    assert ckpt_lock.check_owner(tmp_path) is None
    os.utime(tmp_path / LOCK_FILE, (1, 1))  # not renewed since 1970
    Lease(tmp_path, "fast-job").acquire()
    mine.renew()
    assert mine.lost_to == "fast-job" and _lock(tmp_path)["job"] == "fast-job"
    assert ckpt_lock.check_owner(tmp_path) == "fast-job"
    mine.release()
    assert _lock(tmp_path)["job"] == "fast-job"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_commit_keeps_another_jobs_half_written_folder(tmp_path):
    """A real run commits and prunes next to another job's ``.tmp-step-*`` folder: it stays,
    byte for byte; the run's lock is gone after it."""
    d = tmp_path / "ck"
    theirs = _tmp(d, "other-job")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            ckpt_lock.JOB_ENV)}
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *SMALL, "--steps", "2", "--checkpoint-every", "1",
                        "--checkpoint-keep", "1", "--checkpoint-dir", str(d), "--quiet"],
                       capture_output=True, text=True, timeout=500, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert ck.committed(d) == [ck.step_dir(d, 2)]
    assert (theirs / "__0_0.distcp").read_bytes() == b"half written"
    assert sorted(x.name for x in d.iterdir()) == [theirs.name, "step-00000002"]


@pytest.mark.parametrize("pid", [99999999999999999999, -1, 0, True])
def test_a_pid_no_process_can_have_is_no_live_holder(pid):
    """A hand-written lock naming this host and an impossible pid is stale, not a traceback
    (os.kill raised OverflowError) nor a live job (pid -1 signals a process group, True is 1)."""
    from rrfp.train.ckpt_lock import _pid_alive

    assert _pid_alive(pid) is False
    assert _pid_alive(os.getpid()) is True


def test_a_plain_torchrun_jobs_rank_0_holds_the_folder_for_the_torchrun_job(tmp_path, monkeypatch):
    """Only global rank 0 of a job no rrfp launcher holds the folder for takes it, named after
    torchrun's run id; a rank of an rrfp launcher's job (its identity inherited) takes nothing."""
    from types import SimpleNamespace

    args = SimpleNamespace(checkpoint_dir=str(tmp_path / "ck"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("RANK", "1")
    assert ckpt_lock.hold_in_rank(args) is None
    monkeypatch.setenv("RANK", "0")
    assert ckpt_lock.hold_in_rank(SimpleNamespace(checkpoint_dir=None)) is None
    lease = ckpt_lock.hold_in_rank(args)
    try:
        assert _lock(tmp_path / "ck")["job"] == "torchrun-abc" and os.environ[ckpt_lock.JOB_ENV] == "torchrun-abc"
        assert ckpt_lock.hold_in_rank(args) is None  # the job's identity is set: held already
    finally:
        lease.release()
    assert not (tmp_path / "ck" / LOCK_FILE).exists()
    monkeypatch.setenv(ckpt_lock.JOB_ENV, "train-launcher")
    assert ckpt_lock.hold_in_rank(args) is None


_HOLD_IN_CHILD = """
import sys
from types import SimpleNamespace
from rrfp.train import ckpt_lock
try:
    lease = ckpt_lock.hold_in_rank(SimpleNamespace(checkpoint_dir=sys.argv[1]))
except ckpt_lock.FolderInUse as e:
    print("refused:", e)
else:
    print("took:", lease.job)
    lease.release()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run_id", ["none", None])
def test_two_torchrun_jobs_without_a_run_id_of_their_own_are_two_jobs(tmp_path, monkeypatch, run_id):
    """torchrun's run id is 'none' unless --rdzv-id or --standalone gives one (the README's
    multi-node example), and absent where no torchrun started the rank: two such live jobs on
    one folder are two jobs, the second refused (on main both were 'torchrun-none': the second
    took the live first's lock over and wrote, and pruned its half-written folders, beside it)."""
    from types import SimpleNamespace

    ck = tmp_path / "ck"
    monkeypatch.setenv("RANK", "0")
    if run_id is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    lease = ckpt_lock.hold_in_rank(SimpleNamespace(checkpoint_dir=str(ck)))  # this process: job A's rank 0
    try:
        env = {k: v for k, v in os.environ.items() if k != ckpt_lock.JOB_ENV}
        p = subprocess.run([sys.executable, "-c", _HOLD_IN_CHILD, str(ck)], env=env, capture_output=True,
                           text=True, timeout=100)  # job B's rank 0: another agent (its parent is this process)
        assert p.returncode == 0, p.stderr
        expected = f"refused: --checkpoint-dir={str(ck)!r}: in use by job 'torchrun-none-{socket.gethostname()}-"
        assert p.stdout.startswith(expected), p.stdout
        assert _lock(ck)["nonce"] == lease.nonce  # A's lock untouched
    finally:
        lease.release()
    assert not (ck / LOCK_FILE).exists()


def test_a_rank_0_its_agent_restarts_takes_the_jobs_lock_over_whatever_the_run_id(tmp_path, monkeypatch):
    """A new attempt of rank 0 under the same agent (same run id, or torchrun's 'none' from the
    same parent) finds its job's lock held by the earlier attempt and takes it over."""
    from types import SimpleNamespace

    args = SimpleNamespace(checkpoint_dir=str(tmp_path / "ck"))
    monkeypatch.setenv("RANK", "0")
    for run_id in ("none", "job-7"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        first = ckpt_lock.hold_in_rank(args)
        first._stop.set()  # the first attempt was killed: it renews no more, its lock stays
        del os.environ[ckpt_lock.JOB_ENV]  # the new attempt is a new process
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        second = ckpt_lock.hold_in_rank(args)
        try:
            assert second.job == first.job and _lock(tmp_path / "ck")["nonce"] == second.nonce
        finally:
            second.release()
        assert not (tmp_path / "ck" / LOCK_FILE).exists()
