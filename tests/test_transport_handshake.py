"""A ZeroMQ handshake cut during start-up (a loaded peer, a reconnect) is retried, not a lost
peer; one cut after the peer connected, or an authentication failure, still is a loss.

The cut is forced, not waited for: rank 0 reaches rank 1 through a relay that closes its first
connection before ZeroMQ's greeting (the connecting side sees HANDSHAKE_FAILED_NO_DETAIL) and
relays every later one."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

import pytest
import torch
from torch.distributed import TCPStore

from rrfp.transport.auth import JobAuth
from rrfp.transport import Direction, MsgKey
from rrfp.transport.zmq import START_RETRIES, ZmqTransport


class Relay:
    """A TCP relay to ``target`` (``tcp://host:port``) that closes its first ``cut`` connections
    at once and relays the rest both ways."""

    def __init__(self, target: str, cut: int) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.cut = cut
        self.accepted = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.cut:
                conn.close()
                continue
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


async def _start_pair(cut: int, auth: JobAuth | None):
    """Ranks 0 and 1 started together, rank 0 reaching rank 1 through a :class:`Relay`."""
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, 2, is_master=False)
    job = f"t-{uuid.uuid4().hex[:8]}"
    ts = [ZmqTransport(r, 2, s, job, auth=auth) for r, s in ((0, master), (1, client))]
    relays: list[Relay] = []
    exchange = ts[0]._rendezvous.exchange

    def through_relay(endpoint: str) -> dict[int, str]:
        peers = exchange(endpoint)
        relays.append(Relay(peers[1], cut))
        return {**peers, 1: relays[0].endpoint}

    ts[0]._rendezvous.exchange = through_relay
    results = await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts), return_exceptions=True), 60)
    return ts, relays, results, (master, client)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("secret", [None, "curve"])
async def test_a_handshake_cut_during_start_is_retried_not_a_lost_peer(secret):
    auth = JobAuth(JobAuth.generate()) if secret else None
    ts, relays, results, stores = await _start_pair(1, auth)
    try:
        assert results == [None, None], results
        assert relays[0].accepted == 2 and ts[0].handshake_retries == 1 and ts[1].handshake_retries == 0
        job = ts[0].job
        ts[0].send(1, MsgKey(job, 0, 0, 0, Direction.ACT), [torch.arange(3.0)])
        ts[1].send(0, MsgKey(job, 0, 0, 0, Direction.GRAD), [torch.ones(2)])
        got1, got0 = await asyncio.wait_for(asyncio.gather(ts[1].recv(), ts[0].recv()), 30)
        assert got1.src == 0 and got1.tensors[0].tolist() == [0.0, 1.0, 2.0]
        assert got0.src == 1 and got0.tensors[0].tolist() == [1.0, 1.0]
        # A loss is noticed within the heartbeat timeout plus a second at worst (wait_lost's
        # bound); before the fix, the cut handshake counted rank 1 lost 0.2 s after it.
        assert await ts[0].wait_lost() is None and not ts[1].lost_peers
    finally:
        for t in ts:
            t.abort()
        for r in relays:
            r.close()


@pytest.mark.timeout(120)
async def test_handshakes_cut_again_and_again_are_a_lost_peer():
    """More than START_RETRIES cuts in a row: the peer is lost, named with the count."""
    ts, relays, results, stores = await _start_pair(START_RETRIES + 1, None)
    try:
        # start() may finish on the fifth connection before the loss, which waits a moment
        # for a lost-rank notice that might name another rank, lands.
        lost = results[0] if isinstance(results[0], BaseException) else await ts[0].wait_lost(60)
        assert "rank 1" in str(lost) and "ZMTP handshake failed (HANDSHAKE_FAILED_NO_DETAIL, 4 times in a row)" in str(lost)
        assert ts[0].handshake_retries == START_RETRIES
    finally:
        for t in ts:
            t.abort()
        for r in relays:
            r.close()


def test_start_up_waits_for_peers_as_long_as_torchruns_rendezvous(monkeypatch):
    """A peer still importing and building its model on a loaded machine is waited for, not
    failed: the README's suite at load 6 lost a Hugging Face run to "rank 1: no connection to
    ranks [0] within 60.0 s". Start-up's bound (the transport's and the construction check's)
    is torchrun's own rendezvous join timeout, read from torch; a dead peer is reported by the
    launcher, not by this wait."""
    import inspect

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from rrfp import PipelineStage
    from rrfp.runtime.doors import pipeline
    from rrfp.transport.base import START_TIMEOUT_S

    assert START_TIMEOUT_S == RendezvousTimeout().join.total_seconds() == 600.0
    assert inspect.signature(ZmqTransport).parameters["connect_timeout"].default == START_TIMEOUT_S
    waited = []

    def agree(job, rank, n_ranks, error, timeout_s):
        waited.append(timeout_s)
        raise RuntimeError("stopped after the construction check")

    monkeypatch.setattr(pipeline, "_agree_on_construction", agree)
    with pytest.raises(RuntimeError, match="stopped after the construction check"):
        pipeline.Pipeline([PipelineStage(torch.nn.Identity(), 0, 1)], 2, None, rank=0, n_ranks=1, watchdog=60)
    assert waited == [START_TIMEOUT_S]  # not the step watchdog's 60 s


class _StuckOwnEntry:
    """A store whose ``get`` of rank 0's own entry waits until ``release`` is set, as a store
    call does behind the rank's blocking store wait (``new_group``'s rendezvous, one client
    connection: one request at a time). ``stuck`` is set once a reader waits there."""

    def __init__(self, store, own_key: str) -> None:
        self._store, self._own = store, own_key
        self.stuck, self.release = threading.Event(), threading.Event()

    def get(self, key):
        if key == self._own:
            self.stuck.set()
            self.release.wait()
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.timeout(120)
async def test_a_peer_is_admitted_while_the_ranks_store_is_busy():
    """Rank 0's guard of its store entry sits in a store call (as it did behind rank 0's
    ``new_group`` after rank 0 left start()); rank 1 connects only then. Rank 0 still answers
    rank 1's CURVE handshake: the CI flake 'rank 1 lost: ZMTP handshake failed
    (HANDSHAKE_FAILED_NO_DETAIL, 4 times in a row)' was rank 0's ZAP thread waiting in that
    store call, so rank 1 never finished start() to join rank 0's wait."""
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, 2, is_master=False)
    job = f"t-{uuid.uuid4().hex[:8]}"
    auth = JobAuth(JobAuth.generate())
    busy = _StuckOwnEntry(master, f"rrfp/{job}/zmq/0")
    ts = [ZmqTransport(0, 2, busy, job, auth=auth), ZmqTransport(1, 2, client, job, auth=auth)]
    exchange = ts[1]._rendezvous.exchange

    def after_rank0_is_stuck(endpoint: str) -> dict[int, str]:
        peers = exchange(endpoint)
        busy.stuck.wait()
        return peers

    ts[1]._rendezvous.exchange = after_rank0_is_stuck
    try:
        results = await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts), return_exceptions=True), 60)
        assert results == [None, None], results
        assert busy.stuck.is_set() and not busy.release.is_set()
        ts[1].send(0, MsgKey(job, 0, 0, 0, Direction.GRAD), [torch.ones(2)])
        got = await asyncio.wait_for(ts[0].recv(), 30)
        assert got.src == 1 and got.tensors[0].tolist() == [1.0, 1.0]
    finally:
        busy.release.set()
        for t in ts:
            t.abort()
