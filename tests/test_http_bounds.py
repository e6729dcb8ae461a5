"""The metrics server's bounds: slow and half-open clients hold neither threads nor more than
``MAX_CONNECTIONS`` descriptors, and a normal request is still answered."""

from __future__ import annotations

import os
import resource
import socket
import threading
import urllib.request

import pytest

from rrfp.obs import server
from rrfp.obs.metrics import RankMetrics
from rrfp.obs.server import MetricsServer

N_CLIENTS = 1000


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def enough_descriptors():
    """Room for the clients' own sockets in this process (the server shares it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * N_CLIENTS + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} open files, this process may open {hard} (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thousand_half_open_clients_leave_the_server_answering(enough_descriptors):
    m = RankMetrics(0, [0])
    threads_before = threading.active_count()
    srv = MetricsServer(m.registry, port=0, routes={"/healthz": lambda: (200, "ok\n")}, lock=m.lock)
    clients: list[socket.socket] = []
    try:
        fds_before = _fds()
        for _ in range(N_CLIENTS):
            c = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a request head never finished
            clients.append(c)
        # A normal request, connected after every half-open one: once it is answered, the
        # server has accepted all of them (the listen queue is served in order).
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/healthz", timeout=30) as r:
            assert (r.status, r.read()) == (200, b"ok\n")
        assert threading.active_count() <= threads_before + 1 + server.WORKERS
        server_side = _fds() - fds_before - N_CLIENTS  # the clients' sockets are this process's too
        assert server_side <= server.MAX_CONNECTIONS, server_side
        # Everything but the newest MAX_CONNECTIONS - 1 half-open clients was closed unanswered.
        closed = srv.dropped["evicted"] + srv.dropped["timeout"]
        assert closed >= N_CLIENTS - (server.MAX_CONNECTIONS - 1), srv.dropped
        assert srv.dropped["bad request"] == 0, srv.dropped  # each closed connection counted once
        # An evicted client reads the end of its connection, not an answer.
        c = clients[0]
        c.settimeout(30)
        try:
            assert c.recv(1) == b""
        except ConnectionResetError:
            pass
        # A scrape still renders the registry.
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=30) as r:
            assert r.status == 200 and b'rrfp_steps_total{rank="0"} 0.0' in r.read()
    finally:
        for c in clients:
            c.close()
        srv.close()
    assert threading.active_count() <= threads_before


def test_a_silent_client_is_dropped_after_the_timeout_and_counted():
    """With a short timeout the server closes a client that sent only part of its request."""
    m = RankMetrics(0, [0])
    srv = MetricsServer(m.registry, port=0, timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
            c.sendall(b"GET /metrics HTTP/1.1\r\n")
            c.settimeout(30)  # bounds a hang only: the server's own timeout ends the wait
            try:
                assert c.recv(1) == b""
            except ConnectionResetError:
                pass
        assert srv.dropped["timeout"] == 1
    finally:
        srv.close()


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /metrics HTTP/1.1\r\n\r\n", 501),
    (b"nonsense\r\n\r\n", 400),
    (b"GET /boom HTTP/1.0\r\n\r\n", 500),
])
def test_bad_requests_and_a_failing_route_are_answered_and_the_server_lives(request_bytes, status):
    def boom():
        raise RuntimeError("no heartbeat file")

    m = RankMetrics(0, [0])
    srv = MetricsServer(m.registry, port=0, routes={"/boom": boom})
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
            c.sendall(request_bytes)
            c.settimeout(30)
            data = b""
            while chunk := c.recv(4096):
                data += chunk
        assert data.startswith(f"HTTP/1.0 {status} ".encode()), data
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=30) as r:
            assert r.status == 200
    finally:
        srv.close()
