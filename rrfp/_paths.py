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
    (``/dev/full``, a FIFO; ``os.devnull`` is accepted), a file or folder without write
    permission, and a path whose folder does not exist.
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
        if not stat.S_ISREG(st.st_mode) and os.path.realpath(p) != os.devnull:
            return "is not a regular file, expected a file path"
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
