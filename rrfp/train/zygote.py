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
handlers (the forkserver restores them in each child; SIGINT's is taken once the rank can say
it was interrupted, :data:`HELD_BY_ZYGOTE`), ``PR_SET_PDEATHSIG`` on its parent,
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

import contextlib
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

HELD_BY_ZYGOTE = (signal.SIGINT, signal.SIGTERM)
"""Blocked while the launcher starts the zygote, so that Ctrl-C or a group's SIGTERM cannot
reach it before :mod:`rrfp.train.zygote_init` runs (Python's startup and its first imports:
a KeyboardInterrupt traceback, or a zygote dead before its store started). There SIGTERM is
ignored and unblocked; SIGINT stays blocked in the zygote for good, and in its forks until a
rank is ready to say it was interrupted (:func:`_rank`): a Ctrl-C that reaches a rank while
it starts waits for it, neither lost (the launcher's stop would wait :data:`GRACE_S` for it)
nor a traceback."""

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


class LauncherSignals:
    """The launcher's handler of :data:`SIGNALS`, from before its job starts until its end is
    said (``rrfp train``'s :func:`~rrfp.train.cli.run`; a :class:`LocalJob` made outside one
    has its own). Use it as a context manager: inside, its handler is in and it is
    :meth:`active`; leaving puts the old ones back.

    A signal raises :class:`Signalled` where the launcher is, SIGTERM going to
    :attr:`forwarder` first where there is one, once the job is :meth:`open` and outside the
    steps it :meth:`holding` waits for. Before the job opens (the checkpoint folder taken, the
    job's folder made) and during such a step (a rank forked and booked, a rank's end read,
    ranks stopped), a signal waits for it to end, then acts (between a fork and its bookkeeping
    it left a rank no one stopped; inside a stop it left a traceback). After the first raise,
    and once :meth:`end` said the run's end is decided, a signal changes nothing: the stop
    under way ends the job (a second Ctrl-C, or ``timeout -s INT`` signalling the launcher and
    then its group, does not cut it short, nor the cleanup after it); SIGTERM still reaches a
    forwarder that has ``ended``, which only marks it."""

    def __init__(self) -> None:
        self.forwarder = None
        """Called with SIGTERM instead of raising (:class:`rrfp.train.stop.StopForwarder`);
        the :class:`Signalled` it raises is the launcher's."""
        self._held = 0  # depth of the steps a signal waits for (holding)
        self._opened = False  # before open(), a signal waits too
        self._pending: list[int] = []  # the signals that came meanwhile
        self._settled = False  # raised once, or the run's end decided: signals change nothing
        self._old: dict = {}
        self._outer: LauncherSignals | None = None

    _active: "LauncherSignals | None" = None

    @classmethod
    def active(cls) -> "LauncherSignals | None":
        """The one in now, if any (the process's signal handlers are one set)."""
        return cls._active

    def __enter__(self) -> "LauncherSignals":
        self._old = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        self._outer, LauncherSignals._active = LauncherSignals._active, self
        return self

    def __exit__(self, *exc) -> None:
        self.end()
        for s, h in self._old.items():
            signal.signal(s, h)
        LauncherSignals._active = self._outer

    def open(self) -> None:
        """The job starts: from here a signal raises (or waits for a step :meth:`holding`); the
        first that came before raises here.

        Raises:
            Signalled: one of :data:`SIGNALS` came before.
        """
        if not self._opened:
            self._opened = True
            self._release()

    def end(self) -> None:
        """The run's end is decided (its last line is being said, or the job is left): from
        here a signal changes nothing, and SIGTERM only reaches :attr:`forwarder`."""
        self._settled = True

    @contextlib.contextmanager
    def holding(self):
        """A step a signal waits for; once the outermost ends, what came meanwhile acts.

        Raises:
            Signalled: on leaving, one of :data:`SIGNALS` came meanwhile.
        """
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        self._release()

    def _release(self) -> None:
        if self._held or not self._opened:
            return
        pending, self._pending = self._pending, []
        for signum in pending:
            if not self._settled:
                self._act(signum, None)

    def _on_signal(self, signum: int, frame) -> None:
        if self._settled:
            if signum == signal.SIGTERM and getattr(self.forwarder, "ended", False):
                self.forwarder(signum, frame)  # marks the request only
            return
        if self._held or not self._opened:
            self._pending.append(signum)
            return
        self._act(signum, frame)

    def _act(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and self.forwarder is not None:
            try:
                self.forwarder(signum, frame)
                return  # passed on to the ranks, which end their step: the wait sees them end
            except Signalled:
                self._settled = True
                raise
        self._settled = True
        raise Signalled(f"{os.getpid()} got {signal.Signals(signum).name}", sigval=signum)


class LocalJob:
    """``world`` ranks of ``rrfp ARGV`` forked from the zygote around a store hosted by one
    more forked process (as torchrun's agent hosts it: every rank a client), each rank with
    the launcher's environment ``env`` plus torchrun's variables; an error file each in
    ``folder``. The launcher's side of torchrun's agent on one machine: :meth:`wait` returns
    when every rank ended or one failed, and stops the rest (SIGTERM, SIGKILL after
    :data:`GRACE_S`); :meth:`stop` also ends the job on a signal. Use it as a context
    manager: leaving it stops what still runs and the store. Its signals are the launcher's
    :class:`LauncherSignals` where one is :meth:`~LauncherSignals.active`, else its own, in while inside.

    ``secret``: the run's job secret, handed to each rank in memory (never a file on disk,
    :func:`rrfp._secret.in_memory_file`); None: the ranks' argv names one already."""

    def __init__(self, argv: list[str], world: int, env: dict[str, str], folder: str,
                 secret: str | None = None) -> None:
        self.argv, self.world, self.env, self.folder = list(argv), world, dict(env), folder
        self.secret = secret
        self.run_id = str(uuid.uuid4())
        self.procs: list = []
        self.signalled: set[int] = set()
        """The pids this launcher signalled itself (:func:`rrfp.train.guard.root_cause`)."""
        self.signals = LauncherSignals.active()
        self._own_signals = self.signals is None
        if self.signals is None:
            self.signals = LauncherSignals()
        self._ended: set[int] = set()  # pids of the ranks whose end the main thread has read
        self._store = self._store_conn = None

    def __enter__(self) -> "LocalJob":
        if self._own_signals:
            self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signals.end()
        try:
            self.stop(signal.SIGTERM)
        finally:
            if self._store is not None:
                try:
                    self._store_conn.send(None)  # the job is over: the store's host leaves
                except OSError:
                    pass
                self._store_conn.close()
                # No pid: a signal came while the zygote was still importing, before it said the
                # store's; that process, if it starts at all, leaves by itself (_host_store).
                if self._store.pid is not None:
                    self._store.join(GRACE_S)
                    if self._store.exitcode is None:
                        self._store.kill()
            if self._own_signals:
                self.signals.__exit__()

    def start(self) -> None:
        """Start the zygote (unless this process runs one already), the store's host, then the
        ranks; returns once all are forked. A signal raises here while the zygote imports and
        starts the store (seconds: the launcher would not answer Ctrl-C meanwhile); the zygote's
        spawn and each rank's fork wait for it (:class:`LauncherSignals`).

        Raises:
            RuntimeError: the store's host died before it said its port.
            Signalled: one of :data:`SIGNALS` came (what started is stopped on leaving).
        """
        from multiprocessing import forkserver, resource_tracker
        from multiprocessing.connection import wait

        from .._pdeathsig import LAUNCHER_PID_ENV

        self.signals.open()  # a signal that came before raises here
        ctx = context()
        resource_tracker.ensure_running()  # first: starting it unblocks SIGINT and SIGTERM again
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # for the zygote (zygote_init), if it starts now
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_BY_ZYGOTE)
        try:
            forkserver.ensure_running()  # the zygote inherits the blocked signals (HELD_BY_ZYGOTE)
        finally:
            os.environ.pop(LAUNCHER_PID_ENV, None)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # one that came is raised here
        self._store_conn, child = ctx.Pipe()
        self._store = ctx.Process(target=_host_store, args=(self.world, child, self.env), name="rrfp store")
        try:
            self._store.start()  # returns once the zygote has imported PRELOAD and forked it
        finally:
            child.close()
        wait([self._store_conn, self._store.sentinel])
        if not self._store_conn.poll():
            raise RuntimeError(f"the rendezvous store's process ended (exit code {self._store.exitcode}) before it started")
        port = self._store_conn.recv()
        with self.signals.holding():
            for r in range(self.world):
                env = {**self.env, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                       "ROLE_NAME": "default", "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
                       "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                       "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": self.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                       "TORCHELASTIC_ERROR_FILE": self._error_file(r)}
                p = ctx.Process(target=_rank, args=(self.argv, env, self.secret), name=f"rrfp rank {r}")
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
            with self.signals.holding():  # a rank's end is one read of the zygote's pipe: never cut
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
        :data:`GRACE_S`, and wait as long again (a rank stuck in the kernel is left). A signal
        meanwhile waits for the stop to end (see the class)."""
        with self.signals.holding():
            self._stop(sig)

    def _stop(self, sig: int) -> None:
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

    from .._pdeathsig import LAUNCHER_PID_ENV, die_with_parent

    release_server_pipe()
    os.environ.clear()
    os.environ.update(env)
    if _BORN_IN != os.getpid():  # preloaded: the zygote is the parent to outlive
        os.environ[LAUNCHER_PID_ENV] = str(_BORN_IN)
    if "LOCAL_RANK" in env:
        die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's ignore (zygote_init) is not a rank's
    else:
        die_with_parent(launched_only=False)  # a zygote already gone (its launcher was): leave at once
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


def _rank(argv: list[str], env: dict[str, str], secret: str | None = None) -> None:
    """A rank: ``python -u -m rrfp ARGV`` as torchrun's agent runs it, by the same mechanism
    (runpy, what ``-m`` uses) in a fork of the zygote; with ``secret``, ``--job-secret-file``
    names it in this process's memory (:func:`rrfp._secret.in_memory_file`). Ctrl-C, blocked
    since the fork (:data:`HELD_BY_ZYGOTE`), is taken from here: its one line, exit 130."""
    import runpy

    from .failures import interrupted

    _become(env, f"rrfp rank {env['RANK']}")
    if secret is not None:
        from .._secret import in_memory_file

        argv = [*argv, "--job-secret-file", in_memory_file(secret)]
    sys.argv = [sys.argv[0], *argv]  # runpy puts rrfp/__main__.py's path first, as -m does
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one that came meanwhile raises here
        runpy.run_module("rrfp", run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        interrupted()


def _interrupt_once(signum, frame) -> None:
    """A rank's SIGINT handler: KeyboardInterrupt, once. Ctrl-C reaches a rank up to three
    times (the terminal's, ``timeout -s INT``'s second to the group, the launcher's stop); a
    second KeyboardInterrupt raised while the first unwound (asyncio closing its loop) turned
    the rank's "interrupted" line into an error's ("Cannot close a running event loop")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


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
    try:
        conn.send(store.port)
    except OSError:  # the launcher left the job before the zygote, still importing, forked this
        return
    try:
        conn.recv()  # the launcher's word that the job is over
    except EOFError:
        # The launcher died. The store stays until the zygote's exit kills this process with
        # the ranks (PR_SET_PDEATHSIG): no rank sees its store vanish first and fails on its own.
        while True:
            signal.pause()
