"""The ZeroMQ transport's gatekeeper thread: ZAP authentication and handshake accounting.

With a job secret every ROUTER is a CURVE server. libzmq asks the ZAP handler of its
context (RFC 27, ``inproc://zeromq.zap.01``) about each connecting client's public key;
this thread answers: a key derived for rank r is accepted with User-Id ``r`` (which the
transport then checks against the routing id of every message), any other key is
refused. A client that does not complete the CURVE handshake (no secret, NULL mechanism,
wrong key) never delivers a single frame: it is counted from the ROUTER's monitor as
``rejected_handshake``. libzmq reports no handshake event at all when it drops a client
that does not speak ZMTP 3 (garbage, an HTTP request, ZMTP 1.0/2.0: refused because
ZAP is on); such a connection is told from the others by matching handshake outcomes
to connections (:class:`OutcomeMatcher`) and counted when it closes. The thread runs outside the event loop, so handshakes proceed
while a rank's loop is idle between steps.

A second thread keeps the rank's own signed store entry in place (``guard``) until every
peer has authenticated, so an entry overwritten after publishing is written back. It is not
the ZAP thread: a store call can wait behind the rank's other store users (one client
connection, one request at a time), and a rank that left start() for a blocking store wait
(``new_group``'s rendezvous) while a peer's handshake to it was still pending would otherwise
leave that handshake unanswered: the peer never finished start() and never joined the wait.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("rrfp.transport.zmq")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_ids = itertools.count()
_WATCHED = _FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class OutcomeMatcher:
    """Finds the accepted connections that closed without any handshake outcome.

    libzmq's monitor (version 1) gives the socket of ``ACCEPTED`` and ``DISCONNECTED``
    events but not of a handshake's success or failure. Each connection has at most one
    outcome, between its acceptance and its close, so connections are intervals and
    outcomes points in the event sequence: matching them greedily as connections close
    (each takes the earliest free outcome since its acceptance) matches as many as any
    assignment could, so a connection left without one certainly had none. Free
    outcomes older than every open connection are forgotten (memory stays bounded by
    the open connections).
    """

    def __init__(self) -> None:
        self._seq = 0
        self._open: dict[int, int] = {}  # socket -> sequence number of its acceptance
        self._free: list[int] = []  # sequence numbers of outcomes not matched yet

    def accepted(self, fd: int) -> None:
        self._seq += 1
        self._open[fd] = self._seq

    def outcome(self) -> None:
        self._seq += 1
        self._free.append(self._seq)

    def closed(self, fd: int) -> bool:
        """True when the connection on ``fd`` closed without a handshake outcome."""
        self._seq += 1
        since = self._open.pop(fd, None)
        if since is None:
            return False  # accepted before the monitor started
        i = bisect.bisect_left(self._free, since)
        matched = i < len(self._free)
        if matched:
            del self._free[i]
        oldest = min(self._open.values(), default=self._seq)
        del self._free[:bisect.bisect_left(self._free, oldest)]
        return not matched


class Gatekeeper:
    """Answers ZAP requests for one context and counts refused handshakes.

    Args:
        ctx: the transport's context (one ZAP handler per context).
        rank: the owning rank (for log lines).
        keys: binary (32-byte) CURVE public key -> rank, of every rank allowed in.
        stats: the transport's counters; this thread alone writes ``rejected_handshake``.
        guard: called every ``guard_s`` until it returns False or every peer authenticated.
        world_size: number of ranks.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        rank: int,
        keys: dict[bytes, int],
        stats: dict[str, int],
        world_size: int,
        guard: Callable[[], bool] | None = None,
        guard_s: float = 0.05,
    ) -> None:
        self.rank = rank
        self._keys = keys
        self._stats = stats
        self._world = world_size
        self._guard = guard
        self._guard_s = guard_s
        self.authenticated: set[int] = set()
        self.all_in = threading.Event()
        self._ctx = ctx
        # Bound here, before the ROUTER binds: a handshake must never find no handler.
        self._zap = zmq.Socket(ctx, zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        stop_addr = f"inproc://rrfp-gate-stop-{next(_ids)}"
        self._stop_rx = zmq.Socket(ctx, zmq.PAIR)
        self._stop_rx.linger = 0
        self._stop_rx.bind(stop_addr)
        self._stop_tx = zmq.Socket(ctx, zmq.PAIR)
        self._stop_tx.linger = 0
        self._stop_tx.connect(stop_addr)
        self._mon: zmq.Socket | None = None
        self._matcher = OutcomeMatcher()
        self._thread: threading.Thread | None = None
        self._guard_thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def watch(self, router: zmq.Socket) -> None:
        """Count the ROUTER's failed handshakes; then start the thread."""
        addr = f"inproc://rrfp-gate-mon-{next(_ids)}"
        router.monitor(addr, _WATCHED)
        self._mon = zmq.Socket(self._ctx, zmq.PAIR)
        self._mon.linger = 0
        self._mon.connect(addr)
        self._thread = threading.Thread(target=self._run, name=f"rrfp-gate-{self.rank}", daemon=True)
        self._thread.start()
        if self._guard is not None:
            self._guard_thread = threading.Thread(target=self._keep_guarding, name=f"rrfp-guard-{self.rank}",
                                                  daemon=True)
            self._guard_thread.start()

    def stop(self) -> None:
        """Stop the thread and close its sockets (call before the context terminates). The guard
        thread is told to stop and not waited for: it may sit in a store call, and it touches
        no socket."""
        self._stopped.set()
        if self._thread is not None and self._thread.is_alive():
            self._stop_tx.send(b"")
            self._thread.join()
        for s in (self._zap, self._stop_rx, self._stop_tx, self._mon):
            if s is not None and not s.closed:
                s.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_rx in ready:
                    while self._mon.poll(0):  # what the monitor already reported still counts
                        self._on_event(parse_monitor_message(self._mon.recv_multipart()))
                    return
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart())
                if self._mon in ready:
                    self._on_event(parse_monitor_message(self._mon.recv_multipart()))
        except zmq.ContextTerminated:
            return
        except Exception:  # never silently: a dead gate would stall every handshake
            log.exception("rank %d: gatekeeper failed", self.rank)

    def _keep_guarding(self) -> None:
        try:
            while not self._stopped.is_set() and not self.all_in.wait(self._guard_s):
                if self._stopped.is_set() or not self._guard():
                    return
        except Exception:
            log.exception("rank %d: store entry guard failed", self.rank)

    def _on_event(self, ev: dict) -> None:
        what = ev["event"]
        if what == zmq.EVENT_ACCEPTED:
            self._matcher.accepted(int(ev["value"]))
        elif what == zmq.EVENT_DISCONNECTED:
            if self._matcher.closed(int(ev["value"])):
                self._refused("closed before a ZMTP 3 handshake (not a ZeroMQ CURVE peer)")
        elif what & (_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            self._matcher.outcome()
            if what & _FAILED:
                self._refused(f"CURVE handshake failed ({zmq.Event(what).name})")

    def _refused(self, why: str) -> None:
        n = self._stats["rejected_handshake"] = self._stats.get("rejected_handshake", 0) + 1
        if n <= 10 or n & (n - 1) == 0:  # a flood must not flood the log
            log.warning("rank %d: refused connection #%d: %s", self.rank, n, why)

    def _answer(self, msg: list[bytes]) -> None:
        # ZAP request: version, request id, domain, address, identity, mechanism, credentials.
        if len(msg) < 6:
            return
        version, req = msg[0], msg[1]
        mechanism, creds = msg[5], msg[6:]
        rank = self._keys.get(creds[0]) if mechanism == b"CURVE" and creds else None
        if rank is None:
            self._zap.send_multipart([version, req, b"400", b"unknown key", b"", b""])
            return
        self._zap.send_multipart([version, req, b"200", b"OK", str(rank).encode(), b""])
        self.authenticated.add(rank)
        if len(self.authenticated - {self.rank}) >= self._world - 1:
            self.all_in.set()
