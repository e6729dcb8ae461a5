"""Clean ends (issue 32 item 4): a stage that never returns is reported by the watchdog with
every executor and the process exits; an interrupt inside a stage is raised once, and
``close()`` after it raises and prints nothing.

The hung stage waits on a ``threading.Event`` nobody sets; it runs in a child process whose
end is the event the test waits for, under a timeout (on main it never ends).
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import rrfp

HUNG = textwrap.dedent("""
    import sys, threading, torch, torch.nn.functional as F
    import rrfp
    from rrfp.errors import WatchdogTimeout

    never = threading.Event()  # nobody sets it

    class Hangs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            never.wait()
            return self.lin(x)

    torch.manual_seed(0)
    pipe = rrfp.LocalPipeline([Hangs(), torch.nn.Linear(4, 4)], 2, F.mse_loss, watchdog=0.5,
                              executor=sys.argv[1], hint="bf")
    try:
        with pipe:
            pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    except WatchdogTimeout as e:
        print(f"caught: {e}", flush=True)
    print("script over", flush=True)
""")


def _run_hung(tmp_path, executor: str) -> subprocess.CompletedProcess:
    script = tmp_path / "hung.py"  # a file, so that the stack shows its lines
    script.write_text(HUNG)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([sys.executable, str(script), executor], env=env, capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired as e:  # main: the process never ends
        raise AssertionError(f"the {executor} executor's hung stage kept the process alive; stderr:\n"
                             f"{e.stderr}") from None


def test_watchdog_ends_the_process_whose_inline_stage_holds_the_loop_thread(tmp_path):
    """Inline, the hung task holds the loop thread: the watchdog thread writes the stuck
    thread's stack, then one line naming rank, stages, task and step, and ends the process
    with exit code 1 (nothing after the step runs)."""
    r = _run_hung(tmp_path, "inline")
    from rrfp.runtime.engine.watchdog import STUCK_EXIT  # after the run: on main, the hang is what fails

    assert r.returncode == STUCK_EXIT == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("rrfp: watchdog: rank 0 (stages [0]) stuck in task 0F0 of step 0 for "), lines[-1]
    assert lines[-1].endswith(" s (watchdog 0.5 s); ending the process (exit 1)"), lines[-1]
    assert "where rank 0's task 0F0 is stuck:" in r.stderr
    assert "never.wait()" in r.stderr  # the stack of the stuck thread, down to the user's line
    assert "script over" not in r.stdout


def test_watchdog_fails_the_step_whose_thread_stage_never_returns_and_the_process_exits(tmp_path):
    """With ``executor="thread"`` the hung task holds a worker thread: the step raises
    WatchdogTimeout naming the stuck rank and task (not rank 1, which only waits for it), the
    script goes on, and the process exits although the worker never returns."""
    r = _run_hung(tmp_path, "thread")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("caught: rank 0 (stages [0]) stuck in task 0F0 of step 0 for "), r.stdout
    assert r.stdout.splitlines()[-1] == "script over"
    assert "never.wait()" in r.stderr


def test_a_stuck_task_keeps_its_loop_busy_until_its_report_reaches_the_loop(capfd, monkeypatch):
    """The watchdog thread reports rank 0's stuck task (writing its stack takes a while); until
    the report is taken in on rank 0's loop, rank 1 of the same loop, which only waits for rank
    0, must not judge itself stalled, or its timeout fails the step first and is the one named
    (a CI run named rank 1 so). Forced order: the report is made, the loop has not turned."""
    import asyncio
    import threading
    import types

    import rrfp.runtime.engine.watchdog as wd

    loop = asyncio.new_event_loop()
    got = []
    w = wd.TaskWatch(0, 0.5, [0], lambda step, exc: got.append((step, str(exc))))
    w.loop, w.loop_thread = loop, threading.get_ident()
    w.clock = lambda: 10.0  # a whole period after the task's start
    w.current = ("0F0", 3, 9.0, -1)  # started at 9.0 s on a worker thread (no stack to write)
    monkeypatch.setattr(wd, "_WATCHER", types.SimpleNamespace(watches=lambda: [w]))
    try:
        w.check()
        assert w.busy and wd.loop_busy(loop)  # reported, not yet taken in by the loop
        assert got == []
        loop.run_until_complete(asyncio.sleep(0))
        assert not w.busy and not wd.loop_busy(loop)
        w.check()  # reported once
    finally:
        loop.close()
    assert got == [(3, "rank 0 (stages [0]) stuck in task 0F0 of step 3 for 1.0 s (watchdog 0.5 s)")]
    assert capfd.readouterr().err.count("where rank 0's task 0F0 is stuck:") == 1


def test_a_launched_task_not_yet_running_or_not_yet_taken_in_keeps_its_loop_busy(monkeypatch):
    """Between a worker-thread launch and the thread starting the task, and between its return
    and the loop taking its result in, the rank runs no task the watchdog thread sees; a rank of
    the same loop waiting for it must still not judge itself stalled (it would fail the step
    and be named). Forced states: a task queued, none current; then nothing queued; then the
    queued one reported stuck (its report taken in: the rank no longer keeps others waiting)."""
    import asyncio
    import collections
    import types

    import rrfp.runtime.engine.watchdog as wd

    loop = asyncio.new_event_loop()
    queued = collections.deque()
    w = wd.TaskWatch(0, 0.5, [0], lambda step, exc: None, queued)
    w.loop = loop
    monkeypatch.setattr(wd, "_WATCHER", types.SimpleNamespace(watches=lambda: [w]))
    try:
        assert not w.busy and not wd.loop_busy(loop)
        queued.append("0F0 launched")
        assert w.current is None and w.busy and wd.loop_busy(loop)
        queued.clear()
        assert not w.busy
        w.current = ("0F0", 3, 9.0, -1)
        queued.append("0F0 launched")
        assert w.busy
        w._reported = w.current  # its stuck report taken in on the loop
        assert not w.busy and not wd.loop_busy(loop)
    finally:
        loop.close()


def test_a_step_after_a_stuck_thread_stage_fails_at_once_naming_the_stuck_task(tmp_path):
    """The stuck task's worker thread never returns: a step started after the WatchdogTimeout
    would queue behind it (one rank: for ever; two: the other rank timed out and was named).
    It fails at once with a line naming the stuck rank and task, every time, and the script
    and the process end."""
    script = HUNG.replace(textwrap.dedent("""\
        try:
            with pipe:
                pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
        except WatchdogTimeout as e:
            print(f"caught: {e}", flush=True)"""), textwrap.dedent("""\
        with pipe:
            for k in range(3):
                try:
                    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
                except WatchdogTimeout as e:
                    print(f"caught: {e}", flush=True)"""))
    assert script != HUNG
    path = tmp_path / "hung_again.py"
    path.write_text(script)
    try:
        r = subprocess.run([sys.executable, str(path), "thread"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"a step after the stuck one hung; stderr:\n{e.stderr}") from None
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert len(lines) == 4 and lines[-1] == "script over", r.stdout
    assert lines[0].startswith("caught: rank 0 (stages [0]) stuck in task 0F0 of step 0 for "), lines[0]
    for line in lines[1:3]:
        assert line.startswith("caught: rank 0 (stages [0]) cannot run another step: its task 0F0 of step 0 has been "
                               "stuck on a worker thread for "), line
        assert line.endswith(" s (watchdog 0.5 s); close the pipeline"), line


class _Interrupts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise KeyboardInterrupt


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_close_after_a_keyboard_interrupt_in_a_stage_raises_and_prints_nothing(executor, caplog, capfd):
    """The interrupt leaves ``step`` once; ``close()`` afterwards neither raises it again nor
    logs "Task exception was never retrieved" (main: both, 45 traceback lines)."""
    torch.manual_seed(0)
    pipe = rrfp.LocalPipeline([_Interrupts(), torch.nn.Linear(4, 4)], 2, F.mse_loss, executor=executor, watchdog=60)
    raised = []
    try:
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    except KeyboardInterrupt:
        raised.append("step")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        try:
            pipe.close()
        except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt must not end pytest
            raised.append(f"close: {type(e).__name__}")
        gc.collect()  # asyncio logs an unretrieved task exception when the task is collected
    assert raised == ["step"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    out, err = capfd.readouterr()
    assert "KeyboardInterrupt" not in out + err


FINISHED_RANK = textwrap.dedent("""
    import argparse, datetime, sys, threading
    import torch.distributed as dist
    import rrfp.train.worker as worker

    def run(args):
        # What a rank may leave behind once its run is over: a daemon thread that goes in and
        # out of a torch C++ call releasing the GIL (a TCPStore wait here, as a poller or gloo's
        # work.wait() would), so that one of its returns falls inside the interpreter's
        # finalization (about 0.5 s with torch loaded), whatever the machine's load.
        store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        inside = threading.Event()

        def waits():
            while True:
                inside.set()
                try:
                    store.wait(["never"], datetime.timedelta(milliseconds=5))
                except Exception:
                    pass

        threading.Thread(target=waits, daemon=True).start()
        inside.wait()
        print("done", flush=True)
        return 0

    worker._main = run
    sys.exit(worker.main(argparse.Namespace(job_secret_file=None, insecure=False)))
""")


def test_a_finished_rank_exits_0_while_a_daemon_thread_is_inside_a_torch_call(tmp_path):
    """The flake of tests/test_two_hosts.py (rank 0 aborted after printing 'done': "terminate
    called without an active exception", SIGABRT), made deterministic: a daemon thread returns
    from a torch C++ call while the interpreter finalizes, and C++ aborts. A finished rank
    leaves by os._exit after flushing (rrfp/train/failures.py end_finished): exit 0, its
    output intact, no abort. Main: exit code 134 (-6), the terminate line on stderr."""
    script = tmp_path / "finished_rank.py"
    script.write_text(FINISHED_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # not a warning for each timed-out wait
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert "terminate called" not in r.stderr, r.stderr
    assert (r.returncode, r.stdout) == (0, "done\n"), r.stderr
