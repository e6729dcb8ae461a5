"""The daemon's one HTTP endpoint: ``/metrics`` for all of its ranks, ``/healthz`` and ``/readyz``.

The ranks write their Prometheus values into the folder named by ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, set by ``rrfp node`` in their environment), and the
daemon serves them merged with prometheus_client's ``MultiProcessCollector``.

``/healthz`` reads each rank's event-loop heartbeat (the gauge
``rrfp_last_heartbeat_timestamp_seconds``, which the ranks' metrics beat, ``rrfp.obs.metrics``)
and answers 503 naming the ranks whose last beat is older than the threshold. ``/readyz``
answers 200 once the ranks run (one heartbeat from each local rank) and 503 before, and
after a stop was asked.

This is the small seam of issue 11's split: engineer ``obs`` owns the metrics themselves and a
general server (``rrfp.obs.server``); when that lands, this module keeps only the routes.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEARTBEAT_METRIC = "rrfp_last_heartbeat_timestamp_seconds"


def last_heartbeats(path: str | os.PathLike) -> dict[str, float]:
    """Each rank's newest heartbeat (unix seconds) in the multiprocess folder ``path``, keyed by
    the ``rank`` label; ranks that never beat are absent."""
    from prometheus_client.multiprocess import MultiProcessCollector

    files = glob.glob(os.path.join(os.fspath(path), "gauge_*.db"))
    beats: dict[str, float] = {}
    for family in MultiProcessCollector.merge(files, accumulate=False):
        if family.name != HEARTBEAT_METRIC:
            continue
        for sample in family.samples:
            rank = sample.labels.get("rank", "?")
            beats[rank] = max(beats.get(rank, 0.0), sample.value)
    return beats


class Health:
    """The answers of ``/healthz`` and ``/readyz``.

    Args:
        metrics_dir: the ranks' ``PROMETHEUS_MULTIPROC_DIR``.
        n_local: ranks this daemon runs.
        max_age_s: a heartbeat older than this makes ``/healthz`` fail.
        clock: unix time now (a test passes its own).
    """

    def __init__(self, metrics_dir: str, n_local: int, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        self.metrics_dir = metrics_dir
        self.n_local = n_local
        self.max_age_s = max_age_s
        self.clock = clock
        self.stopping = False

    def ages(self) -> dict[str, float]:
        now = self.clock()
        return {r: now - t for r, t in sorted(last_heartbeats(self.metrics_dir).items(), key=lambda kv: kv[0])}

    def healthz(self) -> tuple[int, str]:
        ages = self.ages()
        stale = [r for r, a in ages.items() if a > self.max_age_s]
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


class Endpoint:
    """A threaded HTTP server with ``/metrics``, ``/healthz`` and ``/readyz``.

    Raises:
        OSError: one line naming the address and port that cannot be bound.
    """

    def __init__(self, addr: str, port: int, metrics_dir: str, health: Health) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=metrics_dir)
        routes = {"/healthz": health.healthz, "/readyz": health.readyz}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                path = self.path.split("?", 1)[0]
                if path in routes:
                    status, text = routes[path]()
                    return self._send(status, "text/plain; charset=utf-8", text.encode())
                if path not in ("/", "/metrics"):
                    return self._send(404, "text/plain; charset=utf-8", b"not found: /metrics, /healthz, /readyz\n")
                encoder, content_type = choose_encoder(self.headers.get("Accept"))
                self._send(200, content_type, encoder(registry))

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: no access log
                pass

        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
        try:
            self._httpd = server_cls((addr, port), Handler)
        except OSError as e:
            raise OSError(f"cannot serve on {addr}:{port}: {e.strerror or e}") from None
        self.addr = addr
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rrfp-node-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
