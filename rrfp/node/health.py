"""The answers of the daemon's ``/healthz`` and ``/readyz`` (served with ``/metrics`` by
:func:`rrfp.obs.server.serve_node` from the ranks' ``PROMETHEUS_MULTIPROC_DIR``).

``/healthz`` reads each rank's event-loop heartbeat (the gauge
``rrfp_last_heartbeat_timestamp_seconds`` the ranks beat, :func:`rrfp.obs.metrics.last_heartbeats`)
and answers 503 naming the ranks whose last beat is older than the threshold. ``/readyz``
answers 200 once every local rank has beaten, 503 before that and once a stop was asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..obs.metrics import last_heartbeats


class Health:
    """The answers of ``/healthz`` and ``/readyz``, each ``() -> (HTTP status, text)``.

    Args:
        metrics_dir: the ranks' ``PROMETHEUS_MULTIPROC_DIR``.
        n_local: ranks this daemon runs.
        max_age_s: a heartbeat older than this (seconds) makes ``/healthz`` fail.
        clock: unix time now, in seconds (a test passes its own).
    """

    def __init__(self, metrics_dir: str, n_local: int, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        self.metrics_dir = metrics_dir
        self.n_local = n_local
        self.max_age_s = max_age_s
        self.clock = clock
        self.stopping = False

    def ages(self) -> dict[int, float]:
        """Seconds since each local rank's last heartbeat, by rank."""
        now = self.clock()
        return {r: now - t for r, t in sorted(last_heartbeats(self.metrics_dir).items())}

    def healthz(self) -> tuple[int, str]:
        ages = self.ages()
        stale = [str(r) for r, a in ages.items() if a > self.max_age_s]
        lines = "".join(f"rank {r}: heartbeat {a:.1f} s ago\n" for r, a in ages.items())
        if stale:
            return 503, f"unhealthy: rank(s) {', '.join(stale)} silent for over {self.max_age_s:g} s\n" + lines
        return 200, "ok\n" + (lines or "no rank has beaten yet\n")

    def readyz(self) -> tuple[int, str]:
        if self.stopping:
            return 503, "stopping\n"
        n = len(last_heartbeats(self.metrics_dir))
        if n < self.n_local:
            return 503, f"starting: {n} of {self.n_local} ranks running\n"
        return 200, "ready\n"
