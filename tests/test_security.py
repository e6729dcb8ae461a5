"""Authenticated transport in one process: outsiders refused and counted, forged store
entries refused, limits before decoding, blame followed to the first failed rank."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from rrfp.train.guard import NonFiniteStep, blamed_rank, root_cause
from rrfp.transport.auth import ForgedEntry, JobAuth
from rrfp.transport.base import PeerLost
from rrfp.transport.codec import encode
from rrfp.transport.keys import Direction, MsgKey
from rrfp.transport.zmq import ZmqTransport

SECRET = "s3cret-for-tests-only-0123456789"
_DONE = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | \
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class ForgingStore:
    """A HashStore where an attacker overwrites rank 1's entry right after rank 1 writes it,
    once, and rank 1's own write waits until the three others have read the forged one."""

    def __init__(self, key: str) -> None:
        self.inner, self.key, self.reads = dist.HashStore(), key, 0
        self.inner.set(key, "tcp://127.0.0.1:9\tdeadbeef")  # forged before anyone publishes
        self.forged_read = asyncio.Event()

    def set(self, k, v):
        return self.inner.set(k, v)

    def check(self, keys):
        return self.inner.check(keys)

    def get(self, k):
        v = self.inner.get(k)
        if k == self.key and v.startswith(b"tcp://127.0.0.1:9\t"):
            self.reads += 1
        return v


def attack(endpoint: str, frames: list, routing_id: bytes, curve_key: tuple | None = None) -> int:
    """Connect once (no reconnect), send ``frames``, return the first handshake outcome event."""
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.routing_id, d.linger = routing_id, 0
    d.setsockopt(zmq.RECONNECT_IVL, -1)
    if curve_key is not None:
        d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
        d.curve_serverkey = curve_key
    mon = d.get_monitor_socket(_DONE)
    d.connect(endpoint)
    try:
        d.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass  # already refused and the pipe gone: nothing to send

    assert mon.poll(20000), "no handshake outcome within 20 s"
    ev = recv_monitor_message(mon)["event"]
    d.disable_monitor()
    mon.close(0)
    d.close(5000 if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED else 0)  # an admitted message gets to leave
    return ev


def raw_attack(endpoint: str, data: bytes) -> bytes:
    """A client that does not speak ZMTP 3 (no ZeroMQ event on the server for it): send
    ``data`` and return what came back until the rank closed the connection."""
    import socket

    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(4096):  # the rank closing the connection ends the wait
                got += chunk
        except ConnectionResetError:
            pass  # closed with our bytes unread: a reset, not a FIN
    return got


async def _until(cond, what: str, timeout: float = 20.0) -> None:
    # Waits on a condition the transport's own threads set; bounded, never a fixed sleep.
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_outsiders_are_refused_counted_and_traffic_is_intact():
    key = "rrfp/j/zmq/1"
    store = ForgingStore(key)
    a = JobAuth(SECRET)
    ts = [ZmqTransport(r, 4, store, "j", host="127.0.0.1", auth=a, insecure=False, max_bytes=1 << 20)
          for r in range(4)]
    starts = [asyncio.ensure_future(ts[r].start()) for r in (0, 2, 3)]
    # Forced order: rank 1 publishes only after ranks 0, 2 and 3 have refused the forged entry.
    await _until(lambda: all(ts[r].stats["rejected_store"] == 1 for r in (0, 2, 3)), "forged entry refused")
    await asyncio.gather(ts[1].start(), *starts)
    x = torch.arange(6.0)
    g = MsgKey("j", 0, 0, 2, Direction.GRAD)
    forged = [
        (ts[2].endpoint, encode(g, [torch.full((6,), float("nan"))]), b"3", None),        # forged gradient
        (ts[1].endpoint, encode(MsgKey("j", 0, 0, 1, Direction.ACT), [x * 1.5]), b"0", None),  # forged activation
        (ts[0].endpoint, encode(MsgKey("j", 0, 0, 0, Direction.CTL), [], {"kind": "stats", "loss": 123.456}), b"1", None),
        (ts[2].endpoint, [b"\x81"] + [b"\0" * (1 << 20)] * 8, b"1", None),                # multi-frame over max_bytes
        (ts[2].endpoint, encode(g, [torch.zeros(6)]), b"3", zmq.curve_keypair()[0]),        # CURVE, wrong server key
        (ts[2].endpoint, encode(g, [torch.zeros(6)]), b"1", a.curve_keypair("j", 2)[0]),    # right server, unknown key
    ]
    for ep, frames, rid, server in forged:
        assert attack(ep, frames, rid, server) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    # Not ZeroMQ at all (libzmq drops these without a handshake event): counted when closed.
    raw_attack(ts[2].endpoint, b"GET / HTTP/1.0\r\n\r\n")
    raw_attack(ts[2].endpoint, b"\xff" + b"\0" * 8 + b"\x7f\x01\x00" + b"\0" * 64)  # ZMTP 2.0 greeting
    await _until(lambda: ts[2].stats["rejected_handshake"] == 6 and ts[1].stats["rejected_handshake"] == 1
                 and ts[0].stats["rejected_handshake"] == 1, "every forged connection counted")
    ts[3].send(2, g, [x])
    m = await ts[2].recv()
    assert (m.src, m.key) == (3, g)
    assert torch.equal(m.tensors[0], x)  # the genuine message, not a forged one
    assert ts[2].stats["messages_received"] == 1
    await asyncio.gather(*(t.close() for t in ts))


def test_outcome_matcher_counts_only_connections_closed_without_a_handshake_outcome():
    from rrfp.transport.zmq_gate import OutcomeMatcher

    m = OutcomeMatcher()
    for fd in (10, 11, 12):  # three genuine peers connect and authenticate
        m.accepted(fd)
    m.outcome(), m.outcome(), m.outcome()
    m.accepted(13)  # garbage: closed with no outcome while the peers stay connected
    assert m.closed(13)
    m.accepted(14), m.accepted(15)  # a squatter failing while a peer reconnects and succeeds
    m.outcome(), m.outcome()
    assert not m.closed(14)
    m.accepted(13)  # a reused socket number is a new connection
    assert m.closed(13)
    assert [m.closed(fd) for fd in (10, 11, 12, 15)] == [False] * 4
    assert m._free == [] and m._open == {}
    assert not m.closed(99)  # accepted before the monitor started: not counted


def test_the_launcher_learns_which_ranks_it_stopped_though_their_lines_are_hidden(capsys):
    import logging

    from rrfp.train.cli import _quiet_launcher_logs
    from rrfp.train.guard import LauncherSignals

    api = logging.getLogger(LauncherSignals.LOGGER)
    before = list(api.filters)
    rec = LauncherSignals()
    try:
        _quiet_launcher_logs()  # a previous run in this process left its hiding filter
        _quiet_launcher_logs(rec)
        api.warning("Sending process %s closing signal %s", 4321, "SIGTERM")
    finally:
        api.removeFilter(rec)
    assert rec.pids == {4321}
    assert "closing signal" not in capsys.readouterr().err
    assert len(api.filters) == max(1, len(before))


async def test_no_secret_refuses_a_non_loopback_bind_in_one_line():
    t = ZmqTransport(0, 2, dist.HashStore(), "j", host="10.1.2.3", auth=None, insecure=False)
    with pytest.raises(PermissionError, match=r"refusing to bind 10\.1\.2\.3 without a job secret.*--insecure"):
        await t.start()


@pytest.mark.timeout(60)
async def test_insecure_multiframe_over_max_bytes_is_dropped_undecoded():
    store = dist.HashStore()
    ts = [ZmqTransport(r, 2, store, "j", host="127.0.0.1", auth=None, insecure=True, max_bytes=1 << 16)
          for r in range(2)]
    await asyncio.gather(*(t.start() for t in ts))
    # An anonymous peer squatting on no rank, and one claiming rank 1 with 40 frames of 4 KiB
    # (each frame under ZMQ_MAXMSGSIZE, together over max_bytes); rank 0 holds the id "0".
    attack(ts[1].endpoint, encode(MsgKey("j", 0, 0, 1, Direction.ACT), [torch.ones(2)]), b"7")
    attack(ts[1].endpoint, [b"\x81"] + [b"\0" * 4096] * 40, b"1")
    await _until(lambda: ts[1].stats["rejected_oversize"] == 1 and ts[1].stats["rejected_unknown_peer"] == 1,
                 "both refused")
    assert ts[1].stats["messages_received"] == 0
    await asyncio.gather(*(t.close() for t in ts))


def test_store_signature_binds_job_entry_and_secret():
    a, b = JobAuth(SECRET), JobAuth(SECRET[::-1])
    signed = a.sign("j", "rrfp/j/zmq/1", "tcp://127.0.0.1:5555")
    assert a.verify("j", "rrfp/j/zmq/1", signed) == "tcp://127.0.0.1:5555"
    for auth, job, name, value in [(b, "j", "rrfp/j/zmq/1", signed), (a, "k", "rrfp/j/zmq/1", signed),
                                   (a, "j", "rrfp/j/zmq/2", signed), (a, "j", "rrfp/j/zmq/1", "tcp://evil:1"),
                                   (a, "j", "rrfp/j/zmq/1", signed.replace("5555", "5556"))]:
        with pytest.raises(ForgedEntry, match="not signed with this job's secret"):
            auth.verify(job, name, value)
    with pytest.raises(ValueError, match="too short: 5 bytes"):
        JobAuth("short")
    assert a.curve_keypair("j", 0) != a.curve_keypair("j", 1) != b.curve_keypair("j", 1)


def _failure(code: int, blame: int | None, rank: int, t: float = 0.0):
    data = {"rrfp": {"rank": rank, "blame": blame, "time": t}} if blame is not None else {}
    return SimpleNamespace(exitcode=code, timestamp=int(t), error_file_data=data, message="")


def test_root_cause_follows_blame_not_rank_zero():
    # The cascade of the issue: rank 2 killed, rank 0 leaves naming 2; rank 1 saw only rank 0
    # go but was told why (blames 2); rank 3 blames 0 (told nothing): all lead to 2.
    f = {0: _failure(1, 2, 0, 5.0), 1: _failure(1, 2, 1, 6.0), 2: _failure(-9, None, 2, 9.0), 3: _failure(1, 0, 3, 7.0)}
    assert root_cause(f) == 2
    # Rank 1 got SIGTERM from outside; the launcher's SIGTERM hit none yet; others blame 1.
    f = {0: _failure(1, 1, 0, 3.0), 1: _failure(-15, None, 1, 4.0), 3: _failure(1, 1, 3, 3.0)}
    assert root_cause(f) == 1
    # Nobody spoke (the launcher stopped the rest first): the SIGTERM the launcher did not send.
    f = {r: _failure(-15, None, r, 4.0) for r in range(4)}
    for r in range(4):
        f[r].pid = 100 + r
    assert root_cause(f, launcher_signalled={100, 102, 103}) == 1
    # Two ranks failed by themselves, blaming no one (a bad batch on the first and last
    # stage); the launcher stopped the others in the same second (torch's whole-second
    # timestamp 100 looks earlier than 100.7): the earliest own record wins, never a rank
    # the launcher stopped.
    f = {0: _failure(1, 0, 0, 100.9), 1: _failure(-15, None, 1, 100.0), 2: _failure(-15, None, 2, 100.0),
         3: _failure(1, 3, 3, 100.7)}
    for r in range(4):
        f[r].pid = 100 + r
    assert root_cause(f, launcher_signalled={101, 102}) == 3
    # No records at all: a signal death first, then the earliest.
    assert root_cause({0: _failure(1, None, 0, 1.0), 3: _failure(-9, None, 3, 2.0)}) == 3
    assert root_cause({0: _failure(1, None, 0, 2.0), 3: _failure(1, None, 3, 1.0)}) == 3
    assert blamed_rank(RuntimeError("step failed: rank 2 lost: connection closed"), 0) == 2
    assert blamed_rank(NonFiniteStep(4, 3, "loss"), 1) == 3
    try:
        raise RuntimeError("pipeline failed") from PeerLost(2, "x")
    except RuntimeError as e:
        assert blamed_rank(e, 0) == 2


def test_statistics_are_validated_rate_limited_and_a_zero_loss_does_not_crash(capsys):
    from rrfp.scheduler.tasks import Placement
    from rrfp.train.report import Reporter

    args = SimpleNamespace(steps=2, microbatches=4, quiet=True, hint="bf", skip_nonfinite=False)
    rep = Reporter(args, 4, Placement(4, 1, "loop"))
    ok = {"kind": "stats", "busy": 0.5, "wall": 1.0, "peak": 2, "loss": None}
    bad = [({**ok, "step": 0, "loss": 123.456}, 1),                 # a loss from a rank without the last stage
           ({**ok, "step": 0, "loss": float("nan")}, 3),
           ({**ok, "step": 0, "busy": 2.0}, 2),                      # busy > wall
           ({**ok, "step": 0, "wall": float("inf")}, 2),
           ({**ok, "step": 7}, 2),                                   # past the last step
           ({**ok, "step": True}, 2),                                # bool is not a step
           ({**ok, "step": 0, "peak": 10**9}, 2),
           ({**ok, "step": 0}, 3)]                                   # last stage without a loss
    for meta, src in bad + [(bad[0][0], 1)] * 100:
        rep.add(meta, src)
    assert rep.pending == {} and rep.ignored == 108
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 + 5  # 1, 2, 3, then 4, 8, 16, 32, 64
    assert "a loss from rank 1, which does not hold the last stage" in lines[0]
    for step in range(2):  # a forged-looking but valid first loss of 0 must not crash the summary
        for r in range(4):
            rep.add({**ok, "step": step, "loss": 0.0 if r == 3 else None}, r)
        rep.step_time[step], rep.tokens[step] = 1.0, 10
        rep.flush()
    rep.summary(2.0)
    assert "loss 0.0000 -> 0.0000 (change n/a)" in capsys.readouterr().out


def test_outputs_and_secret_file_are_checked_before_any_process_starts(tmp_path, capsys):
    from rrfp.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["train", "--trace", str(blocker / "trace")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rrfp train: error: --trace='{blocker / 'trace'}': cannot ") and "\n" not in err
    short = tmp_path / "secret"
    short.write_text("abc\n")
    assert main(["train", "--job-secret-file", str(short)]) == 2
    assert capsys.readouterr().err.strip() == (f"rrfp train: error: --job-secret-file: job secret file '{short}': "
                                               "job secret too short: 3 bytes, expected at least 16")
    assert main(["train", "--job-secret-file", str(tmp_path / "missing")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert main(["train", "--loss-file", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"rrfp train: error: --loss-file={str(tmp_path)!r}: is a folder, expected a file path"
    assert main(["train", "--loss-file", str(blocker / "losses")]) == 2
    assert capsys.readouterr().err.strip() == (f"rrfp train: error: --loss-file='{blocker / 'losses'}': "
                                               "cannot use this path: Not a directory")


def test_loss_file_holds_every_step_exactly(tmp_path):
    from rrfp.train.report import write_loss_file

    rows = [{"step": 0, "loss": 2.5}, {"step": 1, "loss": 1 / 3}]
    write_loss_file(str(tmp_path / "l"), rows)
    lines = (tmp_path / "l").read_text().splitlines()
    assert lines == ["1 0x1.4000000000000p+1", f"2 {(1 / 3).hex()}"]
    assert float.fromhex(lines[1].split()[1]) == 1 / 3


def test_atomic_writes_leave_no_half_file(tmp_path):
    from rrfp.train.guard import atomic_path, atomic_write_text

    target = tmp_path / "out.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    with pytest.raises(OSError, match=f"cannot write '{tmp_path / 'no' / 'x.json'}'"):
        atomic_write_text(tmp_path / "no" / "x.json", "y")


def test_an_activation_or_gradient_is_accepted_only_from_the_rank_of_its_producing_stage():
    from rrfp.runtime.engine.inbox import Inbox
    from rrfp.runtime.engine.router import Router
    from rrfp.scheduler.tasks import Placement
    from rrfp.transport.base import Message

    inbox = Inbox(Router(Placement(4), 1), "j", {1: None}, 4)
    for src, direction, why in [(3, Direction.ACT, "stage 0 belongs to rank 0"),
                                (0, Direction.GRAD, "stage 2 belongs to rank 2"),
                                (2, Direction.ACT, "stage 0 belongs to rank 0")]:
        inbox.on_message(Message(src, MsgKey("j", 0, 0, 1, direction), [torch.ones(1)]))
    assert inbox.rejected == 3 and inbox.pending == {}
    inbox.on_message(Message(0, MsgKey("j", 0, 0, 0, Direction.GRAD), [torch.ones(1)]))  # stage 1 is rank 1's own
    assert inbox.rejected == 4
    inbox.on_message(Message(0, MsgKey("j", 1, 0, 1, Direction.ACT), [torch.ones(1)]))  # rank 0, step ahead: kept
    assert inbox.rejected == 4 and len(inbox.pending[1]) == 1
