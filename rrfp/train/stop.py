"""Graceful stop of a training job on SIGTERM (a pod eviction, a node drain): every rank ends
the step in progress, the job commits a checkpoint, and every rank, the launcher and every
daemon exit :data:`PREEMPTED`. Only a run that finished its steps exits 0, so Kubernetes
restarts a preempted job (deploy/'s podFailurePolicy matches the code) instead of marking it
Completed, and the restarted job resumes from that checkpoint (``--resume auto``).

Who asks: the ``rrfp train`` launcher and ``rrfp node`` (:class:`StopForwarder`). On SIGTERM
they create the file named by :data:`STOP_FILE_ENV`, then pass SIGTERM on to their ranks. A
SIGTERM without that file (torchrun's agent stopping the survivors of a failed rank, or a
plain ``torchrun``) keeps its usual meaning: the rank dies, since its group is broken and no
step can finish; but only once :data:`LAUNCHER_WINDOW_S` passed without the file. A SIGTERM
sent to the whole process group (``timeout``, ``kill -TERM -PGID``, Slurm) or control group
(systemd's default KillMode) reaches a rank and its launcher at the same moment, and the rank
may run its handler before the launcher wrote the file: dying then lost every step since the
last checkpoint. A second SIGTERM while the file is still missing kills the rank at once.

Agreement: all ranks stop after the same step, and it is the step in progress. A rank told to
stop publishes :data:`REQUEST_KEY` in the job's store (from a helper thread, so the request is
out even while the rank waits inside a step). Rank 0, after each of its steps ``k``, writes
its word on ``k`` (:func:`verdict_key`): ``stop`` when a request is in, else ``go``. Every
other rank reads that word after its own step ``k``, before it takes part in step ``k + 1``.
No rank has work of step ``k + 1`` before rank 0 starts it (every microbatch begins with rank
0's forward, and the data-parallel all-reduce ties the replicas to it), so the read costs one
store round trip per step and rank and holds back no rank that had work. A request that
reaches the store while rank 0 runs step ``k`` stops the job after ``k``.

Waiting never blocks the request. Python runs a signal handler only in the main thread and
only between bytecodes, never inside a store's blocking ``wait``; and one store client runs
one call at a time. So the waits run on a thread of their own (the main thread waits on an
event in short slices, between which the handler runs), and the request, the waits and the main thread's calls each
use a client of their own (``Store.clone``). (Before, rank 0
fixed the last step to ``k + 1`` and the others did not wait: the job ran one step past the
one in progress, and with rank 0's step lines printed as the statistics arrive, about three
past the last printed line.)
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ..lines import say

PREEMPTED = 128 + signal.SIGTERM
"""143: the exit code of a rank, of the ``rrfp train`` launcher and of ``rrfp node`` when the
run stopped on SIGTERM before its last step, whether or not the step in progress could end
and be checkpointed (the last line says what was saved). It is the code a process killed by
SIGTERM reports, so a restart rule for it (deploy/base/jobset.yaml's podFailurePolicy,
Kubeflow's "exit codes 128-255 are retryable") also covers a container that died of the
signal itself. 0 means the run finished."""

STOP_FILE_ENV = "RRFP_NODE_STOP_FILE"
"""Set by ``rrfp node`` and the ``rrfp train`` launcher in their ranks' environment: the file
they create on SIGTERM. A rank that stops on another node's request creates it too (content
``peer``), so its own daemon knows the group's exit is a stop, not a failure to restart."""

HOLD_ENV = "RRFP_TEST_HOLD_AFTER_STEP"
"""Test hook, a step count ``K``: the job's last rank, having heard rank 0's ``go`` after step
``K``, waits until some rank has asked to stop. Rank 0 is then inside step ``K + 1`` (it
waits for that rank), so a test can send SIGTERM in the middle of a known step without a
timer (first attempt of the job only)."""

REQUEST_KEY = "rrfp/stop-requested"
PEER = "peer"
"""The stop file's content when a rank wrote it (its stop came from another node)."""


def verdict_key(step: int) -> str:
    """The store key of rank 0's word after ``step`` optimizer steps: ``go`` or ``stop``."""
    return f"rrfp/after-step/{step}"


class GracefulStop:
    """One rank's side of the graceful stop (see the module docstring).

    Args:
        store: the job's store (``torch.distributed``'s default store).
        rank: this rank (global).
        world_size: ranks in the job (the last one runs the test hold).
        timeout_s: longest wait for rank 0's word after a step, and of the test hold.
        checkpoint: whether the run writes a checkpoint when it stops (``--checkpoint-dir``);
            only for what the rank says.
    """

    def __init__(self, store, rank: int, world_size: int = 1, timeout_s: float = 60.0, checkpoint: bool = True) -> None:
        base = _unprefixed(store)
        self.store = _own_client(base)  # the main thread's
        self._publisher = _own_client(base)  # the request's thread's
        self._waiter = _Waiter(_own_client(base))
        self.rank = rank
        self.world_size = world_size
        self.checkpoint = checkpoint
        self.timeout_s = timeout_s
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.requested = False
        self._published = False
        self.stopped_after: int | None = None
        """The step after which the job stops (known to this rank), else None."""
        self._unasked = 0  # SIGTERMs seen without the stop file (see _await_launcher)
        self._die = False
        self._request_lock = threading.Lock()
        self.armed = bool(self.stop_file)
        if self.armed:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.stopped_after is not None:
            return  # stopping already (the agent's SIGTERM to a rank on its way out): let it finish
        if self._die or (self._unasked and not self._launcher_asked()):
            # Not a stop asked by rrfp node or rrfp train: die as SIGTERM always made a rank die.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self._launcher_asked():
            self._unasked += 1
            threading.Thread(target=self._await_launcher, name="rrfp-stop-await", daemon=True).start()
            return
        self._request()

    def _launcher_asked(self) -> bool:
        return bool(self.stop_file) and os.path.exists(self.stop_file)

    def _await_launcher(self) -> None:
        """A SIGTERM came without the stop file: a stop when the file comes within
        :data:`LAUNCHER_WINDOW_S` (the launcher got the same signal), else the rank dies (the
        main thread's handler, the only one that may reset it, runs on the SIGTERM sent here)."""
        deadline = time.monotonic() + LAUNCHER_WINDOW_S
        while True:
            late = time.monotonic() >= deadline
            # Looked at once more after the deadline: a thread starved past it (or a file that
            # came during the last sleep) is still a stop asked in time.
            if self._launcher_asked():
                self._request()
                return
            if late:
                break
            time.sleep(FILE_POLL_S)
        self._die = True
        os.kill(os.getpid(), signal.SIGTERM)

    def _request(self) -> None:
        # The handler and _await_launcher's thread may both come here; never block in a handler.
        if not self._request_lock.acquire(blocking=False):
            return  # the other is asking
        if not self.requested:
            self.requested = True
            then = ", then a checkpoint" if self.checkpoint else " (no --checkpoint-dir: nothing is saved)"
            say(f"rrfp train: rank {self.rank}: SIGTERM: ending the step in progress{then}", sys.stderr)
            # A thread: the main thread may be inside a step, waiting on a peer.
            threading.Thread(target=self._publish, name="rrfp-stop", daemon=True).start()
        self._request_lock.release()

    def _publish(self) -> None:
        if not self._published:
            self._published = True
            try:
                self._publisher.set(REQUEST_KEY, str(self.rank))
            except Exception:  # noqa: BLE001 - the store's host is gone: the step fails on its own, and says why
                pass

    def _local_request(self) -> bool:
        if not self.requested and self.stop_file and os.path.exists(self.stop_file):
            self.requested = True  # the stop file came before this rank could catch the SIGTERM
        return self.requested

    def after_step(self, done: int, last: int) -> bool:
        """Call after each optimizer step on every rank; ``done`` steps are finished, the run
        would end at ``last``. True when the job stops now (checkpoint, then exit
        :data:`PREEMPTED`).

        Raises:
            TimeoutError: rank 0's word did not come within ``timeout_s`` seconds.
        """
        if not self.armed or done >= last:
            return False
        if self._local_request():
            self._publish()
        key = verdict_key(done)
        if self.rank == 0:
            stop = self.requested or self.store.check([REQUEST_KEY])
            self.store.set(key, "stop" if stop else "go")
            if done > 0:
                # Every rank read the word on done - 1 before it could take part in step done.
                self.store.delete_key(verdict_key(done - 1))
        else:
            try:
                self._waiter.wait(key, self.timeout_s)
            except RuntimeError as e:  # torch's store timeout (DistStoreError) or a lost store
                raise TimeoutError(f"rank {self.rank}: no word from rank 0 on whether to go on after step {done} "
                                   f"within {self.timeout_s:g} s (--watchdog): {e}") from None
            stop = self.store.get(key) == b"stop"
        if not stop:
            self._hold(done)
            return False
        self.stopped_after = done
        self._mark()
        return True

    def _mark(self) -> None:
        """Tell this rank's daemon the stop is a stop, when its own SIGTERM did not ask it."""
        if self.stop_file and not os.path.exists(self.stop_file):
            try:
                with open(self.stop_file, "x") as f:
                    f.write(PEER)
            except FileExistsError:
                pass  # another local rank, or the daemon, wrote it first

    def _hold(self, done: int) -> None:
        if self.rank != self.world_size - 1 or os.environ.get(HOLD_ENV) != str(done) \
                or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        say(f"rrfp train: rank {self.rank}: test hook {HOLD_ENV}: holding after step {done} until a stop is requested",
            sys.stderr)
        self._waiter.wait(REQUEST_KEY, self.timeout_s)


LAUNCHER_WINDOW_S = 2.0
"""How long a rank's SIGTERM without the stop file waits for it before the rank dies
(seconds): the launcher's handler writes it within milliseconds of the same signal; a failed
group's survivors, whose SIGTERM no file follows, die this much later (their launcher gives
them :data:`rrfp.train.zygote.GRACE_S`, torch's agent as long)."""

FILE_POLL_S = 0.01
"""How often that wait looks for the stop file (seconds)."""

HANDLER_DELAY_S = 0.05
"""Longest delay of a SIGTERM's handler while the rank waits in the store (seconds)."""


def _unprefixed(store):
    """The store under ``store``'s prefixes (torch's default store is a PrefixStore over the
    rendezvous round's TCPStore): its clones then see the same keys whatever the prefixes'
    spelling (a PrefixStore's clone may join its prefix differently)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _own_client(base):
    """A client of its own to ``base`` (``Store.clone``: a new connection), its keys under
    ``rrfp/stop``. Each rendezvous round has a store of its own (``rrfp node`` sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``; the ``rrfp train`` launcher never restarts), so an
    earlier round's words are never read. The round's restart count is no name for it: a node
    whose agent rejoins on another node's restart keeps its own count."""
    import torch.distributed as dist

    return dist.PrefixStore("rrfp/stop", base.clone())


class _Waiter:
    """Runs a store's blocking ``wait`` on a thread of its own; the caller waits on an event in
    slices of :data:`HANDLER_DELAY_S`, returning to the interpreter between them, which is when
    a signal handler runs (the kernel hands a process-directed SIGTERM to any of the rank's
    threads, so the main thread's lock wait is not interrupted by it)."""

    def __init__(self, store) -> None:
        self.store = store
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="rrfp-stop-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            key, timeout_s, done, out = self._jobs.get()
            try:
                self.store.wait([key], timedelta(seconds=timeout_s))
            except Exception as e:  # noqa: BLE001 - handed to the caller, raised there
                out.append(e)
            done.set()

    def wait(self, key: str, timeout_s: float) -> None:
        """Until ``key`` is in the store.

        Raises:
            RuntimeError: the store's timeout (``timeout_s``) or a lost connection.
        """
        done, out = threading.Event(), []
        self._jobs.put((key, timeout_s, done, out))
        while not done.wait(HANDLER_DELAY_S):
            pass  # a pending SIGTERM's handler runs here
        if out:
            raise out[0]


class StopForwarder:
    """The launcher's side (``rrfp train``'s and ``rrfp node``'s), a SIGTERM handler: create
    the stop file, then pass SIGTERM on to the ranks, which end the step in progress
    (:class:`GracefulStop`). Once called, :attr:`requested` stays True.

    Raises torch's ``SignalException`` (SIGTERM) instead, on which torch's agent stops the
    ranks at once, when no rank runs yet (the rendezvous, between a failure and a restart) or
    when ``finished()`` says training is over (the ranks only serve their final metrics).

    Args:
        stop_file: the file :data:`STOP_FILE_ENV` names in the ranks' environment.
        line: what to say when the stop is asked.
        children: this process's child pids, the ranks (:func:`child_pids`).
        finished: whether training is over already (None: never).
        on_request: called once, first, on SIGTERM (e.g. ``/readyz`` starts answering 503).
        raises: the exception class raised instead of torch's ``SignalException`` (built with
            a message and ``sigval=``): ``rrfp train``'s own launcher, which imports no torch,
            passes :class:`rrfp.train.zygote.Signalled`.
    """

    def __init__(self, stop_file: Path, line: str, children: Callable[[], list[int]] | None = None,
                 finished: Callable[[], bool] | None = None, on_request: Callable[[], None] | None = None,
                 raises: type | None = None) -> None:
        self.stop_file = Path(stop_file)
        self.line = line
        self.children = children or child_pids
        self.finished = finished
        self.on_request = on_request
        self.raises = raises
        self.requested = False
        self.after_training = False
        self.without_ranks = False
        """Set when the SIGTERM came while no rank ran (it raised): no step was in progress."""
        self.ended = False
        """Set once the launch returned or raised: a SIGTERM then only marks the request (an
        exception would surface wherever the launcher is, e.g. writing its last line)."""

    def __call__(self, signum, frame) -> None:
        if self.raises is None:
            from torch.distributed.elastic.multiprocessing.api import SignalException
        else:
            SignalException = self.raises  # noqa: N806 - the class torch's agent would catch
        if self.requested:
            return
        self.requested = True
        if self.ended:
            return
        if self.on_request is not None:
            self.on_request()
        ranks = self.children()
        if self.finished is not None and self.finished():
            self.after_training = True
            raise SignalException(f"{os.getpid()} got SIGTERM after training", sigval=signal.SIGTERM)
        if not ranks:
            self.without_ranks = True
            raise SignalException(f"{os.getpid()} got SIGTERM", sigval=signal.SIGTERM)
        self.stop_file.write_text(str(os.getpid()))
        say(self.line)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def peer_asked(self) -> bool:
        """Whether a rank of this process stopped on another node's request (it wrote the
        stop file, :data:`PEER`) while this process got no SIGTERM itself."""
        return not self.requested and self.stop_file.exists()


def child_pids() -> list[int]:
    """This process's child pids (Linux /proc); torch's agent starts its ranks as children."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def stopped_cleanly(failures: dict) -> bool:
    """Whether a rank among torch's ``ChildFailedError.failures`` exited :data:`PREEMPTED`:
    it did so only after the stop's checkpoint was committed by every rank (the commit ends
    with a barrier), so the step in progress is saved."""
    return any(getattr(f, "exitcode", None) == PREEMPTED for f in failures.values())


def stopped_line(who: str, why: str, failures: dict, checkpoint_dir: str | None,
                 without_ranks: bool = False) -> tuple[str, bool]:
    """The last line of a job that ``why`` (``"on SIGTERM"``, ...) stopped, said by ``who``
    (``rrfp train``, ``rrfp node``), and whether it stopped cleanly (:func:`stopped_cleanly`:
    the step in progress ended and was saved; else the line is an error's, for stderr).
    ``without_ranks``: the stop came while no rank ran (:attr:`StopForwarder.without_ranks`):
    clean, nothing was in progress."""
    if without_ranks:
        return (f"{who}: stopped {why} while no rank ran (joining the rendezvous, or between a failure and a "
                f"restart): no step was in progress; {saved(checkpoint_dir)}"), True
    if stopped_cleanly(failures):
        return (f"{who}: stopped {why}: every rank ended the step in progress and exited {PREEMPTED}; "
                f"{saved(checkpoint_dir)}"), True
    return (f"{who}: stopped {why}; this stop committed no checkpoint (a rank ended before the step in "
            f"progress could end); {saved(checkpoint_dir)}"), False


def finished_line(who: str, signal_name: str, checkpoint_dir: str | None) -> str:
    """The last line of a job whose ``signal_name`` (``SIGTERM``, ...) came once its training
    had finished, said by ``who`` (``rrfp train``, ``rrfp node``): a finished run, exit 0."""
    return f"{who}: {signal_name} came after the last step: training finished; {saved(checkpoint_dir)}"


def saved(checkpoint_dir: str | None) -> str:
    """What a stopped job leaves to resume from, as the tail of the last line: the newest
    committed checkpoint of ``checkpoint_dir`` and its step, or why there is none."""
    if checkpoint_dir is None:
        return "nothing saved (no --checkpoint-dir)"
    from . import checkpoint as ck

    path = ck.latest(checkpoint_dir)
    if path is None:
        return f"no checkpoint committed in {checkpoint_dir} yet"
    try:
        step = ck.read_meta(path).get("step", "?")
    except (OSError, ValueError):
        step = "?"
    return f"latest checkpoint {Path(path)} (step {step})"
