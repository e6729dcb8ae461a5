"""The job secret's one rule (standard library only, so ``rrfp train`` checks
``--job-secret-file`` before torch loads): surrounding whitespace is stripped (a file's
trailing newline) and at least :data:`MIN_SECRET_BYTES` bytes remain; and where the secret
``rrfp train`` makes for one run waits for its ranks: in each rank's memory
(:func:`in_memory_file`, Linux), else a private file (:func:`private_secret_file`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 1 << 16
"""A secret file larger than this (64 KiB), or one that is not a regular file (``/dev/zero``,
a FIFO), is refused unread."""


def normalized(secret: bytes | str) -> bytes:
    """The secret as the keys are derived from it.

    Raises:
        ValueError: fewer than :data:`MIN_SECRET_BYTES` bytes after stripping.
    """
    raw = (secret.encode() if isinstance(secret, str) else bytes(secret)).strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"job secret too short: {len(raw)} bytes, expected at least {MIN_SECRET_BYTES}")
    return raw


def read_secret_file(path: str | os.PathLike) -> bytes:
    """A secret file's content, normalized.

    Raises:
        ValueError: one line naming the file when it cannot be read, is not a regular file, is
            larger than :data:`MAX_SECRET_FILE_BYTES` or its secret is too short.
    """
    from ._inputs import read_small_file

    try:
        data = read_small_file(path, MAX_SECRET_FILE_BYTES)
    except OSError as e:
        raise ValueError(f"job secret file {str(path)!r}: {e.strerror or e}") from None
    except ValueError as e:  # not a regular file, or too large
        raise ValueError(f"job secret file {str(path)!r}: {e}") from None
    try:
        return normalized(data)
    except ValueError as e:
        raise ValueError(f"job secret file {str(path)!r}: {e}") from None


SHM = "/dev/shm"
"""Where :func:`private_secret_file` writes by default: memory, never a disk."""


def private_secret_file(secret: str, dir: str | None = None) -> tuple[str, Callable[[], None]]:
    """Write a run's secret where only this user (and root) can read it, for its ranks to read
    through ``--job-secret-file``: a file of mode 0600 in a new folder of mode 0700, in ``dir``
    (default: ``/dev/shm`` where there is one, memory, never written to disk; else the
    temporary folder), named ``rrfp-secret-<this pid>-*``. The launcher's fallback where
    :func:`in_memory_supported` is False. Not the ranks' environment: ``/proc/<pid>/environ``
    keeps the value a process started with for its whole life, whatever it unsets.

    A folder of this name whose pid has ended (its launcher was SIGKILLed) is deleted first
    (:func:`sweep`).

    Returns:
        The file's path, and a function that deletes the file and its folder (call it when
        the run ends).
    """
    if dir is None:
        dir = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()
    sweep(dir)
    # Named after the process that made it: the folder a SIGKILLed launcher left is its pid's.
    folder = tempfile.mkdtemp(prefix=f"rrfp-secret-{os.getpid()}-", dir=dir)
    path = os.path.join(folder, "job-secret")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path, lambda: shutil.rmtree(folder, ignore_errors=True)


def sweep(dir: str) -> list[str]:
    """Delete the ``rrfp-secret-<pid>-*`` folders in ``dir`` that this user owns and whose pid
    no longer runs (a launcher SIGKILLed before it could delete its own); returns them. A pid
    reused since is taken for alive: that folder waits for a later sweep. Folders of other
    users, and the older ``rrfp-secret-*`` names without a pid, are left alone."""
    import re

    gone = []
    try:
        names = os.listdir(dir)
    except OSError:
        return gone
    for name in names:
        m = re.fullmatch(r"rrfp-secret-(\d+)-\w+", name)
        path = os.path.join(dir, name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(m.group(1)), 0)
            continue  # alive (or a pid reused)
        except ProcessLookupError:
            pass
        except OSError:  # PermissionError: another user's live process holds the pid
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


IN_MEMORY_NAME = "rrfp-job-secret"
"""The name an in-memory secret file shows (``/proc/<pid>/fd/N -> /memfd:rrfp-job-secret``)."""


def in_memory_supported() -> bool:
    """Whether :func:`in_memory_file` works here: ``memfd_create`` (Linux 3.17) and
    ``/proc/self/fd``. Asked by the launcher, which falls back to :func:`private_secret_file`."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        os.close(os.memfd_create(IN_MEMORY_NAME))
    except OSError:  # ENOSYS in some sandboxes
        return False
    return True


def in_memory_file(secret: str) -> str:
    """Write ``secret`` to a file that exists only in this process's memory (``memfd_create``,
    close-on-exec, mode 0600) and return a path this process opens it by,
    ``/proc/self/fd/N``: what a rank of ``rrfp train`` is given as ``--job-secret-file``. No
    folder holds it and nothing has to delete it: it is gone when this process ends, however it
    ends (a file the launcher wrote outlived every launcher that was SIGKILLed). Linux only
    (:func:`in_memory_supported`).

    Raises:
        OSError: the file cannot be made.
    """
    fd = os.memfd_create(IN_MEMORY_NAME, os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)  # the folder /proc/<pid>/fd is this user's alone already
    os.write(fd, secret.encode())
    return f"/proc/self/fd/{fd}"
