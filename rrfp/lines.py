"""One write per line, for every process that shares a terminal or pipe with others.

A launcher's ranks (and ``rrfp node``'s agent beside its ranks) write to one stdout and one
stderr. ``print`` writes the text and the newline in two calls, which an unbuffered stream
(``python -u``, ``PYTHONUNBUFFERED``) or a text already holding a newline (line buffering
flushes there) turns into two ``write(2)`` calls: another process's line can land between
them ("rank 3rrfp train: rank 2: error ..."). One call with the newline included reaches the
file as one ``write(2)``, which a pipe keeps whole up to ``PIPE_BUF`` (4096 bytes on Linux).
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["say"]


def say(line: str, file: TextIO | None = None) -> None:
    """Write ``line`` and its newline in one call to ``file`` (default: ``sys.stdout`` now),
    then flush it.

    Args:
        line: the text, without its newline.
        file: a text stream; ``sys.stderr`` for errors and warnings.
    """
    f = sys.stdout if file is None else file
    f.write(line + "\n")
    f.flush()
