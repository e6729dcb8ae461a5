"""The ZeroMQ transport's rendezvous and root-cause halves (a mixin of :class:`ZmqTransport`).

- Rendezvous: each rank publishes its endpoint in the store, signed with the job secret
  (:meth:`JobAuth.sign <rrfp.transport.auth.JobAuth.sign>`), and reads every peer's; a forged
  entry is refused, counted once per distinct value (``rejected_store``) and waited past,
  while the owner writes its own entry back from the gatekeeper thread until every peer has
  authenticated.
- Root cause: the first peer a rank loses is the one it names, and it tells its other peers
  ("leaving because rank X was lost", :data:`LOST_NOTICE`), so a cascade of exits names the
  rank that really failed rather than the last one to leave.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time

from . import auth as _auth
from ..errors import PeerLost, TransportClosed

log = logging.getLogger("rrfp.transport.zmq")

LOST_NOTICE = b"\x00rrfp-lost"
"""First frame of a lost-rank notice; the second is the lost rank in ASCII. A msgpack
header starts with a map marker, so this never parses as data."""


def default_host() -> str:
    """Address to bind: 127.0.0.1 when MASTER_ADDR is unset or loopback, else the
    local address of the interface that routes to MASTER_ADDR.

    The route is found by connecting a UDP socket, which sends nothing."""
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr or addr == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(addr).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name: resolve it below
    port = int(os.environ.get("MASTER_PORT", "29500") or 29500)
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _tcp_endpoint(host: str) -> str:
    return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


class SecureRendezvous:
    """Methods of :class:`~rrfp.transport.zmq.ZmqTransport` that need its attributes
    (``_store``, ``_auth``, ``job``, ``stats``, ``_lost``...)."""

    def _rendezvous(self, endpoint: str) -> dict[int, str]:
        """Publish our endpoint and collect every peer's (runs in a worker thread).

        Polls ``store.check`` (one round trip for all missing keys) with a growing
        interval, rather than blocking in ``store.wait``: abort() can then stop it,
        and no timed-out wait spams C++ warnings.
        """
        store = self._store
        self._published = endpoint if self._auth is None else self._auth.sign(
            self.job, self._store_key(self.rank), endpoint)
        store.set(self._store_key(self.rank), self._published)
        keys = {p: self._store_key(p) for p in sorted(self._peers())}
        found: dict[int, str] = {}
        deadline = time.monotonic() + self._connect_timeout
        interval = 0.002
        while True:
            if len(keys) == len(found) or not store.check(list(keys.values())):
                pass
            else:
                for p, k in keys.items():
                    if p not in found and (v := self._read_entry(p, bytes(store.get(k)))) is not None:
                        found[p] = v
            if len(found) == len(keys):
                return found
            if self._stop_rendezvous.is_set():
                raise TransportClosed(f"rank {self.rank}: aborted during rendezvous")
            if time.monotonic() > deadline:
                missing = sorted(set(keys) - set(found))
                raise TimeoutError(
                    f"rank {self.rank}: ranks {missing} did not publish "
                    f"{'signed ' if self._auth else ''}endpoints within {self._connect_timeout} s"
                )
            self._stop_rendezvous.wait(interval)
            interval = min(interval * 1.5, 0.1)

    def _read_entry(self, p: int, raw: bytes) -> str | None:
        """A peer's endpoint from its store entry, or None (refused and counted) if forged."""
        if self._auth is None:
            return raw.decode()
        try:
            return self._auth.verify(self.job, self._store_key(p), raw)
        except _auth.ForgedEntry as e:
            # Once per distinct forged value: the owner writes its entry back (see
            # _guard_own_entry) and we read again.
            if raw not in self._forged_seen:
                self._forged_seen.add(raw)
                self.stats["rejected_store"] += 1
                self._reject(p, f"{e}; waiting for rank {p} to publish it again")
            return None

    def _guard_own_entry(self) -> bool:
        """Gatekeeper thread: write our signed entry back if someone overwrote it.

        Returns False once there is nothing left to guard (closed)."""
        if self._closed or self._stop_rendezvous.is_set():
            return False
        published = self._published
        if published is None:
            return True
        key = self._store_key(self.rank)
        try:
            if bytes(self._store.get(key)).decode("utf-8", "replace") != published:
                self.stats["rejected_store"] += 1
                log.warning("rank %d: store entry %r was overwritten; writing it back", self.rank, key)
                self._store.set(key, published)
        except Exception as e:  # the store went away: peers will time out and say so
            log.warning("rank %d: cannot check store entry %r: %s", self.rank, key, e)
            return False
        return True

    # -- root cause --------------------------------------------------------------

    def _on_lost_notice(self, src: int, body: bytes) -> None:
        """``src`` is leaving because it lost rank X first: fail with X, not with src."""
        x = self._rank_of.get(body)
        if x is None or x == self.rank:
            self._reject(src, f"malformed lost-rank notice {body[:16]!r}")
            return
        self._notices[src] = x
        if x not in self._lost:
            self._on_peer_lost(x, f"reported by rank {src}, which stopped because of it")

    def _on_peer_lost(self, src: int, reason: str) -> None:
        first = not self._lost
        if src in self._notices and src not in self._lost and self._notices[src] in self._lost:
            return  # src left because of a loss we already report
        super()._on_peer_lost(src, reason)
        if first and self._lost:
            # Tell the others why we are about to leave, straight to ZeroMQ (the sender
            # coroutines may never run again): they then name the same root cause.
            self._send_lost_notices(next(iter(self._lost)))

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
        while not self._lost and not self._closed and (left := end - loop.time()) > 0:
            self._bye_event.clear()
            try:
                await asyncio.wait_for(self._bye_event.wait(), left)
            except TimeoutError:
                break
        return self._first_lost() if self._lost else None

    def _first_lost(self) -> PeerLost:
        return next(iter(self._lost.values()))

    def _close_outcome(self, missing: set[int], timeout: float) -> None:
        if self._lost:
            raise self._first_lost()
        super()._close_outcome(missing, timeout)

