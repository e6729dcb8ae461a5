"""A preempted run is not a finished one (issue 32 item 2): SIGTERM ends the step in progress on
every rank, the checkpoint of that step is committed, and every rank, the ``rrfp train``
launcher and every ``rrfp node`` daemon exit :data:`rrfp.train.stop.PREEMPTED` (143); the
restarted run resumes from that checkpoint. deploy/'s restart rules are driven against these
codes in tests/test_deploy.py.

The protocol tests run the ranks' side (:class:`rrfp.train.stop.GracefulStop`) on one
in-memory store, each rank in a thread; the order is forced by the store (a rank waits for
rank 0's word), never by a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from procs import Proc
from runs import SMALL


@pytest.fixture
def stop_env(tmp_path, monkeypatch):
    """A stop file in the ranks' environment (as rrfp node and rrfp train set it), and the
    SIGTERM handler restored afterwards."""
    from rrfp.train.stop import HOLD_ENV, STOP_FILE_ENV

    stop_file = tmp_path / "stop-requested"
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file))
    monkeypatch.delenv(HOLD_ENV, raising=False)
    old = signal.getsignal(signal.SIGTERM)
    yield stop_file
    signal.signal(signal.SIGTERM, old)


def _in_thread(fn, *args):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_sigterm_during_step_3_stops_every_rank_after_step_3(stop_env):
    """SIGTERM reaches rank 2 while step 3 runs (its launcher's stop file, then the signal).
    Rank 2 publishes the request as it ends step 3; rank 0 reads it at the end of its own step
    3 and says stop; ranks 1 and 2 wait for that word, so all three stop after step 3, the step
    in progress, not one later (main stopped after step 4: rank 0 fixed the last step to 3 + 1)."""
    import torch.distributed as dist

    from rrfp.train.stop import REQUEST_KEY, GracefulStop

    store = dist.HashStore()
    r0, r1 = GracefulStop(store, 0), GracefulStop(store, 1)
    r2 = GracefulStop(store, 2)  # the last installed SIGTERM handler: the signal below is rank 2's
    for k in (1, 2):
        waiting = [_in_thread(r.after_step, k, 6) for r in (r1, r2)]
        assert r0.after_step(k, 6) is False
        for t, out in waiting:
            t.join(60)
            assert out == [False]
    stop_env.write_text("1")
    os.kill(os.getpid(), signal.SIGTERM)  # during step 3
    assert r2.requested
    t2, out2 = _in_thread(r2.after_step, 3, 6)
    r0.store.wait([REQUEST_KEY], timedelta(seconds=300))  # rank 2's request is in before rank 0 ends step 3
    assert r0.after_step(3, 6) is True
    assert r1.after_step(3, 6) is True  # a rank that never saw the signal follows rank 0's word
    t2.join(60)
    assert out2 == [True]
    assert [r.stopped_after for r in (r0, r1, r2)] == [3, 3, 3]


def test_a_rank_waiting_in_the_store_still_hears_its_sigterm(stop_env, monkeypatch):
    """The two-host case: the only rank a SIGTERM reaches is waiting in the store (here the
    test hold; every rank other than 0 also waits for rank 0's word after each step). Its
    handler must run during that wait and publish the request, or the job hangs until the
    store's timeout. The signal is sent once the rank has said it holds."""
    import torch.distributed as dist

    import rrfp.train.stop as stop
    from rrfp.train.stop import HOLD_ENV, REQUEST_KEY, STOP_FILE_ENV, GracefulStop

    holding = threading.Event()
    monkeypatch.setattr(stop, "say", lambda line, *a: holding.set() if "holding after step 2" in line else None)
    monkeypatch.setenv(HOLD_ENV, "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.HashStore()
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_env.parent / "node0-stop"))
    r0 = GracefulStop(store, 0, 2)  # node 0: no SIGTERM there
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_env))
    r1 = GracefulStop(store, 1, 2, timeout_s=120)  # node 1, the last rank: it holds, and the SIGTERM is its

    def rank0() -> bool:
        assert r0.after_step(2, 6) is False
        assert holding.wait(120)
        stop_env.write_text("1")  # node 1's daemon: its stop file, then the signal
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in the main thread: rank 1's, in its wait
        # Step 3 needs rank 1, which holds until the request is in: rank 0 ends it after that.
        r0.store.wait([REQUEST_KEY], timedelta(seconds=120))
        return r0.after_step(3, 6)

    t, out = _in_thread(rank0)
    assert r1.after_step(2, 6) is False  # heard "go", held, and the request went out during the hold
    assert r1.requested
    assert r1.after_step(3, 6) is True
    t.join(120)
    assert out == [True]


def test_a_sigterm_before_the_stop_file_is_a_stop_once_the_file_comes(stop_env, monkeypatch):
    """SIGTERM to the whole process group: the rank's handler may run before its launcher's
    writes the stop file. The rank waits for the file (main: it died at once) and, once it
    comes, asks to stop as if the launcher's SIGTERM had come first."""
    import torch.distributed as dist

    import rrfp.train.stop as stop
    from rrfp.train.stop import REQUEST_KEY, GracefulStop

    monkeypatch.setattr(stop, "LAUNCHER_WINDOW_S", 600.0)  # this test's process must not die of it
    store = dist.HashStore()
    r0 = GracefulStop(store, 0)
    r1 = GracefulStop(store, 1)  # the last installed SIGTERM handler: the signal below is rank 1's
    os.kill(os.getpid(), signal.SIGTERM)  # before the launcher's file: rank 1's handler
    assert not r1.requested and not r0.store.check([REQUEST_KEY])
    stop_env.write_text("1")  # the launcher's handler
    r0.store.wait([REQUEST_KEY], timedelta(seconds=300))
    assert r1.requested and r0.store.get(REQUEST_KEY) == b"1"


@pytest.mark.parametrize("window, signals", [(0.05, 1), (600.0, 2)])
def test_a_sigterm_no_stop_file_follows_kills_the_rank(tmp_path, window, signals):
    """No launcher's stop file within the window (a failed group's survivors), or a second
    SIGTERM while it is still missing: the rank dies of SIGTERM, as torchrun's agent expects."""
    code = f"""if True:
        import os, signal, torch.distributed as dist
        import rrfp.train.stop as stop
        stop.LAUNCHER_WINDOW_S = {window}
        g = stop.GracefulStop(dist.HashStore(), 1)
        for _ in range({signals}):
            os.kill(os.getpid(), signal.SIGTERM)
        while True:
            signal.pause()  # the window's end sends this process its SIGTERM again
    """
    from rrfp.train.stop import STOP_FILE_ENV

    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, STOP_FILE_ENV: str(tmp_path / "none")},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGTERM, p.stderr[-2000:]
    assert "ending the step in progress" not in p.stderr


def test_without_a_request_ranks_go_on_and_the_last_step_is_never_a_stop(stop_env):
    import torch.distributed as dist

    from rrfp.train.stop import GracefulStop, verdict_key

    store = dist.HashStore()
    r0, r1 = GracefulStop(store, 0), GracefulStop(store, 1)
    for k in range(1, 4):
        t, out = _in_thread(r1.after_step, k, 4)
        assert r0.after_step(k, 4) is False
        t.join(60)
        assert out == [False]
    assert r0.store.check([verdict_key(3)]) and not r0.store.check([verdict_key(1)])  # old words are deleted
    stop_env.write_text("1")
    assert r0.after_step(4, 4) is False and r1.after_step(4, 4) is False  # the run is over: exit 0


def test_a_rank_stopped_by_another_nodes_request_tells_its_daemon(tmp_path, stop_env, monkeypatch):
    """Node 1's rank follows rank 0's stop word although its own daemon got no SIGTERM; it
    writes its daemon's stop file (``peer``), which is how that daemon knows to exit 143
    without restarting the group."""
    import torch.distributed as dist

    from rrfp.train.stop import PEER, REQUEST_KEY, STOP_FILE_ENV, GracefulStop, StopForwarder

    store = dist.HashStore()
    r0 = GracefulStop(store, 0)  # node 0: its daemon got the SIGTERM
    other = tmp_path / "node1-stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(other))
    r1 = GracefulStop(store, 1)  # node 1
    stop_env.write_text("1")
    daemon1 = StopForwarder(other, "unused", children=lambda: [])
    assert not daemon1.peer_asked()
    r0.store.set(REQUEST_KEY, "0")
    assert r0.after_step(2, 6) is True and r1.after_step(2, 6) is True
    assert other.read_text() == PEER and daemon1.peer_asked()
    assert stop_env.read_text() == "1"  # the signalled node's file is not touched


def test_a_rank_with_no_word_from_rank_0_fails_in_one_line(stop_env):
    import torch.distributed as dist

    from rrfp.train.stop import GracefulStop

    r1 = GracefulStop(dist.HashStore(), 1, timeout_s=0.05)
    with pytest.raises(TimeoutError, match=r"^rank 1: no word from rank 0 on whether to go on after step 2 within 0.05 s"):
        r1.after_step(2, 6)


def test_stop_forwarder_passes_sigterm_on_or_leaves_to_the_agent(tmp_path):
    """With ranks running, the forwarder writes the stop file, then signals each rank; with none
    (the rendezvous), or after training (the linger), it raises torch's SignalException, on
    which the agent stops the ranks at once. A second SIGTERM does nothing."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from rrfp.train.stop import StopForwarder

    child = Proc([sys.executable, "-c", "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                  "print('ready', flush=True)\nsignal.pause()\n"], dict(os.environ))
    try:
        child.wait_for("ready", 120)
        asked = []
        fwd = StopForwarder(tmp_path / "stop", "asked", children=lambda: [child.p.pid], on_request=lambda: asked.append(1))
        fwd(signal.SIGTERM, None)
        assert child.finish(120) == 7 and (tmp_path / "stop").exists() and fwd.requested and asked == [1]
        fwd(signal.SIGTERM, None)  # again: nothing
        assert asked == [1]
    finally:
        child.kill()
    idle = StopForwarder(tmp_path / "stop2", "asked", children=lambda: [])
    with pytest.raises(SignalException):
        idle(signal.SIGTERM, None)
    assert not (tmp_path / "stop2").exists()
    lingering = StopForwarder(tmp_path / "stop3", "asked", children=lambda: [1], finished=lambda: True)
    with pytest.raises(SignalException):
        lingering(signal.SIGTERM, None)
    assert lingering.after_training and not (tmp_path / "stop3").exists()
    over = StopForwarder(tmp_path / "stop4", "asked", children=lambda: [])
    over.ended = True  # the launch is over: a SIGTERM is only noted (no exception while the last line is written)
    over(signal.SIGTERM, None)
    assert over.requested and not (tmp_path / "stop4").exists()


def _losses(path) -> dict[int, str]:
    return {int(a): b for a, b in (ln.split() for ln in path.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigterm_to_rrfp_train_ends_the_step_in_progress_commits_exits_143_and_resumes(tmp_path):
    """The launcher's SIGTERM while rank 0 is inside step 3 (the last rank holds after step 2
    until a stop is asked, test hook): both ranks end step 3, its checkpoint is committed,
    ranks and launcher exit 143 (main: the ranks died at once, nothing saved, and the hook
    never held). Run again with ``--resume auto``, the job continues from step 3 and finishes
    with exit 0, its losses those of an uninterrupted run, bit for bit."""
    from rrfp.train import checkpoint as ck
    from rrfp.train.stop import HOLD_ENV, PREEMPTED

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", HOLD_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    flags = [sys.executable, "-m", "rrfp", "train", *SMALL, "--stages", "2", "--steps", "5"]
    ref = Proc(flags + ["--loss-file", str(tmp_path / "ref.txt")], env)
    assert ref.finish(900) == 0, ref.output()
    ckdir = tmp_path / "ck"
    run = Proc(flags + ["--checkpoint-dir", str(ckdir), "--loss-file", str(tmp_path / "a.txt")], {**env, HOLD_ENV: "2"})
    try:
        run.wait_for("holding after step 2", 900)
        run.p.send_signal(signal.SIGTERM)
        rc = run.finish(600)
    finally:
        run.kill()
    out = run.output()
    assert rc == PREEMPTED == 143, out
    assert "rrfp train: stopped after step 3 on request (SIGTERM), the step in progress; exit 143" in out, out
    assert f"every rank ended the step in progress and exited 143; latest checkpoint {ck.step_dir(ckdir, 3)} (step 3)" \
        in out, out
    assert "Traceback" not in out and "exitcode" not in out, out
    assert ck.latest(ckdir) == ck.step_dir(ckdir, 3)
    # The resumed run binds its ZeroMQ sockets in a port range (--port-range): it trains the same.
    again = Proc(flags + ["--checkpoint-dir", str(ckdir), "--resume", "auto", "--loss-file", str(tmp_path / "b.txt"),
                          "--port-range", "41000-41099"], env)
    assert again.finish(900) == 0, again.output()
    assert f"resumed from {ck.step_dir(ckdir, 3)} at step 3" in again.output()
    want = _losses(tmp_path / "ref.txt")
    assert sorted(want) == [1, 2, 3, 4, 5]
    assert _losses(tmp_path / "a.txt") == {k: want[k] for k in (1, 2, 3)}
    assert _losses(tmp_path / "b.txt") == {k: want[k] for k in (4, 5)}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigterm_to_rrfp_trains_whole_process_group_stops_as_sigterm_to_the_launcher_does(tmp_path):
    """``timeout -s TERM``, ``kill -TERM -PGID``, systemd and Slurm signal every process of the
    job at once: the launcher, the zygote, the store's host and the ranks. Sent once step 1's
    line is out, the job stops as on the launcher's own SIGTERM: exit 143, the step in progress
    committed and named in the last line, and ``--resume auto`` goes on from it. (Before: the
    zygote and the store died of the signal, and a rank whose handler ran before the launcher
    wrote the stop file died at once: exit 143 with "no checkpoint committed" after 33 steps.)"""
    from rrfp.train.stop import HOLD_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", HOLD_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    steps = 200
    ckdir = tmp_path / "ck"
    flags = [sys.executable, "-m", "rrfp", "train", *[f for f in SMALL if f != "--quiet"], "--stages", "2",
             "--checkpoint-dir", str(ckdir)]
    run = Proc(flags + ["--steps", str(steps)], env, new_session=True)
    try:
        run.wait_for(f"step    1/{steps} ", 900)
        os.killpg(run.p.pid, signal.SIGTERM)
        rc = run.finish(600)
    finally:
        if run.p.poll() is None:
            os.killpg(run.p.pid, signal.SIGKILL)
        run.kill()
    done = _stopped_at_a_committed_step(run, rc, "rrfp train", ckdir, steps, flags, env)
    out = run.output()
    assert f"rrfp train: stopped after step {done} on request (SIGTERM), the step in progress; exit 143" in out, out
    assert "Traceback" not in out and "exitcode" not in out, out


def _stopped_at_a_committed_step(run, rc: int, who: str, ckdir, steps: int, argv: list[str], env) -> int:
    """A run stopped by SIGTERM as documented: exit 143, the step in progress committed and
    named in ``who``'s last line, and ``--resume auto`` going on from it; returns that step."""
    from rrfp.train import checkpoint as ck
    from rrfp.train.stop import PREEMPTED

    out = run.output()
    assert rc == PREEMPTED == 143, out
    path = ck.latest(ckdir)
    assert path is not None, out
    done = ck.read_meta(path)["step"]
    assert 1 <= done < steps and path == ck.step_dir(ckdir, done), out
    assert run.lines[-1] == f"{who}: stopped on SIGTERM: every rank ended the step in progress and exited 143; " \
        f"latest checkpoint {ck.step_dir(ckdir, done)} (step {done})", out
    again = Proc(argv + ["--steps", str(done + 1), "--resume", "auto"], env)
    assert again.finish(900) == 0, again.output()
    assert f"resumed from {ck.step_dir(ckdir, done)} at step {done}" in again.output(), again.output()
    assert ck.latest(ckdir) == ck.step_dir(ckdir, done + 1)
    return done


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigterm_to_every_process_of_rrfp_node_stops_as_sigterm_to_the_daemon_does(tmp_path):
    """torch's agent starts ``rrfp node``'s ranks in sessions of their own, so ``kill -TERM
    -PGID`` reaches the daemon alone (the launcher's case above); systemd's control-group stop
    and Slurm signal every process, here the ranks first, then the daemon. The ranks wait for
    the daemon's stop file instead of dying before it is written: exit 143, the step in
    progress committed and named in the last line, and ``--resume auto`` goes on from it."""
    from node_hosts import node_env
    from procs import descendants

    steps = 200
    ckdir = tmp_path / "ck"
    argv = [sys.executable, "-m", "rrfp", "node", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "0",
            "--max-restarts", "0", "--metrics-port", "0", "--", *[f for f in SMALL if f != "--quiet"], "--stages", "2",
            "--checkpoint-dir", str(ckdir)]
    d = Proc(argv + ["--steps", str(steps)], node_env(), new_session=True)
    try:
        d.wait_for(f"step    1/{steps} ", 900)
        for pid in sorted(descendants(d.p.pid)) + [d.p.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        rc = d.finish(600)
    finally:
        if d.p.poll() is None:
            os.killpg(d.p.pid, signal.SIGKILL)
        d.kill()
    _stopped_at_a_committed_step(d, rc, "rrfp node", ckdir, steps, argv, node_env())


def test_a_stop_file_there_when_a_starved_waiter_first_looks_is_a_stop_not_a_death(tmp_path, monkeypatch):
    """A SIGTERM came before the launcher's stop file; the thread that waits for the file ran
    only after its window had passed (a loaded machine), when the file was there: a stop asked
    in time, not a rank killed (on main before this the thread never looked once)."""
    from rrfp.train import stop as stop_mod
    from rrfp.train.stop import GracefulStop

    (tmp_path / "stop").write_text("")
    g = GracefulStop.__new__(GracefulStop)
    g.stop_file, g._die = str(tmp_path / "stop"), False
    asked, killed = [], []
    g._request = lambda: asked.append(True)
    clock = iter([0.0] + [1e9] * 10)  # the window's start, then long past it
    monkeypatch.setattr(stop_mod.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(stop_mod.os, "kill", lambda pid, sig: killed.append(sig))
    g._await_launcher()
    assert asked == [True] and killed == [] and not g._die

