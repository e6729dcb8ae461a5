"""The benchmarks' rank processes: :func:`launch` runs a ``module:function`` in N of them (forked
from one starter process that imported torch once), with a timeout, the ranks' logs, and no
process left behind on any path (a failure, a timeout, SIGTERM, or the launcher SIGKILLed).

``python -m benchmarks.launcher`` is a rank's (or the starter's) entry point.
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank or the starter: die with the launcher, before torch's seconds of import
    from rrfp._pdeathsig import die_with_parent

    die_with_parent()

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from rrfp._pdeathsig import LAUNCHER_PID_ENV

from benchmarks.harness import BenchError

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LaunchResult:
    result: Any
    seconds: float
    logs: dict[int, str]


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


def launch(target: str, world: int, config: dict, timeout: float, threads: int = 1,
           kill_on_failure: bool = True) -> LaunchResult:
    """Run ``target`` (``"module:function"``, called with ``config``) in ``world`` rank processes.

    The ranks are forked from one starter process that imported torch and ``target``'s module
    first (:func:`_starter_main`): each rank would otherwise spend about 6 CPU-seconds importing
    them, which on 2 cores is most of a setting's time with 8 or 16 ranks. With
    ``RRFP_BENCH_PYSPY=DIR`` in the environment every rank is its own ``python`` under
    ``py-spy record`` instead (collapsed stacks in ``DIR``), for finding where a benchmark's time
    goes.

    The launcher hosts the rendezvous store on a port the OS picks; every rank joins it as a
    client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun) and initialises the default
    gloo process group from ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``. Rank 0's
    return value comes back as JSON.

    Raises:
        BenchError: a rank exited non-zero (its log's tail is in the message; the others are
            killed at once, or with ``kill_on_failure=False`` left to finish until the timeout)
            or the run exceeded ``timeout`` seconds (all are killed).
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    tmp = Path(tempfile.mkdtemp(prefix="rrfp-bench-"))
    result_path = tmp / "result.json"
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps({**config, "result_path": str(result_path), "threads": threads}))
    pythonpath = os.pathsep.join([str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": pythonpath,
    }
    prof = os.environ.get("RRFP_BENCH_PYSPY")
    ranks = _Ranks(tmp, world)
    t0 = time.monotonic()
    failed: str | None = None
    try:
        if prof:
            ranks.start_each(target, cfg_path, env, prof)
        else:
            ranks.start_forked(target, cfg_path, {**env, LAUNCHER_PID_ENV: str(os.getpid()), "LOCAL_RANK": "0"})
        while ranks.pids is None:  # the starter names its ranks once all are forked
            if ranks.starter_failed():
                failed = f"{target}: the rank processes did not start:\n{_tail(ranks.starter_log())}"
                break
            if time.monotonic() - t0 > timeout:
                failed = f"{target}: timed out after {timeout:.0f} s, before the ranks started"
                break
            time.sleep(0.05)
        if not failed:
            _announce_ranks(ranks.pids)
        while not failed:
            codes = ranks.codes()
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and (kill_on_failure or all(c is not None for c in codes)):
                r = bad[0]
                failed = f"{target}: rank {r} exited with code {codes[r]}:\n{_tail(ranks.logs[r].read_text())}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - t0 > timeout:
                failed = f"{target}: timed out after {timeout:.0f} s; rank 0's log:\n{_tail(ranks.logs[0].read_text())}"
                break
            time.sleep(0.1)
    finally:
        ranks.stop()
        del store
        # Read what the ranks left, then remove their folder (logs, config, result) on every path.
        texts = {r: log.read_text() if log.exists() else "" for r, log in enumerate(ranks.logs)}
        result_text = result_path.read_text() if result_path.exists() else None
        shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        raise BenchError(failed, texts)
    if result_text is None:
        raise BenchError(f"{target}: rank 0 wrote no result; its log:\n{_tail(texts.get(0, ''))}")
    return LaunchResult(json.loads(result_text), time.monotonic() - t0, texts)


class _Ranks:
    """The rank processes of one :func:`launch`: each in its own session (so one ``killpg``
    ends whatever it started), its output in ``tmp/rank<r>.log``."""

    def __init__(self, tmp: Path, world: int) -> None:
        self.tmp, self.world = tmp, world
        self.logs = [tmp / f"rank{r}.log" for r in range(world)]
        self.pids: list[int] | None = None
        self.procs: list[subprocess.Popen] = []  # py-spy mode: one per rank
        self.starter: subprocess.Popen | None = None

    def start_each(self, target: str, cfg_path: Path, env: dict, prof: str) -> None:
        """One ``python`` per rank under py-spy (collapsed stacks in ``prof/<target>.rank<r>.txt``)."""
        Path(prof).mkdir(parents=True, exist_ok=True)
        for r in range(self.world):
            out = Path(prof) / f"{target.replace(':', '.')}.rank{r}.txt"
            cmd = ["py-spy", "record", "--nonblocking", "--rate", "500", "--format", "raw", "--output", str(out), "--",
                   sys.executable, "-m", "benchmarks.launcher", target, str(cfg_path)]
            with open(self.logs[r], "w") as fh:
                self.procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=fh,
                                                   stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), start_new_session=True))
        self.pids = [p.pid for p in self.procs]

    def start_forked(self, target: str, cfg_path: Path, env: dict) -> None:
        """The starter process (:func:`_starter_main`), which forks the ranks."""
        with open(self.tmp / "starter.log", "w") as fh:
            self.starter = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.launcher", STARTER, target, str(cfg_path), str(self.world),
                 str(self.tmp)], env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                start_new_session=True)

    def starter_failed(self) -> bool:
        if self.starter is not None and self.starter.poll() is not None:
            self._read_pids()
            return self.pids is None
        self._read_pids()
        return False

    def starter_log(self) -> str:
        path = self.tmp / "starter.log"
        return path.read_text() if path.exists() else ""

    def _read_pids(self) -> None:
        path = self.tmp / "pids"
        if self.pids is None and path.exists():
            self.pids = [int(x) for x in path.read_text().split(",")]

    def codes(self) -> list[int | None]:
        """Each rank's exit status (``Popen.returncode``'s form: ``-N`` for signal ``N``), None
        while it runs."""
        if self.procs:
            return [p.poll() for p in self.procs]
        # Whether the starter is gone, asked before the files are read: it publishes a rank's
        # code, then may exit at once, so a file missing after it was seen gone never comes.
        gone = self.starter is not None and self.starter.poll() is not None
        out: list[int | None] = []
        for r in range(self.world):
            path = self.tmp / f"rank{r}.code"
            out.append(int(path.read_text()) if path.exists() else None)
        if gone:
            # The starter waits for every rank; gone early, its ranks died with it.
            out = [c if c is not None else -int(signal.SIGKILL) for c in out]
        return out

    def stop(self) -> None:
        """Kill whatever still runs (each rank's session, then the starter's) and wait."""
        codes = self.codes() if self.pids is not None else [None] * self.world
        for pid, code in zip(self.pids or [], codes):
            if code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in [*self.procs, *([self.starter] if self.starter else [])]:
            if p.poll() is None and p is self.starter and self.pids is None:
                try:  # no ranks forked yet: the starter alone
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


STARTER = "--starter"
"""First argument of ``python -m benchmarks.harness`` for :func:`_starter_main`."""


def _starter_main(argv: list[str]) -> None:
    """``python -m benchmarks.harness --starter module:function config.json WORLD TMP``: import
    torch and ``module`` once, then fork ``WORLD`` ranks, each in its own session with its output
    in ``TMP/rank<r>.log`` and dying with this process; write their pids to ``TMP/pids``, then
    each one's exit status to ``TMP/rank<r>.code`` as it ends (``-N``: killed by signal ``N``)."""
    import importlib

    from rrfp._pdeathsig import die_with_parent

    target, cfg_path, world, tmp = argv[0], argv[1], int(argv[2]), Path(argv[3])
    import torch.distributed  # noqa: F401 - the imports every rank shares, done once

    importlib.import_module(target.split(":")[0])
    for extra in ("torch.distributed.pipelining", "rrfp.runtime.doors.pipeline"):
        try:
            importlib.import_module(extra)
        except ImportError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    pids: dict[int, int] = {}
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                fd = os.open(tmp / f"rank{r}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                os.environ.update({"RANK": str(r), "LOCAL_RANK": str(r), LAUNCHER_PID_ENV: str(me)})
                die_with_parent()
                _worker_main([target, cfg_path])  # exits the process itself
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids[pid] = r
    publish(tmp / "pids", ",".join(str(p) for p in pids))
    while pids:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        r = pids.pop(pid, None)
        if r is not None:
            publish(tmp / f"rank{r}.code", str(-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                                                else os.waitstatus_to_exitcode(status)))
    os._exit(0)


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all, as the launcher polls for it: a file written in
    place exists, empty, before its text is in (a rank's exit code read as ``''`` failed a
    whole setting of ``rrfp bench``)."""
    part = path.with_name(path.name + ".tmp")
    part.write_text(text)
    part.replace(path)


LAUNCHED_ENV = "RRFP_TEST_BENCH_LAUNCHED"
"""Test hook (never set outside tests): a path (a FIFO) to which :func:`launch` writes its
ranks' pids, comma-separated, once every rank is started, so a test can signal the launcher
at that point without a timer (``tests/test_bench_cli.py``)."""


def _announce_ranks(pids: Sequence[int]) -> None:
    path = os.environ.get(LAUNCHED_ENV)
    if path:
        with open(path, "w") as fh:  # a FIFO: blocks until the test reads
            fh.write(",".join(str(p) for p in pids) + "\n")


def _worker_main(argv: list[str]) -> None:
    """Entry point of one rank process: ``python -m benchmarks.launcher module:function config.json``."""
    import importlib

    import torch
    import torch.distributed as dist

    target, cfg_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(int(cfg.get("threads", 1)))
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(cfg.get("pg_timeout", 180))))
    # Every rank through gloo's connection handshake before any may exit: a target that returns
    # at once (a rank with nothing to do) closed its sockets while a slower peer was still in
    # init_process_group, and that peer failed with "connectFullMesh ... closed by peer".
    dist.barrier()
    mod_name, fn_name = target.split(":")
    try:
        fn: Callable[[dict], Any] = getattr(importlib.import_module(mod_name), fn_name)
        result = fn(cfg)
        if dist.get_rank() == 0 and result is not None:
            path = Path(cfg["result_path"])
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(path)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo and ZeroMQ threads are done, and exiting at once means a
    # finished rank never waits on a peer's socket.
    os._exit(0)


def idle(cfg: dict) -> None:
    """A rank target that waits ``cfg["seconds"]``, or fails at once on rank ``cfg["fail_rank"]``
    (for testing the launcher's timeout and failure handling)."""
    import torch.distributed as dist

    if dist.get_rank() == cfg.get("fail_rank", -1):
        raise RuntimeError("failing on purpose")
    time.sleep(float(cfg.get("seconds", 3600)))


if __name__ == "__main__":
    if sys.argv[1:2] == [STARTER]:
        _starter_main(sys.argv[2:])
    else:
        _worker_main(sys.argv[1:])
