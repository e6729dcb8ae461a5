"""One conformance suite that every transport runs (transport contract v2, issue 14), read from
the transport registry (issue 30).

Kinds: every name of :mod:`rrfp.transport.registry` (``zmq``: ZeroMQ frames; ``torch``: ZeroMQ
announcements + gloo point-to-point, all ranks in this process on one loop; ``fake``:
in-process FakeNetwork; ``fake-plane``: fake control plane + tagged fake data plane;
``fake-nccl``: fake control plane + data plane matched by order alone, like NCCL) plus
``memory``, a stranger's transport (tests/memory_transport.py) registered from outside the
package and written against Transport's public members only. Names with an in-process builder
are built by it (the fakes with seeded random delays, so messages overtake each other); the
others one rank at a time over a TCPStore, as processes would. Codec-level hostile input
(every malformed header shape) is covered in test_transport.py; here each transport shows it
refuses and counts a hostile message on its real delivery path and keeps receiving.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore

import memory_transport
from reference import ATOL, RTOL, sequential_reference
from rrfp.transport import (
    Direction,
    MsgKey,
    PeerLost,
    PlaneTransport,
    TransportClosed,
    encode,
)
from rrfp.transport import registry
from rrfp.transport.base import Transport
from rrfp.transport.planes import ANNOUNCE
from rrfp.transport.registry import LocalContext, ProcessContext
from rrfp.transport.torch_plane import TorchDataPlane

KINDS = [*registry.names(), memory_transport.NAME]
DELAY = (0.0, 0.004)


@pytest.fixture(autouse=True, scope="module")
def stranger_registered():
    """The stranger's transport in the registry while this module's tests run."""
    registry.register(memory_transport.NAME, memory_transport.ENTRY)
    yield
    registry.unregister(memory_transport.NAME)


@contextlib.asynccontextmanager
async def group(kind: str, n: int, seed: int = 0) -> AsyncIterator[list[Any]]:
    """``n`` started transports of ``kind`` on the running loop, built through the registry;
    all aborted on exit."""
    job = f"c-{uuid.uuid4().hex[:8]}"
    stores: list[Any] = []
    if registry.get(kind).local is not None:
        ts: list[Any] = registry.build_local(kind, LocalContext(n, seed=seed, delay=DELAY, job=job)).transports
    else:
        master = TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
        stores = [master] + [TCPStore("127.0.0.1", master.port, n, is_master=False) for _ in range(n - 1)]
        ts = [registry.build_rank(kind, ProcessContext(r, n, job, stores[r])) for r in range(n)]
    assert all(t.job == job for t in ts)
    try:
        await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts)), 30)
        yield ts
    finally:
        for t in ts:
            t.abort()
        del stores


def rejected(t: Any) -> int:
    return t.stats["rejected"] + (t.control.stats["rejected"] if isinstance(t, PlaneTransport) else 0)


def payload(src: int, dst: int, i: int) -> list[torch.Tensor | None]:
    """A mixed tuple whose shapes vary per message and whose values name (src, dst, i)."""
    g = torch.Generator().manual_seed(1000 * src + 100 * dst + i)
    rows = 1 + (7 * i + src) % 5
    x = torch.randn(rows, 3 + i % 4, generator=g).requires_grad_(i % 2 == 0)
    ids = torch.tensor([2**63 - 1, -(2**63), src, dst, i, -1][: 3 + i % 4], dtype=torch.int64)
    mask = torch.rand(rows * 3, generator=g) < 0.5
    half = torch.randn(rows, generator=g).to(torch.bfloat16)
    scalar = torch.tensor(float(i), dtype=torch.float64)
    empty = torch.empty(0, rows, dtype=torch.float32)
    return [x, None, ids, mask, half, scalar, empty]


def assert_bit_exact(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert got.requires_grad == want.requires_grad
    assert torch.equal(got.detach().contiguous().view(-1).view(torch.uint8),
                       want.detach().contiguous().view(-1).view(torch.uint8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
async def test_all_to_all_variable_shapes_mixed_dtypes_bit_exact_any_order(kind: str) -> None:
    n, per = 3, 6
    async with group(kind, n, seed=3) as ts:
        job = ts[0].job
        sent: dict[tuple[int, int, int], tuple[list, dict]] = {}
        for i in range(per):
            for s in range(n):
                for d in range(n):  # loopback included
                    direction = Direction.ACT if (i + s) % 2 else Direction.GRAD
                    key = MsgKey(job, 0, i, d, direction)
                    tensors, meta = payload(s, d, i), {"s": s, "i": i}
                    sent[(s, d, i)] = (tensors, meta)
                    ts[s].send(d, key, tensors, meta)
        await asyncio.gather(*(t.flush() for t in ts))
        seen = set()
        for d in range(n):
            for _ in range(n * per):
                m = await asyncio.wait_for(ts[d].recv(), 20)
                k = (m.src, d, m.key.microbatch)
                assert k not in seen and m.key.stage == d
                seen.add(k)
                tensors, meta = sent[k]
                assert m.meta == meta
                assert len(m.tensors) == len(tensors)
                for g, w in zip(m.tensors, tensors):
                    assert_bit_exact(g, w)
                    if g is not None and w is not None:
                        assert g.data_ptr() != w.data_ptr() or g.numel() == 0  # fresh, not aliased
        assert seen == set(sent)
        await asyncio.wait_for(asyncio.gather(*(t.close() for t in ts)), 30)
        for t in ts:
            assert not t.lost_peers and rejected(t) == 0
        assert sum(t.stats["messages_received"] for t in ts) == len(sent)
        assert sum(t.stats["messages_sent"] for t in ts) == len(sent)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
async def test_sizes_around_the_zero_copy_threshold_bit_exact(kind: str) -> None:
    """Frames of 64 KiB and more leave the zmq data plane without a copy; 16 MiB crosses
    every plane's buffering."""
    sizes = [1 << 10, 64 << 10, (64 << 10) + 4, 1 << 20, 16 << 20]
    async with group(kind, 3, seed=2) as ts:
        job = ts[0].job
        sent = {}
        for i, n in enumerate(sizes):
            for s in range(3):
                d = (s + 1 + i) % 3  # includes loopback when i % 3 == 2
                g = torch.Generator().manual_seed(i * 3 + s)
                x = torch.randn(n // 4, generator=g)
                ids = torch.randint(-(2**62), 2**62, (7,), generator=g)
                sent[(s, i)] = (d, x, ids)
                ts[s].send(d, MsgKey(job, 0, i, d, Direction.ACT), [x, None, ids], {"n": n})
        await asyncio.gather(*(t.flush() for t in ts))
        for d in range(3):
            for _ in range(sum(1 for v in sent.values() if v[0] == d)):
                m = await asyncio.wait_for(ts[d].recv(), 20)
                dd, x, ids = sent[(m.src, m.key.microbatch)]
                assert dd == d and m.key.stage == d and m.meta == {"n": sizes[m.key.microbatch]}
                for got, want in zip(m.tensors, [x, None, ids]):
                    assert_bit_exact(got, want)
        await asyncio.wait_for(asyncio.gather(*(t.close() for t in ts)), 30)
        for t in ts:
            assert not t.lost_peers and rejected(t) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
async def test_lost_peer_is_reported_by_rank(kind: str) -> None:
    async with group(kind, 3) as ts:
        job = ts[0].job
        # Data in flight toward the victim and from it when it goes.
        ts[0].send(2, MsgKey(job, 0, 0, 2, Direction.ACT), payload(0, 2, 0))
        ts[2].send(1, MsgKey(job, 0, 0, 1, Direction.GRAD), payload(2, 1, 0))
        await asyncio.wait_for(ts[1].recv(), 20)
        ts[2].abort()
        for r in (0, 1):
            with pytest.raises(PeerLost) as ei:
                while True:  # anything still queued may come first
                    await asyncio.wait_for(ts[r].recv(), 20)
            assert ei.value.rank == 2 and "rank 2 lost" in str(ei.value)
            assert 2 in ts[r].lost_peers
            with pytest.raises(PeerLost):  # sticky: every later recv says so at once
                await asyncio.wait_for(ts[r].recv(), 20)
            with pytest.raises(PeerLost):
                await asyncio.wait_for(ts[r].flush(), 20)
        with pytest.raises(TransportClosed):
            await ts[2].recv()
        # The survivors still say goodbye to each other; close reports the loss.
        results = await asyncio.wait_for(
            asyncio.gather(*(t.close(timeout=10) for t in ts[:2]), return_exceptions=True), 20)
        assert all(isinstance(r, PeerLost) and r.rank == 2 for r in results), results
        assert set(ts[0].lost_peers) == {2} and set(ts[1].lost_peers) == {2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
async def test_close_with_messages_in_flight(kind: str) -> None:
    n = 3
    async with group(kind, n, seed=5) as ts:
        job = ts[0].job
        for i in range(8):
            for s in range(n):
                d = (s + 1) % n
                ts[s].send(d, MsgKey(job, 0, i, d, Direction.ACT), payload(s, d, i))
                ts[d].send(s, MsgKey(job, 0, i, s, Direction.GRAD), payload(d, s, i))
        # Nobody receives: close must still end cleanly on every rank, then recv says closed.
        await asyncio.wait_for(asyncio.gather(*(t.close() for t in ts)), 30)
        for t in ts:
            t.abort()  # after the goodbyes, a disconnect is not an error
        for t in ts:
            assert not t.lost_peers
            with pytest.raises(TransportClosed):
                await t.recv()
            with pytest.raises(TransportClosed):
                t.send((t.rank + 1) % n, MsgKey(job, 1, 0, 0, Direction.ACT), payload(0, 0, 0))


def _hostile(t: Any, job: str) -> list[list[bytes]]:
    """Messages a broken or hostile peer could put on ``t``'s control connection."""
    key = MsgKey(job, 0, 0, t.rank, Direction.ACT)
    huge = {"job": job, "step": 0, "microbatch": 0, "stage": t.rank, "direction": 0,
            "tensors": [["float32", [1 << 20, 1 << 20], False]], "meta": {}}
    import msgpack

    foreign = encode(MsgKey(f"other-{job}", 0, 0, t.rank, Direction.ACT), [torch.ones(2)])
    out = [[msgpack.packb(huge)], [b"\x93not a header"], [b"\xc1"], foreign, [foreign[0], b"\x00"]]
    if isinstance(t, PlaneTransport):
        for ann in (
            {"seq": 0, "tensors": [["float32", [1 << 30, 1 << 30], False]]},  # over the payload cap
            {"seq": 0, "tensors": [["float128", [4], False]]},  # unknown dtype
            {"seq": 0, "tensors": [["int64", [4], True]]},  # grad on an integer
            {"seq": 0, "tensors": [["float32", [-4], False]]},  # negative dim
            {"seq": 1 << 40, "tensors": []},  # far ahead: would pin memory
            {"seq": "0", "tensors": []},
            {"tensors": []},
        ):
            out.append(encode(key, [], {ANNOUNCE: ann}))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
async def test_hostile_input_refused_counted_and_receiving_continues(kind: str) -> None:
    async with group(kind, 2) as ts:
        job = ts[0].job
        victim = ts[1]
        inner = victim.control if isinstance(victim, PlaneTransport) else victim
        bad = _hostile(victim, job)
        for frames in bad:
            inner.deliver_frames(0, frames)  # the delivery path every arrival takes
        assert rejected(victim) == len(bad)
        assert victim.stats["messages_received"] == 0
        want = payload(0, 1, 1)
        ts[0].send(1, MsgKey(job, 0, 1, 1, Direction.ACT), want)
        m = await asyncio.wait_for(victim.recv(), 20)
        for g, w in zip(m.tensors, want):
            assert_bit_exact(g, w)


@pytest.mark.timeout(30)
async def test_replayed_announcement_is_refused() -> None:
    async with group("fake-nccl", 2) as ts:
        job = ts[0].job
        key = MsgKey(job, 0, 0, 1, Direction.ACT)
        ts[0].send(1, key, [torch.ones(3)])
        m = await asyncio.wait_for(ts[1].recv(), 10)
        assert m.tensors[0].tolist() == [1.0, 1.0, 1.0]
        ts[1].control.deliver_frames(0, encode(key, [], {ANNOUNCE: {"seq": 0, "tensors": [["float32", [3], False]]}}))
        assert rejected(ts[1]) == 1


@pytest.mark.timeout(30)
async def test_plane_send_handle_keeps_bytes_until_done_and_reserved_meta() -> None:
    async with group("fake-nccl", 2) as ts:
        job = ts[0].job
        h = ts[0].send(1, MsgKey(job, 0, 0, 1, Direction.ACT), [torch.arange(5.0)])
        assert not h.done()  # the receive is posted only when the announcement lands
        await asyncio.wait_for(h.wait(), 10)
        assert h.done() and h.error is None
        with pytest.raises(ValueError, match="reserved"):
            ts[0].send(1, MsgKey(job, 0, 1, 1, Direction.ACT), [torch.ones(1)], {ANNOUNCE: 1})


class _Work:
    """A stand-in for an NCCL work: done when the test says so (NCCL itself needs 2 GPUs)."""

    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.finished

    def exception(self) -> BaseException | None:
        return self.error


class _Group:
    def __init__(self) -> None:
        self.works: list[_Work] = []

    def send(self, bufs, peer, tag):
        self.works.append(_Work())
        return self.works[-1]

    recv = send


@pytest.mark.timeout(30)
async def test_polled_completion_reports_each_work_once_in_any_order() -> None:
    groups = [_Group() for _ in range(4)]
    plane = TorchDataPlane(0, groups, "cpu", poll=True)
    await plane.start()
    seen: list[tuple[int, Any]] = []
    all_done = asyncio.get_running_loop().create_future()

    def cb(i: int):
        def done(exc):
            seen.append((i, exc))
            if len(seen) == 3:
                all_done.set_result(None)
        return done

    buf = torch.zeros(4, dtype=torch.uint8)
    plane.isend(1, 0, (0, 0), buf, cb(0))
    plane.irecv(1, 1, (0, 0), buf, cb(1))
    plane.isend(1, 3, (0, 0), buf, cb(2))
    w0, w1, w2 = groups[0].works[0], groups[1].works[0], groups[3].works[0]
    for _ in range(3):
        await asyncio.sleep(0)  # let the poller run: nothing is complete, nothing reported
    assert seen == []
    w2.finished = True
    w1.error = RuntimeError("peer gone")
    w1.finished = True
    while len(seen) < 2:
        await asyncio.sleep(0)
    w0.finished = True
    await asyncio.wait_for(all_done, 10)
    assert [i for i, _ in seen[:2]] in ([1, 2], [2, 1]) and seen[2][0] == 0
    assert dict(seen)[1] is w1.error and dict(seen)[0] is None and dict(seen)[2] is None
    plane.close()


def test_unknown_transport_is_one_line_naming_the_choices(capsys, monkeypatch) -> None:
    from rrfp.cli import main
    from rrfp.parallel.bootstrap import default_transport

    with pytest.raises(ValueError, match="^unknown transport 'nccl': expected one of zmq, torch$"):
        default_transport(0, 2, "j", "nccl")
    with pytest.raises(ValueError, match="^transport 'torch' does not run within one process: expected one of "
                                         "fake, fake-plane, fake-nccl, memory$"):
        registry.build_local("torch", LocalContext(2))
    with pytest.raises(ValueError, match="^transport 'memory' does not run between processes: expected one of "
                                         "zmq, torch$"):
        default_transport(0, 2, "j", "memory")

    def no_launch(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr("rrfp.train.cli.launch", no_launch)
    with pytest.raises(SystemExit) as ei:
        main(["train", "--transport", "nccl"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--transport: invalid choice: 'nccl'" in err[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(60)
async def test_device_tensors_stay_on_the_device_end_to_end() -> None:
    built = registry.build_local("fake-nccl", LocalContext(2, seed=1, delay=DELAY, job="cuda", device="cuda"))
    ts, wire = built.transports, built.wire
    await asyncio.gather(*(t.start() for t in ts))
    try:
        assert all(t.device_tensors for t in ts)
        want = [w.cuda() if w is not None else None for w in payload(0, 1, 3)]
        ts[0].send(1, MsgKey("cuda", 0, 3, 1, Direction.ACT), want)
        m = await asyncio.wait_for(ts[1].recv(), 20)
        for g, w in zip(m.tensors, want):
            assert_bit_exact(g, w)  # same device included
        assert wire.mismatches == 0
    finally:
        for t in ts:
            t.abort()


def test_the_strangers_transport_uses_only_public_members_of_transport() -> None:
    """Every underscore attribute tests/memory_transport.py touches is one it defines itself:
    nothing of Transport's private state (the suite above then shows that is enough)."""
    tree = ast.parse(Path(memory_transport.__file__).read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")}
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    assert used <= own, used - own
    private = {name for name in vars(Transport) if name.startswith("_") and not name.startswith("__")}
    probe = memory_transport.MemoryTransport(memory_transport.MemoryHub(1, None), 0)
    private |= {name for name in vars(probe) if name.startswith("_")}
    assert private and not (used & private), used & private  # the check can fail: Transport has private state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["memory", "fake-plane"])
def test_a_local_pipeline_step_over_a_registered_transport_equals_the_reference(kind: str) -> None:
    """LocalPipeline(transport=NAME) builds its ranks' transports through the registry: the
    stranger's runs a 3-rank step whose loss and gradients equal the one-process reference."""
    import rrfp

    torch.manual_seed(7)
    mods = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(3)]
    x, y = torch.randn(12, 5), torch.randn(12, 5)
    _, ref_loss, ref_grads = sequential_reference(mods, x, y)
    with rrfp.LocalPipeline(mods, 4, F.mse_loss, transport=kind, hint="bfw", watchdog=30) as pipe:
        assert all(type(t).__module__ == ("memory_transport" if kind == "memory" else "rrfp.transport.planes")
                   for t in pipe.transports)
        loss = pipe.step(x, target=y)
        assert sum(t.stats["messages_received"] for t in pipe.transports) > 0
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for m, grads in zip(mods, ref_grads):
        for p, g in zip(m.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)
