"""The ranks of ``rrfp train`` on one machine, forked from a zygote that imported torch once.

A fresh Python process spends most of a short run importing torch and rrfp (2-3 s of CPU per
process on a 2-core machine: a 2-rank run paid it three times, launcher included). So
``rrfp train`` starts its ranks with multiprocessing's ``forkserver`` start method: one server
process, the zygote, imports :data:`PRELOAD` once, and every rank is a ``fork`` of it. The
launcher imports no torch at all; the rendezvous store lives in one more forked process.
``torchrun -m rrfp train`` and ``rrfp node`` start their ranks as before, as fresh processes
under torch's elastic agent: ranks a user's launcher starts are not ours to fork.

Each rank gets what a fresh process under torchrun's agent gets: the launcher's environment
plus the agent's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_ERROR_FILE``, ...), default signal
handlers (the forkserver restores them in each child), ``PR_SET_PDEATHSIG`` on its parent,
the zygote, which exits when the launcher does (the launcher holds its end of a pipe),
unbuffered stdout and stderr (torchrun runs ranks with ``python -u``), and its own random
state (Python's ``random`` reseeds itself after a fork; ranks seed torch from ``--seed``).
The environment reaches a rank through the zygote's Unix socket, not ``exec``: the job secret
is not in ``/proc/<rank>/environ``, which shows the zygote's environment at its start. A rank
is named ``rrfp rank N`` (``/proc/<pid>/comm``, what ``ps -e`` and ``top`` show).

The zygote must stay a clean image to fork: it never initialises CUDA (a child forked from a
process with a CUDA context cannot use CUDA; importing torch does not initialise it) and starts
no thread (a fork copies only the calling thread: no OpenMP pool, no ZeroMQ context, no store).
Nothing in :data:`PRELOAD` may do either at import; tests/test_zygote.py checks both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

PRELOAD = ["rrfp.train.zygote_init", "rrfp.train.zygote", "rrfp.cli", "rrfp.train.cli", "rrfp.train.worker", "rrfp.train.checkpoint",
           "rrfp.train.ckpt_verify", "rrfp.train.flops", "rrfp.train.models", "rrfp.train.optim", "rrfp.train.stepline",
           "rrfp.train.stop", "rrfp.train.ckpt_lock", "rrfp.obs.metrics", "rrfp.obs.server", "rrfp.runtime.features.auto", "rrfp.transport.zmq", "torch.optim",
           "torch._dynamo", "torch.distributed.checkpoint", "numpy.random", "uvloop", "zmq.asyncio", "encodings.idna"]
"""What the zygote imports before its first fork: what every rank of a run imports (the
worker, the optimizer, torch.distributed's checkpointing and ``env://`` rendezvous). A missing
module costs each rank its own import, nothing else (multiprocessing skips a failed preload).
The first, :mod:`rrfp.train.zygote_init`, makes the zygote die with its launcher."""

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The launcher's signals, torchrun's: each stops the ranks with the same signal."""

GRACE_S = 30.0
"""How long stopped ranks may take before SIGKILL, and SIGKILLed ones before they are left
(torchrun's agent waits as long)."""

SETTLE_S = 0.5
"""After a rank fails, how long the others may take to end by themselves and say why, before
the launcher stops them (torchrun's monitor interval in ``rrfp train``)."""

_BORN_IN = os.getpid()
"""The process that imported this module: in the zygote, which preloads it, the zygote."""


class Signalled(Exception):
    """The launcher got one of :data:`SIGNALS`; ``sigval`` is the signal (built as torch's
    ``SignalException`` is, which :class:`rrfp.train.stop.StopForwarder` may raise instead)."""

    def __init__(self, message: str, sigval: int) -> None:
        super().__init__(message)
        self.sigval = sigval


def _raise(signum, frame) -> None:
    raise Signalled(f"{os.getpid()} got {signal.Signals(signum).name}", sigval=signum)


def context():
    """multiprocessing's ``forkserver`` context, its server preloading :data:`PRELOAD`
    (a server already running in this process, e.g. a test session's, is used as it is)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclasses.dataclass
class Failure:
    """A rank's non-zero end, with what torch's ``ProcessFailure`` holds and
    :func:`rrfp.train.cli.describe_failures` reads: the rank's error file
    (``TORCHELASTIC_ERROR_FILE``, :func:`rrfp.train.guard.write_error_file`) when it left one."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: int = 0
    error_file_data: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self.error_file_data = json.loads(Path(self.error_file).read_text())
            self.message = self.error_file_data.get("message", "")
            self.timestamp = int(self.error_file_data.get("timestamp", 0))
        except (OSError, ValueError, AttributeError):
            self.error_file_data, self.timestamp = {}, int(time.time())
        if not self.message and self.exitcode < 0:
            self.message = f"Signal {-self.exitcode} ({signal.Signals(-self.exitcode).name}) received by PID {self.pid}"


class LocalJob:
    """``world`` ranks of ``rrfp ARGV`` forked from the zygote around a store hosted by one
    more forked process (as torchrun's agent hosts it: every rank a client), each rank with
    the launcher's environment ``env`` plus torchrun's variables; an error file each in
    ``folder``. The launcher's side of torchrun's agent on one machine: :meth:`wait` returns
    when every rank ended or one failed, and stops the rest (SIGTERM, SIGKILL after
    :data:`GRACE_S`); :meth:`stop` also ends the job on a signal. Use it as a context
    manager: leaving it stops what still runs and the store."""

    def __init__(self, argv: list[str], world: int, env: dict[str, str], folder: str) -> None:
        self.argv, self.world, self.env, self.folder = list(argv), world, dict(env), folder
        self.run_id = str(uuid.uuid4())
        self.procs: list = []
        self.signalled: set[int] = set()
        """The pids this launcher signalled itself (:func:`rrfp.train.guard.root_cause`)."""
        self._ended: set[int] = set()  # pids of the ranks whose end the main thread has read
        self._store = self._store_conn = None

    def __enter__(self) -> "LocalJob":
        self._old = {s: signal.signal(s, _raise) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop(signal.SIGTERM)
        finally:
            if self._store is not None:
                try:
                    self._store_conn.send(None)  # the job is over: the store's host leaves
                except OSError:
                    pass
                self._store_conn.close()
                self._store.join(GRACE_S)
                if self._store.exitcode is None:
                    self._store.kill()
            for s, h in self._old.items():
                signal.signal(s, h)

    def start(self) -> None:
        """Start the store's host, then the ranks; returns once all are forked.

        Raises:
            RuntimeError: the store's host died before it said its port.
        """
        from multiprocessing.connection import wait

        from .._pdeathsig import LAUNCHER_PID_ENV

        ctx = context()
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # for the zygote (zygote_init), if it starts now
        self._store_conn, child = ctx.Pipe()
        self._store = ctx.Process(target=_host_store, args=(self.world, child, self.env), name="rrfp store")
        self._store.start()  # starts the zygote, unless this process runs one already
        os.environ.pop(LAUNCHER_PID_ENV, None)
        child.close()
        wait([self._store_conn, self._store.sentinel])  # the zygote's imports come first: no bound here
        if not self._store_conn.poll():
            raise RuntimeError(f"the rendezvous store's process ended (exit code {self._store.exitcode}) before it started")
        port = self._store_conn.recv()
        for r in range(self.world):
            env = {**self.env, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                   "ROLE_NAME": "default", "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
                   "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                   "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": self.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                   "TORCHELASTIC_ERROR_FILE": self._error_file(r)}
            p = ctx.Process(target=_rank, args=(self.argv, env), name=f"rrfp rank {r}")
            p.start()
            self.procs.append(p)

    def running(self) -> list[int]:
        """The pids of the ranks started and not yet seen ended. Safe in a signal handler (the
        launcher's SIGTERM forwarder): it reads no exit status. A rank's status is one read of
        the zygote's pipe (multiprocessing's ``forkserver`` ``Popen.poll``); a handler that
        read it while the main thread, interrupted, was between that pipe's readiness and its
        read left the main thread an empty pipe, and the rank's exit code became 255."""
        return [p.pid for p in self.procs if p.pid not in self._ended]

    def _exitcode(self, p) -> int | None:
        """``p.exitcode``, read on the main thread only (see :meth:`running`)."""
        code = p.exitcode
        if code is not None:
            self._ended.add(p.pid)
        return code

    def _error_file(self, rank: int) -> str:
        return os.path.join(self.folder, f"error-{rank}.json")

    def wait(self) -> dict[int, Failure]:
        """Wait until every rank ended, or one failed and the others ended within
        :data:`SETTLE_S` or were stopped; returns the failed ranks (empty: all exited 0).

        Raises:
            Signalled: the launcher got one of :data:`SIGNALS` (the ranks still run).
        """
        from multiprocessing.connection import wait

        live = {p.sentinel: p for p in self.procs}
        failed_at = None
        while live:
            left = None if failed_at is None else failed_at + SETTLE_S - time.monotonic()
            ready = wait(list(live), None if left is None else max(left, 0.0))
            if not ready:
                break
            for s in ready:
                p = live.pop(s)
                p.join()
                if self._exitcode(p) != 0 and failed_at is None:
                    failed_at = time.monotonic()
        self.stop(signal.SIGTERM)
        return {r: Failure(r, p.pid, code, self._error_file(r))
                for r, p in enumerate(self.procs) if (code := self._exitcode(p)) not in (0, None)}

    def stop(self, sig: int) -> None:
        """Send ``sig`` to the ranks still running, SIGKILL to those left after
        :data:`GRACE_S`, and wait as long again (a rank stuck in the kernel is left)."""
        from multiprocessing.connection import wait

        for kill in (sig, signal.SIGKILL):
            alive = [p for p in self.procs if self._exitcode(p) is None]
            for p in alive:
                try:
                    os.kill(p.pid, kill)
                    self.signalled.add(p.pid)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + GRACE_S
            while alive and (left := deadline - time.monotonic()) > 0:
                wait([p.sentinel for p in alive], left)
                alive = [p for p in alive if self._exitcode(p) is None]
            if not alive:
                return


def _become(env: dict[str, str], name: str) -> None:
    """Turn a fresh fork of the zygote into a process of the job: its environment, death
    with its parent (the zygote), its name, and ``python -u``'s unbuffered stdout/stderr."""
    import io

    from .._pdeathsig import LAUNCHER_PID_ENV, die_with_parent, set_parent_death_signal

    release_server_pipe()
    os.environ.clear()
    os.environ.update(env)
    if _BORN_IN != os.getpid():  # preloaded: the zygote is the parent to outlive
        os.environ[LAUNCHER_PID_ENV] = str(_BORN_IN)
    if "LOCAL_RANK" in env:
        die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's ignore (zygote_init) is not a rank's
    else:
        set_parent_death_signal()
    _set_name(name)
    for attr, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, attr)
        setattr(sys, attr, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                            errors=old.errors, write_through=True))


def release_server_pipe() -> None:
    """Close this fork's copy of the zygote's "alive" pipe. The forkserver hands each child a
    copy (so that it could ask the server for processes of its own) and exits only when every
    copy is closed: with the ranks holding theirs, a SIGKILLed launcher left the zygote, and so
    the ranks (their death signal is the zygote's exit), running. Each copy closed, the zygote
    exits with the launcher and every rank gets its SIGKILL. The attribute is multiprocessing's
    own (``forkserver.ForkServer``, unchanged since Python 3.4); a rank that starts processes
    through a forkserver gets a server of its own."""
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        forkserver._forkserver._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


def _set_name(name: str) -> None:
    """``prctl(PR_SET_NAME)``: the process's name in ``/proc/<pid>/comm`` (15 bytes; Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


def _rank(argv: list[str], env: dict[str, str]) -> None:
    """A rank: ``python -u -m rrfp ARGV`` as torchrun's agent runs it, by the same mechanism
    (runpy, what ``-m`` uses) in a fork of the zygote."""
    import runpy

    _become(env, f"rrfp rank {env['RANK']}")
    sys.argv = [sys.argv[0], *argv]  # runpy puts rrfp/__main__.py's path first, as -m does
    runpy.run_module("rrfp", run_name="__main__", alter_sys=True)


def _host_store(world: int, conn, env: dict[str, str]) -> None:
    """The job's rendezvous store (a TCPStore on a port the OS picked, said on ``conn``),
    served until the launcher says the job is over on ``conn``. Ctrl-C reaches the terminal's whole process
    group, and a SIGTERM may (``timeout``, systemd, Slurm): the store ignores both (SIGTERM as the zygote
    did), so that the ranks can still end their step, commit, or say why they stop."""
    _become(env, "rrfp store")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    try:
        conn.recv()  # the launcher's word that the job is over
    except EOFError:
        # The launcher died. The store stays until the zygote's exit kills this process with
        # the ranks (PR_SET_PDEATHSIG): no rank sees its store vanish first and fails on its own.
        while True:
            signal.pause()
