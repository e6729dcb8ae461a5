"""The ranks' ZeroMQ port range (``rrfp train --port-range``, ``RRFP_PORT_RANGE``; issue 32
item 7): a rank binds a free port of the range, a range with every port taken is refused in one
line naming it, and malformed or too small ranges are refused before any rank starts.

Ports are held by this test's own sockets on 127.0.0.1 (bound and listening), so which ports of
a range are taken is forced, not guessed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import zmq

from rrfp._net import PORT_RANGE_ENV, parse_port_range, port_range_problem
from rrfp.transport.zmq_rendezvous import bind_in_range

HOST = "127.0.0.1"


def _held_pair() -> tuple[socket.socket, socket.socket]:
    """Two listening sockets on adjacent ports ``p``, ``p + 1`` (the OS picks ``p``)."""
    for _ in range(50):
        a = socket.socket()
        a.bind((HOST, 0))
        a.listen()
        b = socket.socket()
        try:
            b.bind((HOST, a.getsockname()[1] + 1))
            b.listen()
            return a, b
        except OSError:
            a.close()
            b.close()
    pytest.fail("no two adjacent free ports on 127.0.0.1 in 50 tries")


def _bound_port(sock: zmq.Socket) -> int:
    return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


def test_a_rank_binds_a_free_port_of_the_range_and_an_exhausted_range_is_one_line(monkeypatch):
    a, b = _held_pair()
    lo = a.getsockname()[1]
    ctx = zmq.Context()
    try:
        monkeypatch.setenv(PORT_RANGE_ENV, f"{lo}-{lo + 1}")
        with pytest.raises(OSError) as err:  # both held
            bind_in_range(ctx.socket(zmq.ROUTER), HOST, rank=0)
        assert str(err.value) == (f"rank 0: no free port in --port-range {lo}-{lo + 1} ({PORT_RANGE_ENV}) on {HOST}: "
                                  "all 2 are in use; widen the range")
        a.close()  # lo is free now; rank 1 starts at lo + 1 (held), then takes lo
        router = ctx.socket(zmq.ROUTER)
        bind_in_range(router, HOST, rank=1)
        assert _bound_port(router) == lo
        router.close(0)
        monkeypatch.delenv(PORT_RANGE_ENV)
        anywhere = ctx.socket(zmq.ROUTER)
        bind_in_range(anywhere, HOST, rank=0)  # no range: a port the OS picks
        assert _bound_port(anywhere) > 0
        anywhere.close(0)
    finally:
        a.close()
        b.close()
        ctx.destroy(0)


def test_range_syntax_and_size():
    assert parse_port_range("29500-29599") == (29500, 29599) and parse_port_range(" 80-80 ") == (80, 80)
    for bad in ("29500", "9-3", "0-10", "1-65536", "a-b", "-5", "29500:29599", ""):
        with pytest.raises(ValueError, match=r"expected LO-HI, two ports 1\.\.65535 with LO <= HI"):
            parse_port_range(bad)
    assert port_range_problem(None, 8) is None and port_range_problem("29500-29507", 8) is None
    assert port_range_problem("29500-29506", 8) == ("--port-range=29500-29506: 7 port(s) for the 8 ranks on this host: "
                                                    "each rank binds one of them, so widen the range")


@pytest.mark.parametrize("argv, want", [
    (["train", "--port-range", "29500"], "rrfp train: error: --port-range='29500': expected LO-HI"),
    (["train", "--stages", "2", "--port-range", "40000-40000"],
     "rrfp train: error: --port-range=40000-40000: 1 port(s) for the 2 ranks on this host"),
    (["node", "--nnodes", "2", "--nproc-per-node", "2", "--", "--stages", "4", "--port-range", "40000-40000"],
     "rrfp node: error: --port-range=40000-40000: 1 port(s) for the 2 ranks on this host"),
])
def test_a_bad_port_range_is_refused_before_any_rank_starts(argv, want):
    p = subprocess.run([sys.executable, "-m", "rrfp", *argv], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), lines
