"""The ZeroMQ transport's rendezvous: a part of :class:`~rrfp.transport.zmq.ZmqTransport`,
and the address a rank binds.

Each rank publishes its endpoint in the store, signed with the job secret
(:meth:`JobAuth.sign <rrfp.transport.auth.JobAuth.sign>`), and reads every peer's; a forged
entry is refused, counted once per distinct value (``rejected_store``) and waited past, while
the owner writes its own entry back from the gatekeeper thread until every peer has
authenticated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from .. import _net
from .._net import is_loopback as _is_loopback  # noqa: F401 - zmq.py imports it from here
from . import auth as _auth
from ..errors import TransportClosed

log = logging.getLogger("rrfp.transport.zmq")


def default_host() -> str:
    """Address to bind: the node's address (:data:`rrfp._net.NODE_ADDR_ENV`, set by
    ``rrfp node``), else the one that routes to MASTER_ADDR (:func:`rrfp._net.route_to`:
    127.0.0.1 when MASTER_ADDR is unset or loopback)."""
    return os.environ.get(_net.NODE_ADDR_ENV) or _net.route_to(
        os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "29500") or 29500))


def _tcp_endpoint(host: str, port: int = 0) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_in_range(sock: Any, host: str, rank: int) -> None:
    """Bind ``sock`` on ``host``: on a port the OS picks, or, when :data:`rrfp._net.PORT_RANGE_ENV`
    names a range (``rrfp train --port-range``), on the first free port of it, trying from
    ``rank``'s place in it on (so the ranks of a host seldom try the same port twice). A bind
    either holds the port or fails: nothing is probed free first and raced for.

    Raises:
        ValueError: the range is malformed (one line naming it).
        OSError: every port of the range is in use (one line naming the range and the host).
    """
    import zmq

    spec = os.environ.get(_net.PORT_RANGE_ENV)
    if not spec:
        sock.bind(_tcp_endpoint(host))
        return
    first, last = _net.parse_port_range(spec, _net.PORT_RANGE_ENV)
    n = last - first + 1
    for i in range(n):
        port = first + (rank + i) % n
        try:
            sock.bind(_tcp_endpoint(host, port))
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
    raise OSError(f"rank {rank}: no free port in --port-range {first}-{last} ({_net.PORT_RANGE_ENV}) on {host}: "
                  f"all {n} are in use; widen the range")


class Rendezvous:
    """Publishes this rank's endpoint in the store and collects every peer's.

    Args:
        store: the torch.distributed Store every rank shares.
        job, rank: entries live under ``rrfp/{job}/zmq/{rank}``.
        peers: the ranks whose endpoints to collect.
        auth: the job secret's keys (entries signed and verified), or None.
        timeout: seconds :meth:`exchange` waits for every peer.
        stats: the transport's counters (``rejected_store`` is added to).
        reject: ``reject(src, why)``: log and count a refusal.
    """

    def __init__(self, store: Any, job: str, rank: int, peers: list[int], auth: _auth.JobAuth | None,
                 timeout: float, stats: dict[str, int], reject: Callable[[int, str], None]) -> None:
        self._store = store
        self.job, self.rank = job, rank
        self._peers = sorted(peers)
        self._auth = auth
        self._timeout = timeout
        self._stats = stats
        self._reject = reject
        self._published: str | None = None
        self._forged_seen: set[bytes] = set()
        self._stop = threading.Event()

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s endpoint."""
        return f"rrfp/{self.job}/zmq/{rank}"

    def stop(self) -> None:
        """Stop :meth:`exchange` (it raises TransportClosed) and the guard (idempotent)."""
        self._stop.set()

    def exchange(self, endpoint: str) -> dict[int, str]:
        """Publish ``endpoint`` and collect every peer's (blocking: run it in a worker thread).

        Polls ``store.check`` (one round trip for all missing keys) with a growing
        interval, rather than blocking in ``store.wait``: :meth:`stop` can then stop it,
        and no timed-out wait spams C++ warnings.

        Raises:
            TimeoutError: naming the ranks that did not publish within the timeout.
            TransportClosed: :meth:`stop` was called.
        """
        store = self._store
        self._published = endpoint if self._auth is None else self._auth.sign(self.job, self.key(self.rank), endpoint)
        store.set(self.key(self.rank), self._published)
        keys = {p: self.key(p) for p in self._peers}
        found: dict[int, str] = {}
        deadline = time.monotonic() + self._timeout
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
            if self._stop.is_set():
                raise TransportClosed(f"rank {self.rank}: aborted during rendezvous")
            if time.monotonic() > deadline:
                missing = sorted(set(keys) - set(found))
                raise TimeoutError(
                    f"rank {self.rank}: ranks {missing} did not publish "
                    f"{'signed ' if self._auth else ''}endpoints within {self._timeout} s"
                )
            self._stop.wait(interval)
            interval = min(interval * 1.5, 0.1)

    def _read_entry(self, p: int, raw: bytes) -> str | None:
        """A peer's endpoint from its store entry, or None (refused and counted) if forged."""
        if self._auth is None:
            return raw.decode()
        try:
            return self._auth.verify(self.job, self.key(p), raw)
        except _auth.ForgedEntry as e:
            # Once per distinct forged value: the owner writes its entry back (see
            # guard_own_entry) and we read again.
            if raw not in self._forged_seen:
                self._forged_seen.add(raw)
                self._stats["rejected_store"] += 1
                self._reject(p, f"{e}; waiting for rank {p} to publish it again")
            return None

    def guard_own_entry(self) -> bool:
        """Gatekeeper thread: write our signed entry back if someone overwrote it.

        Returns False once there is nothing left to guard (stopped)."""
        if self._stop.is_set():
            return False
        published = self._published
        if published is None:
            return True
        key = self.key(self.rank)
        try:
            if bytes(self._store.get(key)).decode("utf-8", "replace") != published:
                self._stats["rejected_store"] += 1
                log.warning("rank %d: store entry %r was overwritten; writing it back", self.rank, key)
                self._store.set(key, published)
        except Exception as e:  # the store went away: peers will time out and say so
            log.warning("rank %d: cannot check store entry %r: %s", self.rank, key, e)
            return False
        return True
