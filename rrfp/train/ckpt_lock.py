"""Who may write a checkpoint folder: its owner, one job, named in a lock file that the job's
launcher (``rrfp train``) or daemons (``rrfp node``) hold while the job runs.

``DIR/.rrfp-lock`` is a small JSON description, ``{"job", "host", "pid", "since", "nonce"}``,
created atomically (written aside, then hard-linked into place: ``link`` fails if the name
exists, on local and network file systems alike). The holder renews it (its mtime) every
:data:`LEASE_S` / 4 seconds. Before any rank starts, a job finds the folder

* free (no lock): it takes it;
* held by the same job (same job identity: a replaced pod, the other node of a multi-node
  job on shared storage, a restarted daemon): it takes it over;
* held by a dead job (not renewed for :data:`LEASE_S` s, dated more than that ahead of this
  host's clock, or its pid gone on this very host): it breaks the stale lock and takes it;
* held by another live job: refused in one line naming that job.

A commit (rank 0) checks the lock again and refuses to commit into a folder another job has
taken (a hung holder whose lease ran out). Temporary folders carry the job's tag
(:func:`job_tag`): a job deletes only its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

LOCK_FILE = ".rrfp-lock"
LEASE_S = 60.0
"""Seconds a lock stays valid without renewal; after that its job counts as dead."""

JOB_ENV = "RRFP_CHECKPOINT_JOB"
"""The holder's job identity, handed to its ranks (they tag their temporary folders with it
and check it before a commit)."""


class FolderInUse(ValueError):
    """Another live job holds the checkpoint folder (one line naming it)."""


def job_tag(job: str | None = None) -> str:
    """Eight hex digits naming a job in temporary folder names: from ``job``, else from
    :data:`JOB_ENV`, else from torchelastic's run id (a plain ``torchrun`` launch)."""
    job = job or os.environ.get(JOB_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return hashlib.sha256(job.encode()).hexdigest()[:8]


def remove_tmp(root: str | os.PathLike, job: str | None = None) -> None:
    """Delete the half-written checkpoint folders (``.tmp-step-*``) of ``job`` (default: this
    process's, :func:`job_tag`) under ``root``; never another job's."""
    import shutil

    for d in Path(root).glob(f".tmp-step-*-{job_tag(job)}-*"):
        shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    # A pid no process can have (0, negative, a JSON true, beyond a C long) is no live holder:
    # os.kill would signal a process group, probe pid 1, or raise OverflowError.
    if isinstance(pid, bool) or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path) -> tuple[dict, float] | None:
    """The lock's description and mtime, or None when there is no lock.

    Raises:
        FolderInUse: a lock file that is not a description (kept: it is not ours to judge).
    """
    try:
        st = path.stat()
        desc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise FolderInUse(f"{path} is unreadable ({e}): remove it if no job writes this folder") from None
    if not isinstance(desc, dict) or not isinstance(desc.get("job"), str):
        raise FolderInUse(f"{path} is not an rrfp lock: remove it if no job writes this folder")
    return desc, st.st_mtime


class Lease:
    """This process's hold on a checkpoint folder (:func:`acquire`).

    Args:
        root: the checkpoint folder.
        job: this job's identity (every process of one job passes the same string).
        lease_s: :data:`LEASE_S`; host, pid, clock: this process's (a test passes its own).
    """

    def __init__(self, root: str | os.PathLike, job: str, lease_s: float = LEASE_S, host: str | None = None,
                 pid: int | None = None, clock=time.time) -> None:
        self.path = Path(root) / LOCK_FILE
        self.job = job
        self.lease_s = lease_s
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.clock = clock
        self.nonce = uuid.uuid4().hex
        self.lost_to: str | None = None  # the job that took the folder while we held it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ judging
    def stale(self, desc: dict, mtime: float) -> bool:
        """Whether the lock ``desc`` (renewed at ``mtime``, seconds since the epoch) belongs to a
        dead job: not renewed for ``lease_s``, or dated more than ``lease_s`` ahead of this
        host's clock. A holder renews with its own (or its file server's) clock, so a date
        ahead by up to a lease is clock skew between hosts and counts as just renewed; further
        ahead, no clock within a lease of ours renewed it (a copied or hand-touched file), and
        a live holder that did would find the folder taken before its next commit
        (:func:`check_owner`)."""
        if abs(self.clock() - mtime) > self.lease_s:
            return True
        return desc.get("host") == self.host and isinstance(desc.get("pid"), int) and not _pid_alive(desc["pid"])

    def _refusal(self, desc: dict, mtime: float) -> str:
        age = self.clock() - mtime
        when = f"{age:.0f} s ago" if age > -0.5 else f"{-age:.0f} s ahead of this host's clock"
        return (f"in use by job {desc['job']!r} (pid {desc.get('pid')} on {desc.get('host')}, lock {self.path} "
                f"renewed {when}): expected a folder no other job writes (a lock not renewed for "
                f"{self.lease_s:g} s is taken over)")

    # ------------------------------------------------------------------ taking
    def _write_aside(self) -> Path:
        tmp = self.path.with_name(f"{LOCK_FILE}.{self.nonce}")
        desc = {"job": self.job, "host": self.host, "pid": self.pid, "since": self.clock(), "nonce": self.nonce}
        tmp.write_text(json.dumps(desc))
        return tmp

    def acquire(self) -> None:
        """Take the folder (see the module's rules).

        Raises:
            FolderInUse: one line naming the job that holds it.
            OSError: the folder cannot be written.
        """
        tmp = self._write_aside()
        try:
            for _ in range(8):  # each round ends in taking the lock or in a change someone else made
                try:
                    os.link(tmp, self.path)
                    return
                except FileExistsError:
                    pass
                found = _read(self.path)
                if found is None:
                    continue  # released meanwhile
                desc, mtime = found
                if desc["job"] == self.job:
                    os.replace(tmp, self.path)  # the same job: take over its lock
                    tmp = None
                    return
                if not self.stale(desc, mtime):
                    raise FolderInUse(self._refusal(desc, mtime))
                # Break the stale lock by moving it aside; only one contender's rename succeeds,
                # and a contender that moved a fresh lock instead puts it back.
                aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.nonce}")
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                moved = _read(aside)
                if moved is not None and moved[0].get("nonce") != desc.get("nonce"):
                    try:
                        os.link(aside, self.path)
                    except FileExistsError:
                        pass
                else:
                    remove_tmp(self.path.parent, desc["job"])  # the dead job's leftovers
                os.unlink(aside)
            raise FolderInUse(f"{self.path} keeps changing hands: expected one job at a time")
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------ holding
    def renew(self) -> None:
        """Renew the lock (re-create it if another process of this job released it); note in
        :attr:`lost_to` a job that took it over."""
        try:
            found = _read(self.path)
        except FolderInUse:
            return
        if found is None:
            try:
                self.acquire()
            except (FolderInUse, OSError):
                pass
        elif found[0]["job"] == self.job:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                pass
        else:
            self.lost_to = found[0]["job"]

    def start(self) -> Lease:
        """Renew every ``lease_s / 4`` seconds on a daemon thread until :meth:`release`."""
        def loop() -> None:
            while not self._stop.wait(self.lease_s / 4):
                self.renew()

        self._thread = threading.Thread(target=loop, name="rrfp-checkpoint-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing and remove the lock if it is still this process's (another process
        of the same job may hold it now: then it stays)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if os.environ.get(JOB_ENV) == self.job:
            del os.environ[JOB_ENV]  # an in-process caller's later runs are other jobs
        try:
            found = _read(self.path)
        except FolderInUse:
            return
        if found is not None and found[0].get("nonce") == self.nonce:
            self.path.unlink(missing_ok=True)
        remove_tmp(self.path.parent, self.job)  # left by ranks of this job that died mid-write


def hold(args, job: str) -> Lease | None:
    """Take ``--checkpoint-dir`` for ``job`` and keep renewing it (None without the flag);
    sets :data:`JOB_ENV` for the ranks this process starts until :meth:`Lease.release`.

    Raises:
        FolderInUse: one line naming the flag and the live job that holds the folder.
        OSError: the folder cannot be written.
    """
    root = getattr(args, "checkpoint_dir", None)
    if not root:
        return None
    lease = Lease(root, job)
    try:
        lease.acquire()
    except FolderInUse as e:
        raise FolderInUse(f"--checkpoint-dir={os.fspath(root)!r}: {e}") from None
    os.environ[JOB_ENV] = job
    return lease.start()


def hold_in_rank(args) -> Lease | None:
    """Under a plain ``torchrun ... rrfp train`` (no rrfp launcher or daemon holds the folder:
    :data:`JOB_ENV` unset), global rank 0 takes ``--checkpoint-dir`` for the torchrun job
    (``torchrun-`` + its ``TORCHELASTIC_RUN_ID``: a restarted rank 0 of the same job takes its
    lock over) and keeps it until :meth:`Lease.release`; None on any other rank, without the
    flag, or where a launcher holds it already.

    torchrun's run id is ``none`` unless ``--rdzv-id`` or ``--standalone`` gives one, and
    there is none where no torchrun started the rank: unrelated jobs share that, so the job
    is then named after the agent that starts rank 0 too (``torchrun-none-<host>-<parent
    pid>``: the agent restarts its ranks; another job has another). A restart whose rank 0
    lands under another agent finds the earlier attempt's lock on this host with its pid
    gone (stale: taken), on another host taken once its lease runs out.

    Raises:
        FolderInUse: one line naming the flag and the live job that holds the folder.
        OSError: the folder cannot be created or written.
    """
    root = getattr(args, "checkpoint_dir", None)
    if not root or os.environ.get(JOB_ENV) or os.environ.get("RANK") != "0":
        return None
    Path(root).mkdir(parents=True, exist_ok=True)  # no launcher's checks created it
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    job = f"torchrun-{run_id}"
    if run_id == "none":
        job += f"-{socket.gethostname()}-{os.getppid()}"
    return hold(args, job)


def check_owner(root: str | os.PathLike) -> str | None:
    """Before a commit: the job that holds ``root`` if it is not this rank's job
    (:data:`JOB_ENV`), else None (also when there is no lock or no job identity)."""
    job = os.environ.get(JOB_ENV)
    if not job:
        return None
    try:
        found = _read(Path(root) / LOCK_FILE)
    except FolderInUse:
        return None
    if found is None or found[0]["job"] == job:
        return None
    return found[0]["job"]
