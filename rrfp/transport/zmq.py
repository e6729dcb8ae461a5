"""ZeroMQ transport: one ROUTER to receive, one DEALER per peer to send.

Topology: every rank binds a ROUTER on ``tcp://host:0`` and publishes the bound
endpoint in a torch.distributed Store under ``rrfp/{job}/zmq/{rank}``; it then
connects one DEALER (routing id = its own rank in ASCII) to each peer's ROUTER.
The ROUTER therefore tags every arrival with the sender's rank.

Ordering: messages from one sender to one receiver arrive in send order (ZeroMQ
keeps a pipe FIFO); nothing is promised across senders.

Security: with a job secret (:mod:`.auth`) every socket speaks CURVE: each rank's key pair
is derived from the secret, a DEALER authenticates the ROUTER it connects to by the key
derived for that rank, and the ROUTER's ZAP handler (:mod:`.zmq_gate`) admits only keys
of the job's ranks, tagging each connection with its rank (ZAP User-Id). A message is
accepted only when its routing id names the rank that authenticated the connection.
Endpoints in the store are signed; a forged entry is refused, counted and waited past.
Without a secret a rank binds only a loopback address unless ``insecure`` is set.

Parts, each with its own state and a declared interface: :class:`~.zmq_receive.Receiver`
reads the ROUTER and refuses a message by routing id and size (frames counted as they are
read, ZMQ_MAXMSGSIZE per frame) before anything is decoded; :class:`~.zmq_rendezvous.Rendezvous`
publishes and collects the endpoints; :class:`~.zmq_gate.Gatekeeper` is the ZAP handler;
:mod:`.zmq_wire` holds the control frames and raw socket calls they share.

Peer loss: a socket monitor on each DEALER reports EVENT_DISCONNECTED when the
connection to that peer drops, either because its process exited (the kernel
closes its sockets) or because ZMTP heartbeats went unanswered for
``heartbeat_timeout`` seconds (a hung host). Unless the peer said BYE, ``recv``
then raises :class:`PeerLost`.

Root cause: the first peer a rank loses is the one it names, and it tells its other peers
("leaving because rank X was lost", :data:`~.zmq_wire.LOST_NOTICE`), so a cascade of exits
names the rank that really failed rather than the last one to leave.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from torch import Tensor
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from . import auth as _auth
from ..errors import PeerLost, TransportClosed
from .base import START_TIMEOUT_S, Transport
from .codec import DEFAULT_MAX_BYTES, MAX_HEADER_BYTES, MAX_TENSORS, Frame, encode, frames_nbytes
from .keys import MsgKey
from .zmq_gate import Gatekeeper
from .zmq_receive import Receiver
from .zmq_rendezvous import Rendezvous, _is_loopback, bind_in_range, default_host
from .zmq_wire import BYE, LOST_NOTICE, ZERO_COPY_MIN, send_now

__all__ = ["ZmqTransport", "default_host"]

log = logging.getLogger("rrfp.transport.zmq")

_FROM_CONFIG: Any = object()
_LOST_NOTICE_GRACE = 0.2
"""Seconds a disconnect waits for the peer's lost-rank notice, which travels on another
connection and can be overtaken by the disconnect itself."""
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
START_RETRIES = 3
"""Handshakes in a row to one peer that may end without an outcome before its first succeeds
(see ``_monitor``); the next such failure counts the peer lost."""


class ZmqTransport(Transport):
    """Transport over ZeroMQ TCP sockets (``zmq.asyncio``; works under uvloop).

    Args:
        rank, world_size: this rank and the number of ranks.
        store: a torch.distributed Store shared by all ranks (rendezvous only).
        job: job id; keys the store entries, and arrivals of other jobs are rejected.
        host: address to bind; default :func:`default_host`.
        hwm: SNDHWM/RCVHWM in messages; must exceed the runtime's in-flight limit.
        connect_timeout: seconds :meth:`start` waits for every peer (default
            :data:`~rrfp.transport.base.START_TIMEOUT_S`).
        heartbeat_ivl: seconds between ZMTP heartbeats.
        heartbeat_timeout: seconds without an answer before a connection is
            dropped (and the peer reported lost).
        max_bytes: largest accepted payload per message.
        close_linger: seconds close() lets queued frames (its BYEs) drain.
        auth: the job secret's keys; default :func:`rrfp.transport.auth.current`
            (``RRFP_JOB_SECRET``). None: no encryption, loopback only unless ``insecure``.
        insecure: allow binding a non-loopback address without a secret.

    Raises (from :meth:`start`):
        PermissionError: a non-loopback host without a secret and without ``insecure``.

    Counters beyond the base ones: ``rejected_handshake`` (connections that failed the
    CURVE handshake), ``rejected_identity`` (routing id not the authenticated rank),
    ``rejected_oversize`` (over ``max_bytes`` or too many frames, dropped undecoded),
    ``rejected_store`` (forged store entries), ``rejected_unknown_peer``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        job: str,
        host: str | None = None,
        hwm: int = 100000,
        connect_timeout: float = START_TIMEOUT_S,
        heartbeat_ivl: float = 1.0,
        heartbeat_timeout: float = 10.0,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        close_linger: float = 5.0,
        auth: _auth.JobAuth | None = _FROM_CONFIG,
        insecure: bool | None = None,
    ) -> None:
        super().__init__(rank, world_size, job=job, max_bytes=max_bytes)
        if auth is _FROM_CONFIG or insecure is None:
            cfg_auth, cfg_insecure = _auth.current()
            auth = cfg_auth if auth is _FROM_CONFIG else auth
            insecure = cfg_insecure if insecure is None else insecure
        self._auth: _auth.JobAuth | None = auth
        self._insecure = bool(insecure)
        self._gate: Gatekeeper | None = None
        for k in ("rejected_handshake", "rejected_identity", "rejected_oversize", "rejected_store",
                  "rejected_unknown_peer"):
            self.stats[k] = 0
        self.handshake_retries = 0  # start-up handshakes cut without an outcome, then retried
        # Lost-rank notices received: sender -> the rank it says was lost first.
        self._notices: dict[int, int] = {}
        self._notice_sent = False
        self._rendezvous = Rendezvous(store, job, rank, sorted(self.peers()), auth, connect_timeout, self.stats,
                                      self.reject)
        self._receiver: Receiver | None = None
        self._host = host
        self._hwm = hwm
        self._connect_timeout = connect_timeout
        self._hb_ivl_ms = max(1, int(heartbeat_ivl * 1000))
        self._hb_timeout_ms = max(1, int(heartbeat_timeout * 1000))
        self._close_linger_ms = max(0, int(close_linger * 1000))
        # After our BYE went out, a peer's disconnect may race ahead of its own BYE
        # (they travel on different connections): allow it this long to show up.
        self._bye_grace = 2.0
        self.endpoint: str | None = None
        self.peer_endpoints: dict[int, str] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.Socket | None = None
        # Routing id -> rank, canonical spellings only: b"01" must not pass for rank 1.
        self._rank_of = {str(r).encode(): r for r in range(world_size)}
        self._dealers: dict[int, zmq.asyncio.Socket] = {}
        self._direct: dict[int, zmq.Socket] = {}
        self._monitors: dict[int, zmq.asyncio.Socket] = {}
        self._connected: dict[int, asyncio.Future[None]] = {}
        self._outq: dict[int, deque[list[Frame]]] = {}
        self._out_ready: dict[int, asyncio.Event] = {}
        self._pending = 0
        # Set after every frame handed to ZeroMQ and on failures; waiters re-check.
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # -- start -----------------------------------------------------------------

    async def start(self) -> None:
        """Bind, publish the endpoint, connect to every peer and wait for every
        handshake.

        Raises:
            TimeoutError: a peer did not publish or accept within connect_timeout.
            PeerLost: a peer disconnected during start.
            TransportClosed: abort() was called meanwhile.
        """
        if self.started or self.closed:
            raise RuntimeError(f"rank {self.rank}: start() called twice")
        try:
            await self._start()
        except BaseException:
            self.abort()
            raise
        self.started = True

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        host = self._host or default_host()
        if self._auth is None and not self._insecure and not _is_loopback(host):
            raise PermissionError(
                f"rank {self.rank}: refusing to bind {host} without a job secret: set RRFP_JOB_SECRET "
                "or --job-secret-file, or pass --insecure to accept unauthenticated traffic"
            )
        self._ctx = zmq.asyncio.Context()
        self._bind(host, loop)
        self.peer_endpoints = await asyncio.to_thread(self._rendezvous.exchange, self.endpoint)
        self._check_alive()
        for p in sorted(self.peers()):
            self._connect_peer(p, loop)
        await self._await_connections(deadline, loop)

    def _bind(self, host: str, loop: asyncio.AbstractEventLoop) -> None:
        """The receiving side: the ROUTER socket bound on ``host`` (its endpoint in
        ``self.endpoint``), its gatekeeper under a job secret, and the receiver reading it."""
        if self._auth is not None:
            keys = {z85.decode(self._auth.curve_keypair(self.job, r)[0]): r
                    for r in range(self.world_size)}
            self._gate = Gatekeeper(self._ctx, self.rank, keys, self.stats, self.world_size,
                                    guard=self._rendezvous.guard_own_entry)
        # A plain socket: arrivals are read from an event-loop reader on its FD, not
        # through zmq.asyncio's future per receive.
        router = self._router = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        self._sockopts(router)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Per frame (libzmq cannot bound a whole message): the header frame may add its own.
        router.setsockopt(zmq.MAXMSGSIZE, min(self.max_bytes, 2**62) + MAX_HEADER_BYTES)
        if self._auth is not None:
            pub, sec = self._auth.curve_keypair(self.job, self.rank)
            router.curve_publickey, router.curve_secretkey = pub, sec
            router.curve_server = True
            router.zap_domain = b"rrfp"
            self._gate.watch(router)
        if ":" in host:
            router.setsockopt(zmq.IPV6, 1)
        bind_in_range(router, host, self.rank)  # a port the OS picks, or one of --port-range
        self.endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        # Checked frame by frame as a message is read: routing id + header + tensors.
        self._receiver = Receiver(router, self.rank, self._rank_of, self._auth is not None, MAX_TENSORS + 2,
                                  self.max_bytes + MAX_HEADER_BYTES, self.stats, reject=self.reject,
                                  on_bye=self.on_bye, on_lost_notice=self._on_lost_notice,
                                  deliver=self.deliver_frames, fail=self.fail, closed=lambda: self.closed)
        self._receiver.start(loop)

    def _connect_peer(self, p: int, loop: asyncio.AbstractEventLoop) -> None:
        """The sending side to peer ``p``: a DEALER socket, its monitor and its sender task."""
        d = self._ctx.socket(zmq.DEALER)
        self._sockopts(d)
        d.setsockopt(zmq.ROUTING_ID, str(self.rank).encode())
        if self._auth is not None:
            d.curve_publickey, d.curve_secretkey = self._auth.curve_keypair(self.job, self.rank)
            # The server is authenticated by the key derived for that rank, never by
            # anything read from the store.
            d.curve_serverkey = self._auth.curve_keypair(self.job, p)[0]
        if ":" in self.peer_endpoints[p].split("//", 1)[1].rsplit(":", 1)[0]:
            d.setsockopt(zmq.IPV6, 1)
        # Monitor before connect, or the handshake event could be missed.
        mon = d.get_monitor_socket(_MONITOR_EVENTS)
        self._dealers[p], self._monitors[p] = d, mon
        # A synchronous view of the same socket: send() hands a message straight to
        # ZeroMQ when nothing is queued before it, skipping a coroutine hop per message.
        self._direct[p] = zmq.Socket.shadow(d.underlying)
        self._connected[p] = loop.create_future()
        self._outq[p] = deque()
        self._out_ready[p] = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._monitor(p, mon)))
        d.connect(self.peer_endpoints[p])
        self._tasks.append(asyncio.create_task(self._sender(p, d)))

    async def _await_connections(self, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until every peer's handshake is done, a peer is lost, or ``deadline``.

        Raises:
            TimeoutError: naming the peers not connected by the deadline.
        """
        # Wake on each handshake, and on loss (which sets _bye_event).
        for fut in self._connected.values():
            fut.add_done_callback(lambda _f: self.peer_event.set())
        while not all(f.done() for f in self._connected.values()) and not self.lost_peers:
            remaining = deadline - loop.time()
            if remaining <= 0 or self.closed:
                break
            self.peer_event.clear()
            try:
                await asyncio.wait_for(self.peer_event.wait(), remaining)
            except TimeoutError:
                break
        self._check_alive()
        slow = sorted(p for p, f in self._connected.items() if not f.done())
        if slow:
            raise TimeoutError(
                f"rank {self.rank}: no connection to ranks {slow} within "
                f"{self._connect_timeout} s"
            )

    def _check_alive(self) -> None:
        if self.closed:
            raise TransportClosed(f"rank {self.rank}: aborted during start")
        if self.lost_peers:
            raise self.lost_peers[min(self.lost_peers)]

    def _sockopts(self, s: zmq.Socket) -> None:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self._hwm)
        s.setsockopt(zmq.RCVHWM, self._hwm)
        s.setsockopt(zmq.HEARTBEAT_IVL, self._hb_ivl_ms)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb_timeout_ms)
        # TTL makes the remote side drop us too if our pings stop (we hang).
        s.setsockopt(zmq.HEARTBEAT_TTL, min(self._hb_timeout_ms, 6553500))
        s.copy_threshold = ZERO_COPY_MIN

    # -- coroutines ------------------------------------------------------------

    async def _sender(self, p: int, sock: zmq.asyncio.Socket) -> None:
        q, ready = self._outq[p], self._out_ready[p]
        try:
            while True:
                while q:
                    frames = q[0]
                    # copy=False + copy_threshold: only frames >= 64 KiB go zero-copy.
                    await sock.send_multipart(frames, copy=False)
                    q.popleft()
                    if frames[0] is not BYE:
                        self.stats["messages_sent"] += 1
                        self.stats["bytes_sent"] += frames_nbytes(frames)
                    self._pending -= 1
                    self._progress.set()
                ready.clear()
                await ready.wait()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self.closed:
                log.exception("rank %d: sender to rank %d failed", self.rank, p)
                self.fail(
                    TransportClosed(f"rank {self.rank}: sender to rank {p} failed: {e!r}")
                )
                self._progress.set()

    async def _monitor(self, p: int, mon: zmq.asyncio.Socket) -> None:
        # Before the first handshake with p succeeds (inside start(), under its deadline), a
        # handshake cut without an outcome (HANDSHAKE_FAILED_NO_DETAIL: the connection closed
        # or outlasted ZeroMQ's handshake interval, as when a loaded peer's gatekeeper thread
        # waits for CPU) and the disconnect that follows are no loss: libzmq reconnects, and
        # nothing was sent yet. Up to START_RETRIES in a row; an authentication or protocol
        # failure (a wrong key, not rrfp) is never retried, nor anything once connected.
        cut_in_a_row = 0
        try:
            while True:
                ev = parse_monitor_message(await mon.recv_multipart())
                what = ev["event"]
                starting = not self._connected[p].done()
                if starting and cut_in_a_row and what == zmq.EVENT_DISCONNECTED:
                    continue  # the cut handshake's own disconnect: libzmq reconnects
                if (starting and what == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                        and cut_in_a_row < START_RETRIES and not self.closed):
                    cut_in_a_row += 1
                    self.handshake_retries += 1
                    log.info("rank %d: handshake with rank %d cut before an outcome; reconnecting (%d of %d)",
                             self.rank, p, cut_in_a_row, START_RETRIES)
                    continue
                if what == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    cut_in_a_row = 0
                    if not self._connected[p].done():
                        self._connected[p].set_result(None)
                elif what == zmq.EVENT_DISCONNECTED:
                    self._receiver.drain()  # a lost-rank notice may already be waiting
                    self._on_disconnect(
                        p,
                        f"connection to {self.peer_endpoints.get(p)} closed (process "
                        f"gone, or no heartbeat answer for {self._hb_timeout_ms / 1000:g} s)",
                    )
                elif what in _HANDSHAKE_FAILED:
                    tries = f", {cut_in_a_row + 1} times in a row" if cut_in_a_row else ""
                    self._on_disconnect(p, f"ZMTP handshake failed ({zmq.Event(what).name}{tries})")
                elif what == zmq.EVENT_MONITOR_STOPPED:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Without its monitor a peer's death would go unnoticed: fail loudly.
            if not self.closed:
                log.exception("rank %d: monitor of rank %d failed", self.rank, p)
                self.on_peer_lost(p, f"monitor failed: {e!r}")

    def _on_disconnect(self, p: int, reason: str) -> None:
        if self.said_bye(p) or self.closed:
            return
        if self.closing:
            asyncio.get_running_loop().call_later(self._bye_grace, self.on_peer_lost, p, reason)
        elif self.lost_peers:
            self.on_peer_lost(p, reason)
        else:
            # The peer's notice naming the rank it lost first may still be on its way.
            asyncio.get_running_loop().call_later(_LOST_NOTICE_GRACE, self.on_peer_lost, p, reason)

    # -- root cause ------------------------------------------------------------

    def _on_lost_notice(self, src: int, body: bytes) -> None:
        """``src`` is leaving because it lost rank X first: fail with X, not with src."""
        x = self._rank_of.get(body)
        if x is None or x == self.rank:
            self.reject(src, f"malformed lost-rank notice {body[:16]!r}")
            return
        self._notices[src] = x
        if x not in self.lost_peers:
            self.on_peer_lost(x, f"reported by rank {src}, which stopped because of it")

    def on_peer_lost(self, src: int, reason: str) -> None:
        first = not self.lost_peers
        if src in self._notices and src not in self.lost_peers and self._notices[src] in self.lost_peers:
            return  # src left because of a loss we already report
        super().on_peer_lost(src, reason)
        if first and self.lost_peers:
            # Tell the others why we are about to leave, straight to ZeroMQ (the sender
            # coroutines may never run again): they then name the same root cause.
            self._send_lost_notices(next(iter(self.lost_peers)))

    async def wait_lost(self, timeout: float | None = None) -> PeerLost | None:
        """The first peer lost, waiting up to ``timeout`` s for one to be noticed.

        For a rank whose step failed elsewhere (a collective over another channel whose
        connection a dying peer reset): the root cause is then named, not the symptom.
        ``None``: as long as this transport can take to notice a lost peer at worst (its
        heartbeat timeout, plus a second for a lost-rank notice), however loaded the
        machine; a dead process's connections close at once, so it usually returns sooner."""
        if timeout is None:
            timeout = self._hb_timeout_ms / 1000 + 1.0
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not self.lost_peers and not self.closed and (left := end - loop.time()) > 0:
            self.peer_event.clear()
            try:
                await asyncio.wait_for(self.peer_event.wait(), left)
            except TimeoutError:
                break
        return self._first_lost() if self.lost_peers else None

    def _first_lost(self) -> PeerLost:
        return next(iter(self.lost_peers.values()))

    def close_outcome(self, missing: set[int], timeout: float) -> None:
        if self.lost_peers:
            raise self._first_lost()
        super().close_outcome(missing, timeout)

    def wake_flush(self) -> None:
        self._progress.set()

    def _send_lost_notices(self, lost: int) -> None:
        for p, d in self._direct.items():
            if p != lost and p not in self.lost_peers and not d.closed:
                try:
                    send_now(d, [LOST_NOTICE, str(lost).encode()])
                except zmq.ZMQError:
                    pass
        self._notice_sent = True

    # -- send side -------------------------------------------------------------

    def send(
        self,
        dst: int,
        key: MsgKey,
        tensors: Sequence[Tensor | None],
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.check_send(dst)
        if key.job != self.job:
            raise ValueError(f"key.job {key.job!r} is not this transport's job {self.job!r}")
        frames = encode(key, tensors, meta)
        if dst == self.rank:
            # Loopback skips the wire but not the codec: the receiver still gets
            # fresh tensors that do not alias the sender's.
            self.stats["messages_sent"] += 1
            self.stats["bytes_sent"] += frames_nbytes(frames)
            self.deliver_frames(self.rank, frames)
            return
        self._enqueue(dst, frames)

    def _enqueue(self, dst: int, frames: list[Frame]) -> None:
        direct = self._direct.get(dst)
        if direct is not None and not self._outq[dst] and dst not in self.lost_peers:
            # The sender coroutine is idle exactly when the queue is empty, so this keeps
            # per-peer order. Nothing waits on a direct send (flush and close wait for
            # the queues), so no progress event is set.
            try:
                send_now(direct, frames)
            except zmq.Again:
                pass  # peer's pipe full (or not connected yet): queue behind it
            else:
                if frames[0] is not BYE:
                    self.stats["messages_sent"] += 1
                    self.stats["bytes_sent"] += frames_nbytes(frames)
                return
        self._outq[dst].append(frames)
        self._out_ready[dst].set()
        self._pending += 1

    async def flush(self) -> None:
        while True:
            if self.lost_peers:
                raise self._first_lost()
            if self.error is not None:
                raise self.error
            if self._pending == 0:
                return
            self._progress.clear()
            await self._progress.wait()

    async def _drain_live(self) -> None:
        """Wait until the queues of all peers not lost are handed to ZeroMQ."""
        while any(q for p, q in self._outq.items() if p not in self.lost_peers):
            if self.error is not None and not isinstance(self.error, PeerLost):
                return
            self._progress.clear()
            await self._progress.wait()

    # -- shutdown --------------------------------------------------------------

    async def close(self, timeout: float = 30.0) -> None:
        if self.closed or self.closing:
            return
        if not self.started:
            self.abort()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.closing = True
        for p in self.peers():
            self._enqueue(p, [BYE])
        missing = await self.await_byes(timeout)
        try:
            # Our BYEs must be in ZeroMQ's queues before the sockets close; a lost
            # peer's queue may never drain, so it is not waited for.
            await asyncio.wait_for(self._drain_live(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            pass  # reported below as missing BYEs
        await self._teardown(graceful=True)
        self.close_outcome(missing, timeout)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._rendezvous.stop()
        for t in self._tasks:
            t.cancel()
        if self._receiver is not None:
            self._receiver.stop()
        if self._gate is not None:
            self._gate.stop()
        # Lost-rank notices just handed to ZeroMQ get a second to leave; nothing else waits.
        notice = self._notice_sent
        self._close_sockets(linger_ms=1000 if notice else 0)
        if self._ctx is not None:
            if notice:
                self._ctx.term()
            else:
                self._ctx.destroy(linger=0)
        self.fail(TransportClosed(f"rank {self.rank}: aborted"))
        self.peer_event.set()
        self._progress.set()

    async def _teardown(self, graceful: bool) -> None:
        self.closed = True
        self._rendezvous.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._receiver is not None:
            self._receiver.stop()
        if self._gate is not None:
            self._gate.stop()
        self._close_sockets(linger_ms=self._close_linger_ms if graceful else 0)
        if self._ctx is not None:
            # term() blocks until lingering frames are out: keep the loop free.
            await asyncio.to_thread(self._ctx.term)
        self.fail(TransportClosed(f"rank {self.rank}: closed"))
        self._progress.set()

    def _close_sockets(self, linger_ms: int) -> None:
        for p, d in self._dealers.items():
            if not d.closed:
                try:
                    d.disable_monitor()
                except zmq.ZMQError:
                    pass
        for m in self._monitors.values():
            m.close(linger=0)
        for p, d in self._dealers.items():
            # Lingering toward a lost peer would only stall ctx.term().
            d.close(linger=0 if p in self.lost_peers else linger_ms)
        if self._router is not None:
            self._router.close(linger=0)

