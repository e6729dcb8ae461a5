"""The answers of the daemon's ``/healthz`` and ``/readyz`` (served with ``/metrics`` by
:func:`rrfp.obs.server.serve_node` from the ranks' ``PROMETHEUS_MULTIPROC_DIR``).

``/healthz`` (liveness) answers 503 only for a rank process that runs and is frozen: its
liveness beat (:mod:`rrfp.train.alive`, a thread of the rank) is older than the threshold.
One long task cannot fail it: the task holds the rank's event loop, not that thread. A rank
whose process has ended (the agent is restarting the group) is not counted, and neither is
one still starting. Each rank's event-loop heartbeat (the gauge
``rrfp_last_heartbeat_timestamp_seconds``, :func:`rrfp.obs.metrics.last_heartbeats`) is shown
beside it, for a person: its age is how long the current task or wait has held the loop.

``/readyz`` (readiness) answers 200 once every local rank's event loop has beaten, 503 before
that and once a stop was asked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..obs.metrics import last_heartbeats
from ..train.alive import beats


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


class Health:
    """The answers of ``/healthz`` and ``/readyz``, each ``() -> (HTTP status, text)``.

    Args:
        metrics_dir: the ranks' ``PROMETHEUS_MULTIPROC_DIR``.
        n_local: ranks this daemon runs.
        max_age_s: a running rank whose liveness beat is older than this (seconds) makes
            ``/healthz`` fail.
        alive_dir: the ranks' liveness folder (:data:`rrfp.train.alive.ALIVE_DIR_ENV`).
        clock: unix time now, in seconds (a test passes its own).
        running: whether a pid is a running process (a test passes its own).
    """

    def __init__(self, metrics_dir: str, n_local: int, max_age_s: float, alive_dir: str | None = None,
                 clock: Callable[[], float] = time.time, running: Callable[[int], bool] = pid_running) -> None:
        self.metrics_dir = metrics_dir
        self.n_local = n_local
        self.max_age_s = max_age_s
        self.alive_dir = alive_dir
        self.clock = clock
        self.running = running
        self.stopping = False

    def ages(self) -> dict[int, float]:
        """Seconds since each local rank's last event-loop heartbeat, by rank."""
        now = self.clock()
        return {r: now - t for r, t in sorted(last_heartbeats(self.metrics_dir).items())}

    def alive_ages(self) -> dict[int, float]:
        """Seconds since each running local rank's last liveness beat, by rank (ranks whose
        process has ended are left out)."""
        if self.alive_dir is None:
            return {}
        now = self.clock()
        return {r: now - t for r, (pid, t) in sorted(beats(self.alive_dir).items()) if self.running(pid)}

    def healthz(self) -> tuple[int, str]:
        alive, loops = self.alive_ages(), self.ages()
        frozen = [str(r) for r, a in alive.items() if a > self.max_age_s]
        lines = "".join(
            f"rank {r}: " + (f"alive {alive[r]:.1f} s ago, " if r in alive else "")
            + (f"event loop {loops[r]:.1f} s ago\n" if r in loops else "event loop not started\n")
            for r in sorted(set(alive) | set(loops)))
        if frozen:
            return 503, (f"unhealthy: rank(s) {', '.join(frozen)} frozen: no liveness beat for over "
                         f"{self.max_age_s:g} s\n" + lines)
        return 200, "ok\n" + (lines or "no rank has started yet\n")

    def readyz(self) -> tuple[int, str]:
        if self.stopping:
            return 503, "stopping\n"
        n = len(last_heartbeats(self.metrics_dir))
        if n < self.n_local:
            return 503, f"starting: {n} of {self.n_local} ranks running\n"
        return 200, "ready\n"
