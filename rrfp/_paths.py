"""Output paths checked before anything runs (standard library only).

One rule for every flag naming a file a command will write (``rrfp bench --out/--json``,
``rrfp train --log-file/--loss-file``): the check comes before the work, so a bad path costs
a one-line error, never a finished run whose results cannot be written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def output_file_problem(path: str) -> str | None:
    """None if ``path`` names a file this process can create or overwrite, else what is
    wrong, as the tail of a one-line error (the caller names the flag).

    Refused: an empty path, a folder, an existing file that is not a regular file
    (``/dev/full``, a FIFO; ``os.devnull`` is accepted) or that lives on a kernel's
    pseudo-file system (``/proc/self/mem``: :data:`KERNEL_FS`), a file or folder without write
    permission, and a path whose folder does not exist or cannot take a new file.
    """
    if not path:
        return "expected a file path"
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:  # a path through a file (ENOTDIR), a loop, a name too long
        return f"cannot use this path: {e.strerror or e}"
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            return "is a folder, expected a file path"
        if os.path.realpath(p) == os.devnull:
            return None
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file, expected a file path"
        if (fs := _kernel_fs(os.path.realpath(p))) is not None:  # /proc/self/mem is "regular"
            return f"is a kernel interface on {fs} ({_mount_point(os.path.realpath(p))}), not a file: expected a file path"
        if not os.access(p, os.W_OK):
            return "cannot write it: permission denied"
        return None
    parent = p.resolve().parent
    if not parent.is_dir():
        return f"its folder {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK):
        return f"cannot write into its folder {str(parent)!r}: permission denied"
    # os.access says yes to root everywhere, and /proc or a read-only mount refuse anyway:
    # create (and remove) a file there, as the command will.
    try:
        fd, probe = tempfile.mkstemp(prefix=".rrfp-probe-", dir=parent)
    except OSError as e:
        return f"cannot write into its folder {str(parent)!r}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


KERNEL_FS = frozenset({"proc", "sysfs", "debugfs", "tracefs", "securityfs", "cgroup", "cgroup2", "configfs",
                       "pstore", "bpf", "efivarfs", "binfmt_misc", "fusectl", "devpts"})
"""File systems whose "files" are kernel interfaces: writing one does something else than store
bytes, or fails only once written to."""


def _mounts() -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of this process's mounts (Linux); [] elsewhere."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if "-" in fields:
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            out.append((point.replace("\\134", "\\"), fields[fields.index("-") + 1]))
    return out


def _mount_of(real: str) -> tuple[str, str] | None:
    best = None
    for point, fs in _mounts():
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fs)
    return best


def _mount_point(real: str) -> str:
    m = _mount_of(real)
    return m[0] if m else "/"


def _kernel_fs(real: str) -> str | None:
    """The type of the kernel file system ``real`` (a resolved path) lives on, or None."""
    m = _mount_of(real)
    return m[1] if m is not None and m[1] in KERNEL_FS else None
