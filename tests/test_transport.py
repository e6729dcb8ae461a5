"""Tests for rrfp.transport: codec, in-process fake network, ZeroMQ transport."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from handover import process
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore

from rrfp.transport import (
    CodecError,
    Direction,
    FakeNetwork,
    Message,
    MsgKey,
    PeerLost,
    TransportClosed,
    ZmqTransport,
    decode,
    default_host,
    encode,
)
from rrfp.transport.codec import DTYPES, MAX_HEADER_BYTES, MAX_TENSORS, encode_sized, frames_nbytes

KEY = MsgKey("job", 3, 7, 1, Direction.ACT)


def bits(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor, for bit-exact comparison (NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bits(a) == bits(b)


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def roundtrip(tensors: list[Any], meta: dict | None = None, key: MsgKey = KEY):
    frames = encode(key, tensors, meta)
    # Bytes copies: the decoder must not depend on the sender's buffers.
    return decode([bytes(f) for f in frames])


# ---------------------------------------------------------------------------
# codec


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=str)
def test_codec_roundtrip_every_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = make(dtype, shape)
    key, out, meta = roundtrip([x])
    assert key == KEY and meta == {}
    assert_same(out[0], x)
    assert not out[0].requires_grad


def test_codec_non_contiguous_inputs() -> None:
    base = torch.randn(6, 8)
    cases = [
        base.t(),
        base[::2, 1::3],
        torch.randn(1, 5).expand(4, 5),
        torch.randn(2, 3, 4).permute(2, 0, 1),
        torch.randn(3, 3, dtype=torch.complex64).conj(),
        torch.randn(4, 4).to(torch.bfloat16)[:, ::2],
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    ]
    _, out, _ = roundtrip(cases)
    for x, y in zip(cases, out):
        assert y.is_contiguous()
        assert_same(y, x.resolve_conj().contiguous())


def test_codec_mixed_tuple_none_and_requires_grad() -> None:
    h = torch.randn(2, 5, requires_grad=True) * 2  # non-leaf: sent as requires_grad
    ids = torch.tensor([[1, 2**40], [-3, 0]], dtype=torch.int64)
    mask = torch.tensor([True, False, True])
    plain = torch.randn(3)
    _, out, _ = roundtrip([h, None, ids, mask, plain, None])
    assert out[1] is None and out[5] is None
    assert out[0].requires_grad and out[0].is_leaf and out[0].grad_fn is None
    assert not out[2].requires_grad and not out[3].requires_grad and not out[4].requires_grad
    assert_same(out[0], h)
    assert_same(out[2], ids)
    assert_same(out[3], mask)
    assert_same(out[4], plain)
    # A received leaf really takes part in autograd.
    out[0].sum().backward()
    assert torch.equal(out[0].grad, torch.ones(2, 5))


def test_codec_int64_extremes_and_bool_patterns_bit_exact() -> None:
    ints = torch.tensor(
        [-(2**63), 2**63 - 1, 0, -1, 1, 2**53 + 1, -(2**53) - 1], dtype=torch.int64
    )
    bools = torch.tensor([i % 3 == 0 or i % 7 == 1 for i in range(257)])
    floats = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -float("inf")])
    bf = torch.tensor([float("nan"), 1e38, -3.5, 0.0]).to(torch.bfloat16)
    _, out, _ = roundtrip([ints, bools, floats, bf])
    assert out[0].tolist() == ints.tolist()
    assert out[1].tolist() == bools.tolist()
    assert_same(out[2], floats)
    assert_same(out[3], bf)


@pytest.mark.parametrize("n", [1000, 100_000], ids=["small", "large"])
def test_codec_decoded_tensors_are_fresh_and_writable(n: int) -> None:
    x = torch.arange(n, dtype=torch.float32)
    frames = encode(KEY, [x])
    wire = [bytearray(f) for f in frames]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "buffer is not writable"
        _, out, _ = decode(wire)
    wire[1][:] = bytes(len(wire[1]))  # receive buffer reused
    x.zero_()  # sender reuses its tensor
    assert torch.equal(out[0], torch.arange(n, dtype=torch.float32))
    out[0].add_(1)  # writable
    assert out[0][0].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.complex64, torch.int64])
def test_codec_large_tensors_bit_exact(dtype: torch.dtype) -> None:
    x = make(dtype, (3, 40_000))  # above the 64 KiB allocator-copy threshold
    _, out, _ = roundtrip([x, x[1]])
    assert_same(out[0], x)
    assert_same(out[1], x[1])


def test_codec_meta_roundtrip() -> None:
    meta = {"kind": "stats", "t": 1.5, "n": -3, "big": 2**64 - 1, "ok": True,
            "none": None, "ids": [1, 2, [3, "x"]], "nested": {"a": {"b": b"\x00\x01"}}}
    key = MsgKey("other-job", -1, 0, 0, Direction.CTL)
    k, out, m = roundtrip([], meta, key)
    assert k == key and out == [] and m == meta


_SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
_ENTRY = st.one_of(st.none(), st.tuples(st.sampled_from(sorted(DTYPES)), _SHAPES, st.booleans()))


@settings(max_examples=60, deadline=None)
@given(entries=st.lists(_ENTRY, max_size=6), seed=st.integers(0, 2**16))
def test_codec_property_roundtrip(entries: list, seed: int) -> None:
    tensors: list[torch.Tensor | None] = []
    for e in entries:
        if e is None:
            tensors.append(None)
            continue
        name, shape, rg = e
        t = make(DTYPES[name], shape, seed)
        if rg and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        tensors.append(t)
    _, out, _ = roundtrip(tensors)
    assert len(out) == len(tensors)
    for x, y in zip(tensors, out):
        if x is None:
            assert y is None
        else:
            assert_same(y, x)
            assert y.requires_grad == x.requires_grad


def test_codec_encode_rejects_unencodable() -> None:
    with pytest.raises(CodecError, match="unsupported dtype"):
        encode(KEY, [torch.zeros(2, dtype=torch.float8_e4m3fn)])
    with pytest.raises(CodecError, match="meta"):
        encode(KEY, [], {"x": torch.zeros(1)})
    with pytest.raises(CodecError, match="map keys"):
        encode(KEY, [], {"x": {1: 2}})
    with pytest.raises(CodecError, match="too many tensors"):
        encode(KEY, [None] * (MAX_TENSORS + 1))
    with pytest.raises(CodecError, match="ndim"):
        encode(KEY, [torch.zeros([1] * 17)])


@pytest.mark.parametrize(
    "key, tensors, meta",
    [
        (KEY, [torch.zeros(2, 32, 32)], None),
        (MsgKey("j" * 40, 2**40, -(2**63), 2**31, Direction.GRAD), [None, torch.ones(())], None),
        (MsgKey("é" * 256, -33, 256, 65536, Direction.CTL), [], {"k": [1, "x", None]}),
        (KEY, [torch.ones(1, dtype=torch.bool)] * 20, {}),  # array16 of descriptors
        (KEY, [torch.zeros(3, 0, 2, dtype=torch.bfloat16, requires_grad=True)], None),
    ],
    ids=["small", "big-ints", "long-job-meta", "20-tensors", "zero-size"],
)
def test_codec_header_is_plain_msgpack(key: MsgKey, tensors: list, meta: dict | None) -> None:
    """The pre-packed header fragments add up to exactly what msgpack would pack."""
    want = {
        "job": key.job, "step": key.step, "microbatch": key.microbatch, "stage": key.stage,
        "direction": int(key.direction),
        "tensors": [None if t is None else [str(t.dtype).removeprefix("torch."),
                                            list(t.shape), t.requires_grad] for t in tensors],
        "meta": meta or {},
    }
    for _ in range(2):  # cold, then from the fragment caches
        assert encode(key, tensors, meta)[0] == msgpack.packb(want)


@pytest.mark.parametrize(
    "tensors, meta",
    [
        ([torch.randn(3, 4, requires_grad=True)], None),
        ([None, torch.arange(10), torch.randn(6, 4).t()], None),  # a None, a non-contiguous view
        ([torch.randn(2, 2, dtype=torch.bfloat16), torch.zeros(0, 5)], None),  # no numpy dtype, zero-size
        ([torch.randn(2, dtype=torch.complex64).conj()], None),  # a lazy conjugate: copied
        ([], {"kind": "x", "n": [1, 2, 3]}),
    ],
    ids=["act", "none-strided", "bf16-empty", "conj", "control"],
)
def test_codec_encode_sized_counts_the_bytes_frames_nbytes_counts(tensors: list, meta: dict | None) -> None:
    """The in-process transport's statistics: encode_sized's size is frames_nbytes of the same frames."""
    frames, size = encode_sized(KEY, tensors, meta)
    assert size == frames_nbytes(frames) == sum(memoryview(f).nbytes for f in frames)
    assert [bytes(f) for f in frames] == [bytes(f) for f in encode(KEY, tensors, meta)]


def test_fake_transport_counts_what_it_sends_and_receives() -> None:
    tensors = [torch.randn(5, requires_grad=True), None, torch.arange(3)]
    want = sum(memoryview(f).nbytes for f in encode(KEY, tensors))

    async def go():
        net = FakeNetwork(2)
        a, b = net.transport(0), net.transport(1)
        await a.start()
        await b.start()
        a.send(1, KEY, tensors)
        got = await b.recv()
        return a.stats, b.stats, got

    sent, received, msg = asyncio.run(go())
    assert (sent["messages_sent"], sent["bytes_sent"]) == (1, want)
    assert (received["messages_received"], received["bytes_received"]) == (1, want)
    assert msg.src == 0 and msg.key == KEY and msg.meta == {} and msg.tensors[1] is None
    assert_same(msg.tensors[0], tensors[0])
    assert msg.tensors[0].requires_grad and not msg.tensors[2].requires_grad
    assert_same(msg.tensors[2], tensors[2])


def test_codec_encode_rejects_bad_keys_and_meta() -> None:
    with pytest.raises(CodecError, match="direction"):
        encode(MsgKey("job", 0, 0, 0, [1]), [])  # unhashable
    with pytest.raises(CodecError, match="direction"):
        encode(MsgKey("job", 0, 0, 0, 7), [])
    with pytest.raises(CodecError, match="key.step"):
        encode(MsgKey("job", True, 0, 0, Direction.ACT), [])
    with pytest.raises(CodecError, match="key.stage"):
        encode(MsgKey("job", 0, 0, 2**63, Direction.ACT), [])
    with pytest.raises(CodecError, match="key.job"):
        encode(MsgKey("x" * 257, 0, 0, 0, Direction.ACT), [])
    with pytest.raises(CodecError, match="expected MsgKey"):
        encode(("job", 0, 0, 0, 0), [])
    with pytest.raises(CodecError, match="expected a dict"):
        encode(KEY, [], [1, 2])  # the decoder would reject a non-map meta


def test_codec_decodes_zmq_frames_into_fresh_tensors() -> None:
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    big = torch.arange(20_000, dtype=torch.int64)  # above the allocator-copy threshold
    frames = [zmq.Frame(bytes(f)) for f in encode(KEY, [x, None, big])]
    _, out, _ = decode(frames)
    assert_same(out[0], x)
    assert_same(out[2], big)
    out[0].add_(1)  # writable, and not the frame's memory
    assert decode(frames)[1][0].equal(x)


@pytest.mark.parametrize("n", [7, 5000], ids=["scan", "numpy"])
def test_codec_rejects_bool_bytes_other_than_0_1(n: int) -> None:
    frames = encode(KEY, [torch.zeros(n, dtype=torch.bool)])
    payload = bytearray(frames[1])
    payload[n // 2] = 2
    with pytest.raises(CodecError, match="bool frame"):
        decode([frames[0], payload])


# ---------------------------------------------------------------------------
# codec: malformed input


def _header(**over: Any) -> dict:
    h = {"job": "job", "step": 0, "microbatch": 0, "stage": 0, "direction": 0,
         "tensors": [["float32", [2, 3], False]], "meta": {}}
    h.update(over)
    return h


def _pack(h: Any) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


GOOD_PAYLOAD = bytes(24)


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty message"),
        ([b"\xc1"], "bad msgpack"),
        ([_pack(_header())[:-3], GOOD_PAYLOAD], "bad msgpack"),
        ([_pack(_header()) + b"\x00", GOOD_PAYLOAD], "bad msgpack"),
        ([_pack([1, 2, 3])], "expected a map"),
        ([b"\x91" * 5000 + b"\xc0"], "nesting"),
        ([b"\x80" + b"\x00" * MAX_HEADER_BYTES], "header too big"),
        ([_pack({k: v for k, v in _header().items() if k != "stage"}), GOOD_PAYLOAD],
         "missing field 'stage'"),
        ([_pack(_header(extra=1)), GOOD_PAYLOAD], "unexpected field 'extra'"),
        ([_pack(_header(step="0")), GOOD_PAYLOAD], "header.step"),
        ([_pack(_header(step=True)), GOOD_PAYLOAD], "header.step"),
        ([_pack(_header(direction=9)), GOOD_PAYLOAD], "unknown direction"),
        ([_pack(_header(tensors=[["float99", [2], False]])), bytes(8)], "unknown dtype 'float99'"),
        ([_pack(_header(tensors=[["float32", [1] * 17, False]])), bytes(4)], "ndim 17 > 16"),
        ([_pack(_header(tensors=[["float32", [2, -3], False]]))], "negative dim -3"),
        ([_pack(_header(tensors=[["float32", [2.0], False]])), bytes(8)], "dim must be an int"),
        ([_pack(_header(tensors=[["float32", [2], 1]])), bytes(8)], "requires_grad must be a bool"),
        ([_pack(_header(tensors=[["int64", [2], True]])), bytes(16)], "requires_grad on non-floating"),
        ([_pack(_header(tensors=[None] * (MAX_TENSORS + 1)))], "too many tensors"),
        ([_pack(_header(tensors=[["float32", [2**40, 2**40], False]])), b""], "exceeds limit"),
        ([_pack(_header())], "frame count mismatch"),
        ([_pack(_header()), GOOD_PAYLOAD, b""], "frame count mismatch"),
        ([_pack(_header()), GOOD_PAYLOAD[:-1]], "frame has 23 bytes, expected 24"),
        ([_pack(_header()), GOOD_PAYLOAD + b"\x00"], "frame has 25 bytes, expected 24"),
        ([_pack(_header(tensors=[["bool", [3], False]])), b"\x00\x02\x01"], "bool frame"),
        ([_pack(_header(meta={"x": msgpack.ExtType(5, b"abc")}))], "ext type"),
        ([_pack(_header(meta={"x": msgpack.Timestamp(1, 0)}))], "ext type"),
        ([_pack(_header(meta=[1]))], "header.meta"),
        ([_pack(_header(meta={"a": [[[[[[[[[[1]]]]]]]]]]}))], "nesting deeper"),
        ([_pack({1: 2})], "bad msgpack"),  # strict_map_key
        ([_pack(_header(job="x" * 300))], "header.job"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_codec_rejects_malformed(frames: list[bytes], match: str) -> None:
    with pytest.raises(CodecError, match=match) as ei:
        decode(frames)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "shape", [[2, 2**62, 2**62, 0], [0, 2**62, 2], [0, 2**63 - 1, 2**63 - 1]], ids=str
)
def test_codec_rejects_zero_size_shapes_torch_cannot_allocate(shape: list[int]) -> None:
    # Zero bytes pass the payload limit, but torch refuses sizes whose strides overflow.
    with pytest.raises(CodecError, match="shape"):
        decode([_pack(_header(tensors=[["float32", shape, False]])), b""])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_codec_zero_size_and_one_element_strided_views_roundtrip(dtype: torch.dtype) -> None:
    # Views that count as contiguous yet keep a last stride other than 1: a slice of an
    # empty tensor, or one element of a column (x[0:1, 0]). bfloat16 and lazy conj/neg
    # views cannot go through numpy and take the byte-view path.
    views = [make(dtype, (0,))[::2], make(dtype, (0, 3))[:, ::2], make(dtype, (3, 0)).t(),
             make(dtype, (3, 4))[0:1, 0], make(dtype, (3, 4))[0:1, 1:2].reshape(1, 1)]
    if dtype.is_complex:
        views += [make(dtype, (3, 4))[0:1, 0].conj(), torch._neg_view(make(dtype, (3, 4))[0:1, 0])]
    for x in views:
        assert x.is_contiguous()
        _, out, _ = roundtrip([x])
        assert_same(out[0], x.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format))


@pytest.mark.parametrize("n", [8, 2000, 100_000], ids=["small", "bool-scan", "alloc-copy"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool], ids=str)
def test_codec_strided_frame_buffer_is_a_codec_error(n: int, dtype: torch.dtype) -> None:
    # A 1-d uint8 memoryview with a step is not a contiguous buffer.
    frames = encode(KEY, [torch.ones(n, dtype=dtype)])
    wide = bytearray(2 * n)
    wide[::2] = bytes(frames[1])
    with pytest.raises(CodecError, match="not contiguous"):
        decode([frames[0], memoryview(wide)[::2]])
    head = bytearray(2 * len(frames[0]))
    head[::2] = frames[0]
    with pytest.raises(CodecError, match="not contiguous"):
        decode([memoryview(head)[::2], frames[1]])


def test_codec_max_bytes_is_configurable() -> None:
    frames = encode(KEY, [torch.zeros(100), torch.zeros(100)])
    decode(frames, max_bytes=800)
    with pytest.raises(CodecError, match="exceeds limit"):
        decode(frames, max_bytes=799)


# ---------------------------------------------------------------------------
# fake network


def k(i: int, stage: int = 1) -> MsgKey:
    return MsgKey("job", 0, i, stage, Direction.ACT)


async def _arrival_order(seed: int, n: int = 40) -> list[int]:
    net = FakeNetwork(2, seed=seed, delay=(0.0, 0.02))
    a, b = net.transport(0), net.transport(1)
    await a.start()
    await b.start()
    for i in range(n):
        a.send(1, k(i), [torch.tensor([i])])
    order = []
    for _ in range(n):
        m = await asyncio.wait_for(b.recv(), 5)
        assert m.src == 0 and m.key.microbatch == m.tensors[0].item()
        order.append(m.key.microbatch)
    return order


@pytest.mark.virtual_time  # the 5 s bounds expire only if nothing is left to deliver
async def test_fake_reorders_and_delivers_exactly_once() -> None:
    order = await _arrival_order(seed=1)
    assert sorted(order) == list(range(40))  # every message, exactly once
    assert order != sorted(order)  # some message overtook an earlier one


@pytest.mark.virtual_time  # the 5 s bounds expire only if nothing is left to deliver
async def test_fake_is_deterministic_per_seed() -> None:
    first = await _arrival_order(seed=7)
    assert await _arrival_order(seed=7) == first
    assert await _arrival_order(seed=8) != first


@pytest.mark.virtual_time  # the 5 s bounds expire only if nothing is left to deliver
async def test_fake_callable_delay_and_no_encode() -> None:
    calls = []

    def delay(src: int, dst: int, key: MsgKey | None, rng) -> float:
        calls.append((src, dst, key))
        # Later microbatches arrive first.
        return 0.0 if key is None else 0.01 * (5 - key.microbatch)

    net = FakeNetwork(2, delay=delay, encode=False)
    a, b = net.transport(0), net.transport(1)
    await a.start()
    await b.start()
    x = torch.ones(2)
    for i in range(5):
        a.send(1, k(i), [x])
    order = [(await b.recv()).key.microbatch for _ in range(5)]
    assert order == [4, 3, 2, 1, 0]
    assert [c[2].microbatch for c in calls] == [0, 1, 2, 3, 4]


@pytest.mark.virtual_time  # the 5 s bounds expire only if nothing is left to deliver
async def test_fake_close_times_out_naming_silent_rank() -> None:
    net = FakeNetwork(2)
    a, b = net.transport(0), net.transport(1)
    await a.start()
    await b.start()
    with pytest.raises(TimeoutError, match=r"no BYE from ranks \[1\]"):
        await a.close(timeout=0.05)


@pytest.mark.virtual_time  # the 5 s bounds expire only if nothing is left to deliver
async def test_recv_cancel_does_not_lose_message() -> None:
    net = FakeNetwork(2)
    b = net.transport(1)
    await b.start()
    waiter = asyncio.create_task(b.recv())
    await asyncio.sleep(0)  # one loop step: the waiter now waits inside recv()
    b.deliver_frames(0, encode(k(1), []))  # hands the message to the waiter...
    waiter.cancel()  # ...which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    m = await asyncio.wait_for(b.recv(), 5)
    assert m.key == k(1) and m.src == 0


# ---------------------------------------------------------------------------
# zmq, several ranks in this process


@pytest.mark.parametrize("addr", [None, "", "localhost", "127.0.0.1", "127.0.1.1", "::1"])
def test_default_host_is_loopback_for_local_master(monkeypatch, addr: str | None) -> None:
    if addr is None:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    else:
        monkeypatch.setenv("MASTER_ADDR", addr)
    assert default_host() == "127.0.0.1"



def _job() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def zmq_group(world_size: int, **kw: Any) -> AsyncIterator[list[ZmqTransport]]:
    master = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    stores = [master] + [
        TCPStore("127.0.0.1", master.port, world_size, is_master=False)
        for _ in range(world_size - 1)
    ]
    job = _job()
    ts = [ZmqTransport(r, world_size, stores[r], job, **kw) for r in range(world_size)]
    try:
        await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts)), 20)
        yield ts
    finally:
        for t in ts:
            t.abort()
        del stores


@pytest.mark.timeout(30)
async def test_zmq_many_messages_all_delivered_fifo_per_sender() -> None:
    n = 1500
    async with zmq_group(3) as ts:
        job = ts[0].job
        for i in range(n):
            for s in (1, 2):
                ts[s].send(0, MsgKey(job, i // 8, i % 8, 0, Direction.GRAD),
                           [torch.tensor([s, i])])
        seen: dict[int, list[int]] = {1: [], 2: []}
        for _ in range(2 * n):
            m = await asyncio.wait_for(ts[0].recv(), 10)
            s, i = m.tensors[0].tolist()
            assert s == m.src
            seen[s].append(i)
        assert seen[1] == list(range(n)) and seen[2] == list(range(n))
        await asyncio.wait_for(asyncio.gather(*(t.close() for t in ts)), 20)
        assert all(not t.lost_peers for t in ts)


@pytest.mark.timeout(30)
async def test_zmq_start_times_out_naming_missing_rank() -> None:
    store = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    t = ZmqTransport(0, 3, store, _job(), connect_timeout=0.2)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not publish"):
        await t.start()
    assert t.closed
    with pytest.raises(TransportClosed):
        await t.recv()


@pytest.mark.timeout(30)
async def test_zmq_abort_during_start() -> None:
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    t = ZmqTransport(0, 2, store, _job())
    starting = asyncio.create_task(t.start())
    await asyncio.sleep(0)  # start() is now waiting for rank 1's endpoint
    t.abort()
    with pytest.raises(TransportClosed):
        await asyncio.wait_for(starting, 10)


@pytest.mark.timeout(30)
async def test_zmq_close_times_out_when_peer_stays() -> None:
    async with zmq_group(2) as ts:
        with pytest.raises(TimeoutError, match=r"no BYE from ranks \[1\]"):
            await ts[0].close(timeout=0.2)
        assert ts[0].closed


@pytest.mark.timeout(30)
async def test_zmq_rejects_malformed_from_impostor_and_keeps_receiving() -> None:
    """Rank 2 is a hand-made peer speaking raw ZeroMQ; ranks 0 and 1 are real."""
    master = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    s1 = TCPStore("127.0.0.1", master.port, 3, is_master=False)
    job = _job()
    ctx = zmq.Context()
    fake_router = ctx.socket(zmq.ROUTER)
    fake_router.setsockopt(zmq.LINGER, 0)
    fake_router.bind("tcp://127.0.0.1:0")
    master.set(f"rrfp/{job}/zmq/2", fake_router.getsockopt(zmq.LAST_ENDPOINT))
    ts = [ZmqTransport(r, 3, st, job) for r, st in ((0, master), (1, s1))]
    dealer = ctx.socket(zmq.DEALER)
    try:
        await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts)), 20)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, b"2")
        dealer.connect(ts[0].endpoint)
        bad = [
            [b"\xc1"],
            [_pack(_header()), b"\x00"],
            encode(MsgKey("other-job", 0, 0, 0, Direction.ACT), [torch.ones(2)]),
        ]
        for frames in bad:
            dealer.send_multipart(frames)
        dealer.send_multipart(encode(MsgKey(job, 0, 5, 0, Direction.ACT), [torch.ones(2)]))
        m = await asyncio.wait_for(ts[0].recv(), 10)
        assert m.src == 2 and m.key.microbatch == 5
        assert ts[0].stats["rejected"] == 3
        # Real traffic still flows.
        ts[1].send(0, MsgKey(job, 0, 6, 0, Direction.ACT), [torch.zeros(1)])
        m = await asyncio.wait_for(ts[0].recv(), 10)
        assert m.src == 1 and m.key.microbatch == 6
    finally:
        for t in ts:
            t.abort()
        dealer.close(0)
        fake_router.close(0)
        ctx.term()


@pytest.mark.timeout(30)
async def test_zmq_rejects_unknown_routing_ids(caplog) -> None:
    """Only a rank's canonical spelling passes as its routing id."""
    async with zmq_group(2) as ts:
        t = ts[0]
        rejected = asyncio.Event()
        reject = t._receiver._reject  # the receiver's refusal callback

        def counting(src: Any, why: str) -> None:
            reject(src, why)
            if t.stats["rejected"] == 3:
                rejected.set()

        t._receiver._reject = counting
        ctx = zmq.Context()
        dealers = []
        try:
            for ident in (b"01", b"2", b"1x"):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.ROUTING_ID, ident)
                d.connect(t.endpoint)
                d.send_multipart(encode(MsgKey(t.job, 0, 0, 0, Direction.ACT), [torch.ones(1)]))
                dealers.append(d)
            await asyncio.wait_for(rejected.wait(), 10)
        finally:
            for d in dealers:
                d.close(0)
            ctx.term()
        assert caplog.text.count("unknown routing id") == 3
        assert t.stats["messages_received"] == 0


@pytest.mark.timeout(30)
async def test_zmq_abort_inside_delivery_stops_receiving_quietly(caplog) -> None:
    async with zmq_group(2) as ts:
        job = ts[0].job
        got: list[int] = []
        failed = asyncio.Event()

        def handler(m: Message) -> None:
            got.append(m.key.microbatch)
            ts[1].abort()  # from inside the transport's own receive callback

        ts[1].set_handler(handler, lambda _e: failed.set())
        for i in range(50):
            ts[0].send(1, MsgKey(job, 0, i, 1, Direction.ACT), [torch.ones(1)])
        await asyncio.wait_for(failed.wait(), 10)
        assert got == [0]
        assert ts[1].closed and "receiver failed" not in caplog.text
        with pytest.raises(TransportClosed):
            await ts[1].recv()


@pytest.mark.timeout(30)
async def test_zmq_receiver_failure_is_reported_not_swallowed() -> None:
    async with zmq_group(2) as ts:
        def broken(src: int, frames: Any) -> None:
            raise RuntimeError("boom")

        ts[1]._receiver._deliver = broken  # the receiver's delivery callback
        ts[0].send(1, MsgKey(ts[0].job, 0, 0, 1, Direction.ACT), [torch.ones(1)])
        with pytest.raises(TransportClosed, match="receiver failed.*boom"):
            await asyncio.wait_for(ts[1].recv(), 10)


@pytest.mark.timeout(30)
def test_zmq_close_and_abort_stop_watching_the_router() -> None:
    """On asyncio's own loop, whose remove_reader says whether a reader was left
    (uvloop's returns None either way)."""

    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        async with zmq_group(3) as ts:
            fds = [t._receiver.fd for t in ts]
            assert all(fd is not None for fd in fds)
            ts[2].abort()
            await asyncio.wait_for(
                asyncio.gather(*(t.close() for t in ts[:2]), return_exceptions=True), 20
            )
        return [loop.remove_reader(fd) for fd in fds]

    assert asyncio.run(main()) == [False, False, False]


@pytest.mark.timeout(30)
async def test_zmq_send_rejects_foreign_job_and_bad_dst() -> None:
    async with zmq_group(2) as ts:
        with pytest.raises(ValueError, match="job"):
            ts[0].send(1, MsgKey("nope", 0, 0, 1, Direction.ACT), [])
        with pytest.raises(ValueError, match="dst"):
            ts[0].send(2, MsgKey(ts[0].job, 0, 0, 1, Direction.ACT), [])


class FreezableProxy:
    """TCP relay between a DEALER and a ROUTER; freeze() makes the far side look
    like a hung host: connections stay open but no byte moves, heartbeats included."""

    def __init__(self, resolve_target) -> None:
        self._resolve = resolve_target
        self._moving = asyncio.Event()
        self._moving.set()
        self._tasks: list[asyncio.Task] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def freeze(self) -> None:
        self._moving.clear()

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        host, port = self._resolve()
        ur, uw = await asyncio.open_connection(host, port)
        self._writers += [w, uw]
        self._tasks += [asyncio.create_task(self._pipe(r, uw)),
                        asyncio.create_task(self._pipe(ur, w))]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await self._moving.wait()
            data = await r.read(1 << 16)
            if not data:
                break
            await self._moving.wait()
            w.write(data)
            await w.drain()
        w.close()

    async def close(self) -> None:
        self._server.close()
        for t in self._tasks:
            t.cancel()
        for w in self._writers:
            w.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class RedirectStore:
    """Store wrapper that hands out another endpoint for one key."""

    def __init__(self, store: TCPStore, key: str, endpoint: str) -> None:
        self._store, self._key, self._endpoint = store, key, endpoint

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def get(self, key: str) -> bytes:
        return self._endpoint.encode() if key == self._key else self._store.get(key)


@pytest.mark.timeout(30)
async def test_zmq_hung_peer_detected_by_heartbeat() -> None:
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, 2, is_master=False)
    job = _job()
    key1 = f"rrfp/{job}/zmq/1"

    def target() -> tuple[str, int]:
        host, port = bytes(master.get(key1)).decode().removeprefix("tcp://").rsplit(":", 1)
        return host, int(port)

    proxy = FreezableProxy(target)
    via_proxy = await proxy.start()
    hb = {"heartbeat_ivl": 0.1, "heartbeat_timeout": 0.5}
    ts = [ZmqTransport(0, 2, RedirectStore(master, key1, via_proxy), job, **hb),
          ZmqTransport(1, 2, client, job, **hb)]
    try:
        await asyncio.wait_for(asyncio.gather(*(t.start() for t in ts)), 20)
        ts[0].send(1, MsgKey(job, 0, 0, 1, Direction.ACT), [torch.ones(3)])
        m = await asyncio.wait_for(ts[1].recv(), 10)  # the relay works
        assert m.src == 0
        proxy.freeze()  # rank 1 now looks hung to rank 0
        # Nothing closes a socket here: only the unanswered heartbeats can end this wait.
        with pytest.raises(PeerLost, match="rank 1 lost") as ei:
            await asyncio.wait_for(ts[0].recv(), 10)
        assert ei.value.rank == 1
    finally:
        for t in ts:
            t.abort()
        await proxy.close()


# ---------------------------------------------------------------------------
# zmq, a real child process that dies


def _child_main(port: int, job: str) -> None:
    import uvloop

    async def main() -> None:
        store = TCPStore("127.0.0.1", port, 2, is_master=False)
        t = ZmqTransport(1, 2, store, job)
        await t.start()
        t.send(0, MsgKey(job, 0, 0, 0, Direction.CTL), [torch.arange(3)], {"pid": os.getpid()})
        await t.flush()
        await asyncio.Event().wait()  # until the parent kills us

    uvloop.run(main())


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_zmq_child_sigkill_raises_peer_lost() -> None:
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    job = _job()
    proc = process(_child_main, master.port, job, daemon=True)  # a fork of the zygote (tests/handover.py)
    proc.start()
    # Heartbeats that would take an hour to give up: the kernel closing the dead process's
    # sockets must be what reveals the death (the 60 s below only bound a hang).
    t = ZmqTransport(0, 2, master, job, heartbeat_timeout=3600.0)
    try:
        await asyncio.wait_for(t.start(), 45)  # the zygote imports torch first
        hello = await asyncio.wait_for(t.recv(), 10)
        assert hello.src == 1 and hello.meta == {"pid": proc.pid}
        assert torch.equal(hello.tensors[0], torch.arange(3))
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(PeerLost, match="rank 1 lost") as ei:
            await asyncio.wait_for(t.recv(), 60)
        assert ei.value.rank == 1
    finally:
        t.abort()
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


async def test_set_handler_reports_the_first_terminal_error_once():
    """With a handler, arrivals go to it in order, and on_error hears the first terminal error
    once, not again when close() replaces it with TransportClosed."""
    from rrfp.transport.base import PeerLost
    from rrfp.transport.fake import FakeNetwork
    from rrfp.transport.keys import Direction, MsgKey

    net = FakeNetwork(3, encode=True)
    a, b, c = net.transport(0), net.transport(1), net.transport(2)
    for t in (a, b, c):
        await t.start()
    got, errors = [], []
    b.set_handler(lambda m: got.append(m.key.microbatch), errors.append)
    for m in range(3):
        a.send(1, MsgKey("j", 0, m, 1, Direction.ACT), [torch.full((2,), float(m))])
    await b.flush()
    while len(got) < 3:
        await asyncio.sleep(0)
    assert got == [0, 1, 2]
    net.kill(2)
    assert len(errors) == 1 and isinstance(errors[0], PeerLost) and errors[0].rank == 2
    b.abort()
    assert len(errors) == 1


def test_encode_refuses_a_meta_tensor_with_a_codec_error():
    from rrfp.transport.codec import CodecError, encode
    from rrfp.transport.keys import Direction, MsgKey

    with pytest.raises(CodecError, match=r"meta device .*shape \(2, 3\)"):
        encode(MsgKey("j", 0, 0, 1, Direction.ACT), [torch.empty(2, 3, device="meta")])
