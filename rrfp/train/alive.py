"""A rank's liveness beat for ``rrfp node``'s ``/healthz``: a thread of the rank's process
touches a file every second, whatever the rank's event loop does.

The event-loop heartbeat (``rrfp_last_heartbeat_timestamp_seconds``) stops while one task
holds the loop, so a liveness probe on it kills a pod whose single forward or backward runs
longer than the threshold. This beat comes from a thread the task does not block: torch's
kernels release the GIL, and Python hands the GIL to other threads every few milliseconds
even in pure-Python code. It stops only when the whole process is frozen (stopped, or a
native call holding the GIL forever) or gone. A rank that runs but makes no progress is its
watchdog's to end (``--watchdog``), not the probe's.

The file is ``DIR/rank-R``, its content the rank's pid, its modification time the last beat;
DIR is :data:`ALIVE_DIR_ENV` (set by ``rrfp node``; without it nothing is written).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

ALIVE_DIR_ENV = "RRFP_NODE_ALIVE_DIR"
"""Set by ``rrfp node`` in its ranks' environment: the folder of their liveness files."""

INTERVAL_S = 1.0
"""Seconds between beats."""


def start(rank: int, interval_s: float = INTERVAL_S) -> threading.Event | None:
    """Start this process's liveness beat as rank ``rank``; returns the event that stops it
    (None, and nothing started, without :data:`ALIVE_DIR_ENV`).

    Raises:
        OSError: the folder cannot be written.
    """
    folder = os.environ.get(ALIVE_DIR_ENV)
    if not folder:
        return None
    path = Path(folder) / f"rank-{rank}"
    path.write_text(str(os.getpid()))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            try:
                os.utime(path)
            except OSError:
                return  # the daemon removed its folder: it is going away, and so is this rank

    threading.Thread(target=beat, name="rrfp-alive", daemon=True).start()
    return stop


def beats(folder: str | os.PathLike) -> dict[int, tuple[int, float]]:
    """Each rank's ``(pid, unix time of its last beat)`` in ``folder`` (ranks that have not
    started are absent)."""
    out: dict[int, tuple[int, float]] = {}
    for f in Path(folder).glob("rank-*"):
        try:
            out[int(f.name.split("-", 1)[1])] = (int(f.read_text() or 0), f.stat().st_mtime)
        except (OSError, ValueError):
            continue  # being written, or removed meanwhile: the next probe reads it
    return out
