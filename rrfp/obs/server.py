"""Serving metrics over HTTP: the ``--metrics-*`` flags, a small threaded server with extra
routes (the daemon's ``/healthz`` and ``/readyz``), and the linger after a job ends.

Shared by ``rrfp train`` (one endpoint per rank) and ``rrfp node`` (one per daemon), so both
take the same flags with the same checks.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

DEFAULT_ADDR = "127.0.0.1"
"""Loopback by default: a metrics endpoint is opened to a network only when asked
(``--metrics-addr 0.0.0.0`` in a pod)."""

Route = Callable[[], tuple[int, str]]
"""An extra route: ``fn() -> (HTTP status, plain-text body)``."""


def add_flags(p: argparse.ArgumentParser, port_help: str, port_default: int | None = None) -> None:
    """Add ``--metrics-addr``, ``--metrics-port`` (default ``port_default``; None: no
    endpoint) and ``--metrics-linger`` to a command (``rrfp train``, ``rrfp node``)."""
    p.add_argument("--metrics-addr", default=DEFAULT_ADDR, metavar="ADDR",
                   help="address the Prometheus endpoint listens on (0.0.0.0: every interface)")
    p.add_argument("--metrics-port", type=int, default=port_default, metavar="P", help=port_help)
    p.add_argument("--metrics-linger", type=float, default=0.0, metavar="SEC",
                   help="keep serving the final values this long after the job ends (SIGTERM ends it sooner)")


def check_flags(args: argparse.Namespace, n_ports: int = 1, allow_any_port: bool = False) -> str | None:
    """The first problem with the ``--metrics-*`` flags, as a one-line message, or None.

    ``n_ports``: consecutive ports used from ``--metrics-port`` (one per rank in standalone
    mode). ``allow_any_port``: port 0 is accepted (each endpoint on a port the OS picks, which
    the caller must tell).
    """
    top = 65535 - (n_ports - 1)
    low = 0 if allow_any_port else 1
    if args.metrics_port is not None and not low <= args.metrics_port <= top:
        per = f" (ranks serve on port + rank, for {n_ports} ranks)" if n_ports > 1 else ""
        return f"--metrics-port={args.metrics_port}: expected a port in {low}..{top}{per}"
    if not (math.isfinite(args.metrics_linger) and args.metrics_linger >= 0):
        return f"--metrics-linger={args.metrics_linger}: expected a non-negative number of seconds"
    try:
        socket.getaddrinfo(args.metrics_addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        return f"--metrics-addr={args.metrics_addr!r}: expected an IP address or a host name of this machine"
    return None


class MetricsServer:
    """A threaded HTTP server: ``/metrics`` (also ``/``) renders ``registry`` in Prometheus'
    text format (or OpenMetrics when asked); each path in ``routes`` answers with its
    function's status and body; anything else is 404.

    Args:
        registry: what to render.
        addr, port: where to listen (port 0: any free port, see :attr:`port`).
        routes: extra paths (``{"/healthz": fn}``), each ``fn() -> (status, text)``, called
            on the server's thread.
        lock: held while rendering a scrape (a :class:`~rrfp.obs.metrics.RankMetrics`'s, so a
            scrape never sees half a step).

    Raises:
        OSError: one line naming the address and port that cannot be bound.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        addr: str = DEFAULT_ADDR,
        port: int = 0,
        routes: dict[str, Route] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        handler = _handler(registry, dict(routes or {}), lock or contextlib.nullcontext())
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
        try:
            self._httpd = server_cls((addr, port), handler)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
        self.registry = registry
        self.addr = addr
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rrfp-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def serve_node(
    multiproc_dir: str | os.PathLike, addr: str = DEFAULT_ADDR, port: int = 0, routes: dict[str, Route] | None = None
) -> MetricsServer:
    """The daemon's one endpoint for all its ranks: their values from ``multiproc_dir`` (the
    ``PROMETHEUS_MULTIPROC_DIR`` it gives them, :func:`~rrfp.obs.metrics.node_registry`), plus
    ``routes`` (``/healthz``, ``/readyz``). Register the daemon's own
    :class:`~rrfp.obs.metrics.NodeMetrics` in the returned server's ``registry``.

    Raises:
        ValueError: ``multiproc_dir`` is not a folder.
        OSError: the address and port cannot be bound.
    """
    from .metrics import node_registry

    return MetricsServer(node_registry(multiproc_dir), addr, port, routes)


def _handler(registry: CollectorRegistry, routes: dict[str, Route], lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path in routes:
                status, text = routes[path]()
                return self._send(status, "text/plain; charset=utf-8", text.encode())
            if path not in ("/", "/metrics"):
                return self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            with lock:
                body = encoder(registry)
            self._send(200, content_type, body)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds: no access log
            pass

    return Handler


def linger(seconds: float) -> None:
    """Block for ``seconds`` (the server threads keep serving), or until SIGTERM or SIGINT,
    which end the wait early and normally (exit code 0 for the caller). Must be called from
    the main thread; the previous signal handlers are restored."""
    if seconds <= 0:
        return
    done = threading.Event()
    old = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        done.wait(seconds)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
