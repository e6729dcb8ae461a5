"""Serving metrics over HTTP: the ``--metrics-*`` flags, a small bounded server with extra
routes (the daemon's ``/healthz`` and ``/readyz``), and the linger after a job ends.

Shared by ``rrfp train`` (one endpoint per rank) and ``rrfp node`` (one per daemon), so both
take the same flags with the same checks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import signal
import socket
import threading
from collections.abc import Callable

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


MAX_CONNECTIONS = 64
"""Client connections a server keeps open at most. At the limit a new one closes the oldest
connection whose request is still incomplete (a slow or half-open client), or, if every one
is complete and being answered, is closed itself."""

REQUEST_TIMEOUT_S = 10.0
"""Seconds a client has to send its request head, and again to take the answer."""

WORKERS = 2
"""Threads that render answers (a scrape holds the metrics' lock; the rest is file reads)."""

MAX_HEAD = 16 * 1024
"""Bytes of a request head (request line and headers) at most; a longer one is dropped."""


class MetricsServer:
    """An HTTP server with bounded resources: ``/metrics`` (also ``/``) renders ``registry`` in
    Prometheus' text format (or OpenMetrics when asked); each path in ``routes`` answers with
    its function's status and body; anything else is 404.

    Connections are read by one asyncio event loop on the server's thread, so a client that
    sends nothing holds no thread: at most :data:`MAX_CONNECTIONS` descriptors (oldest
    incomplete ones closed first), :data:`REQUEST_TIMEOUT_S` per request head and per answer,
    and :data:`WORKERS` threads rendering answers. One request per connection (HTTP/1.0,
    ``Connection: close``). :attr:`dropped` counts the connections closed unanswered, by
    reason (``evicted``, ``refused``, ``timeout``, ``bad request``).

    Args:
        registry: what to render.
        addr, port: where to listen (port 0: any free port, see :attr:`port`).
        routes: extra paths (``{"/healthz": fn}``), each ``fn() -> (status, text)``, called
            on a worker thread.
        lock: held while rendering a scrape (a :class:`~rrfp.obs.metrics.RankMetrics`'s, so a
            scrape never sees half a step).
        max_connections, timeout_s: the bounds above.

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
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        self._respond = _responder(registry, dict(routes or {}), lock or contextlib.nullcontext())
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted daemon rebinds at once
            sock.bind((addr, port))
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise OSError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
        self.registry = registry
        self.addr = addr
        self.port = sock.getsockname()[1]
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.dropped: collections.Counter = collections.Counter()
        self._open: dict = {}  # writer -> request complete?, oldest first
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rrfp-metrics-worker")
        self._loop = asyncio.new_event_loop()
        listening = threading.Event()

        def serve() -> None:  # the loop lives on its own thread: the caller's may run one already
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._client, sock=sock, limit=MAX_HEAD))
            listening.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="rrfp-metrics", daemon=True)
        self._thread.start()
        listening.wait()

    async def _client(self, reader, writer) -> None:
        import asyncio

        if len(self._open) >= self.max_connections:
            oldest = next((w for w, complete in self._open.items() if not complete), None)
            if oldest is None:
                self.dropped["refused"] += 1
                writer.transport.abort()
                return
            self.dropped["evicted"] += 1
            del self._open[oldest]
            oldest.transport.abort()  # its task sees the reset and ends
        self._open[writer] = False
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                if writer in self._open:  # not one closed above to make room: counted there
                    self.dropped["bad request"] += 1
                return
            if writer in self._open:
                self._open[writer] = True
            answer = await self._loop.run_in_executor(self._pool, self._respond, head)
            writer.write(answer)
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except asyncio.TimeoutError:
            self.dropped["timeout"] += 1
        except OSError:  # reset by the client, or evicted above
            pass
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()  # no lingering close: the descriptor goes now

    def close(self) -> None:
        """Stop serving, close every connection and free the port."""
        import asyncio

        async def stop() -> None:
            self._server.close()
            for w in list(self._open):
                w.transport.abort()
            await self._server.wait_closed()

        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._pool.shutdown(wait=True)


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


def _responder(registry: CollectorRegistry, routes: dict[str, Route], lock) -> Callable[[bytes], bytes]:
    """``head -> answer``: a request head (request line and headers) to the whole HTTP answer."""
    import io
    from http import HTTPStatus
    from http.client import HTTPException, parse_headers

    def answer(status: int, content_type: str, body: bytes) -> bytes:
        head = (f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode("latin-1") + body

    def respond(head: bytes) -> bytes:
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return answer(400, "text/plain; charset=utf-8", b"bad request line\n")
        if parts[0] != "GET":
            return answer(501, "text/plain; charset=utf-8", f"unsupported method {parts[0]!r}: expected GET\n".encode())
        try:
            headers = parse_headers(io.BytesIO(rest))
        except HTTPException:
            return answer(400, "text/plain; charset=utf-8", b"bad headers\n")
        path = parts[1].split("?", 1)[0]
        if path in routes:
            try:
                status, text = routes[path]()
            except Exception as e:  # noqa: BLE001 - one failing route must not end the server
                status, text = 500, f"{path}: {type(e).__name__}: {e}\n"
            return answer(status, "text/plain; charset=utf-8", text.encode())
        if path not in ("/", "/metrics"):
            return answer(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
        encoder, content_type = choose_encoder(headers.get("Accept"))
        with lock:
            body = encoder(registry)
        return answer(200, content_type, body)

    return respond


def linger(seconds: float, ended: Callable[[], bool] | None = None) -> None:
    """Block for ``seconds`` (the server threads keep serving), or until SIGTERM or SIGINT,
    which end the wait early and normally (exit code 0 for the caller). Must be called from
    the main thread; the previous signal handlers are restored.

    ``ended``: whether the caller's own handler already took a stop (a SIGTERM that came
    after the caller's last line, before this call). It is asked once this function's
    handlers are in, so a signal lands in one of the two and none is lost between them; the
    caller keeps its handler installed until this call (never the default in between, which
    would kill the process instead of ending the linger)."""
    if seconds <= 0:
        return
    done = threading.Event()
    old = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ended is None or not ended():
            done.wait(seconds)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
