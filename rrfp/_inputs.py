"""Small input files read whole before anything runs (standard library only): ``--config``,
``--job-secret-file``.

One rule for each: a regular file of at most a bound's bytes. A device (``/dev/zero``), a FIFO
or a socket could be read until memory runs out or block for ever; a huge file would be read
whole. Each is refused with the tail of a one-line error (the caller names the flag).
"""

from __future__ import annotations

import os
import stat


def read_small_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        ValueError: not a regular file, or larger than ``limit`` bytes (the message says
            which, without the path).
        OSError: it cannot be opened or read.
    """
    # Judged before opening: opening a device can act (a tape rewinds, a watchdog arms) and
    # opening a FIFO blocks until a writer comes.
    _check(os.stat(path), limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(os.fstat(fd), limit)  # what was opened, should the name have changed meanwhile
        chunks, n = [], 0
        while n <= limit and (chunk := os.read(fd, limit + 1 - n)):
            chunks.append(chunk)
            n += len(chunk)
    finally:
        os.close(fd)
    if n > limit:  # a file that grew, or one whose size the kernel does not report (/proc)
        raise ValueError(f"holds more than {limit} bytes, expected at most {limit}")
    return b"".join(chunks)


def _check(st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
        raise ValueError(f"is {kind}, not a regular file: expected a file")
    if st.st_size > limit:
        raise ValueError(f"is {st.st_size} bytes, expected at most {limit}")
