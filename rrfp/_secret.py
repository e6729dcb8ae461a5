"""The job secret's one rule (standard library only, so ``rrfp train`` checks
``--job-secret-file`` before torch loads): surrounding whitespace is stripped (a file's
trailing newline) and at least :data:`MIN_SECRET_BYTES` bytes remain."""

from __future__ import annotations

import os
from pathlib import Path

MIN_SECRET_BYTES = 16


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
        ValueError: one line naming the file when it cannot be read or is too short.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"job secret file {str(path)!r}: {e.strerror or e}") from None
    try:
        return normalized(data)
    except ValueError as e:
        raise ValueError(f"job secret file {str(path)!r}: {e}") from None
