"""The codec's known-header path (issue 33, the per-task cost) decodes what the full parse does.

``decode`` reads a data header whose prefix (job, step) and tail (microbatch ... an empty meta)
were, byte for byte, parts of headers the full parse (``parse_header``) accepted before,
without parsing it again. Here: every message decodes to the key, tensors and meta it was
encoded from, the second time without ``parse_header``; every one-byte change and every cut of
a known header decodes, or fails with the same error, exactly as it does with nothing known;
a caller's lower payload limit still refuses a known header; control messages (a meta) are
always parsed in full.
"""

from __future__ import annotations

import pytest
import torch
import zmq

from rrfp.transport import codec
from rrfp.transport.codec import CodecError, decode, encode, wire_bytes
from rrfp.transport.keys import Direction, MsgKey

ACT, GRAD = Direction.ACT, Direction.GRAD


@pytest.fixture(autouse=True)
def nothing_known():
    codec._known_prefix.clear()
    codec._known_tail.clear()
    yield
    codec._known_prefix.clear()
    codec._known_tail.clear()


def _outcome(frames, **kw):
    """What decode makes of ``frames``: the key, each tensor's dtype, shape, flag and bytes,
    and the meta; or the error's line."""
    try:
        key, tensors, meta = decode(frames, **kw)
    except CodecError as e:
        return ("error", str(e))
    return ("ok", key, [None if t is None else (t.dtype, tuple(t.shape), t.requires_grad,
                                                bytes(wire_bytes(t).numpy())) for t in tensors], meta)


def _count_full_parses(monkeypatch) -> list:
    calls = []
    full = codec.parse_header
    monkeypatch.setattr(codec, "parse_header", lambda *a: (calls.append(1), full(*a))[1])
    return calls


TENSORS = {
    "act": lambda: [torch.randn(2, 3).requires_grad_()],
    "grad-none": lambda: [None, torch.arange(4)],
    "bool": lambda: [torch.tensor([True, False, True])],
    "bf16": lambda: [torch.randn(2, 2, dtype=torch.bfloat16).requires_grad_()],
    "0-d": lambda: [torch.tensor(2.5, dtype=torch.float64)],
    "zero-size": lambda: [torch.zeros(0, 3)],
    "none": lambda: [],
}


@pytest.mark.parametrize("step, mb", [(0, 0), (5, 63), (127, 128), (300, 70000), (2**33, 1), (-3, -40)])
@pytest.mark.parametrize("which", sorted(TENSORS))
def test_a_known_header_decodes_to_what_was_encoded_without_the_full_parse(monkeypatch, step, mb, which):
    torch.manual_seed(0)
    tensors = TENSORS[which]()
    key = MsgKey("job-7", step, mb, 2, GRAD if which == "grad-none" else ACT)
    want = ("ok", key, [None if t is None else (t.dtype, tuple(t.shape), t.requires_grad, bytes(wire_bytes(t).numpy()))
                        for t in tensors], {})
    parses = _count_full_parses(monkeypatch)
    first = _outcome(encode(key, tensors))
    again = _outcome(encode(key, tensors))
    assert first == want and again == want
    assert len(parses) == 1  # the second header was known
    # Another step (a new prefix) is parsed in full once; its tail is known already.
    other = MsgKey("job-7", step + 1, mb, key.stage, key.direction)
    assert _outcome(encode(other, tensors))[1] == other
    assert _outcome(encode(other, tensors))[1] == other
    assert len(parses) == 2


def test_the_known_path_returns_fresh_tensors_and_meta():
    key, t = MsgKey("j", 1, 2, 3, ACT), torch.ones(2)
    frames = encode(key, [t])
    _, a, meta_a = decode(frames)
    _, b, meta_b = decode(frames)  # known
    assert a[0] is not b[0] and a[0].data_ptr() != b[0].data_ptr() and a[0].data_ptr() != t.data_ptr()
    assert meta_a == meta_b == {} and meta_a is not meta_b


def _known_frames() -> list:
    return encode(MsgKey("j", 300, 7, 2, GRAD), [torch.ones(1, 1).requires_grad_()])


def _as_zmq(frames: list) -> list:
    """``frames`` as a ZeroMQ socket hands them over (``recv_multipart(copy=False)``)."""
    return [zmq.Frame(bytes(f)) for f in frames]


def test_zmq_frames_take_the_known_path_and_teach_it(monkeypatch):
    # Between processes every frame is a zmq.Frame: their headers are known as bytes' are.
    key, t = MsgKey("j", 4, 9, 1, ACT), torch.randn(3).requires_grad_()
    parses = _count_full_parses(monkeypatch)
    want = _outcome(encode(key, [t]))
    assert _outcome(_as_zmq(encode(key, [t]))) == want
    assert len(parses) == 1  # learned from the bytes header, known as a zmq.Frame
    other = MsgKey("j", 5, 9, 1, ACT)
    assert _outcome(_as_zmq(encode(other, [t])))[1] == other
    assert _outcome(_as_zmq(encode(other, [t])))[1] == other
    assert len(parses) == 2  # learned from a zmq.Frame header
    assert _outcome([bytearray(f) for f in encode(other, [t])])[1] == other
    assert len(parses) == 2


@pytest.mark.parametrize("wrap", [list, _as_zmq], ids=["bytes", "zmq.Frame"])
def test_every_change_of_one_byte_of_a_known_header_decodes_as_with_nothing_known(wrap):
    frames = _known_frames()
    head = frames[0]
    checked = 0
    for p in range(len(head)):
        for v in {0x00, 0x01, 0x7F, 0x80, 0xA5, 0xCC, 0xCD, 0xD9, 0xFF, head[p] ^ 0x01}:
            if v == head[p]:
                continue
            variant = wrap([head[:p] + bytes([v]) + head[p + 1:], *frames[1:]])
            codec._known_prefix.clear()
            codec._known_tail.clear()
            want = _outcome(variant)  # the full parse
            codec._known_prefix.clear()
            codec._known_tail.clear()
            decode(frames)  # the original known
            assert _outcome(variant) == want, (p, v)
            checked += 1
    assert checked > 9 * len(head) - len(head)


@pytest.mark.parametrize("wrap", [list, _as_zmq], ids=["bytes", "zmq.Frame"])
def test_every_cut_of_a_known_header_fails_as_with_nothing_known(wrap):
    frames = _known_frames()
    head = frames[0]
    wants = [_outcome(wrap([head[:n], *frames[1:]])) for n in range(len(head))]
    codec._known_prefix.clear()
    codec._known_tail.clear()
    decode(frames)
    assert [_outcome(wrap([head[:n], *frames[1:]])) for n in range(len(head))] == wants
    assert all(w[0] == "error" for w in wants)


def test_a_known_header_over_the_callers_limit_is_refused():
    frames = encode(MsgKey("j", 1, 0, 1, ACT), [torch.ones(4)])  # 16 bytes declared
    decode(frames)
    with pytest.raises(CodecError, match="declared payload exceeds limit: > 15 bytes at tensor 0"):
        decode(frames, max_bytes=15)
    assert _outcome(frames, max_bytes=16)[0] == "ok"


def test_control_messages_are_always_parsed_in_full(monkeypatch):
    parses = _count_full_parses(monkeypatch)
    frames = encode(MsgKey("j", 1, 0, 0, Direction.CTL), [], {"kind": "x", "n": 3})
    for _ in range(3):
        assert decode(frames)[2] == {"kind": "x", "n": 3}
    assert len(parses) == 3 and not codec._known_tail


def test_a_memoryview_frame_of_another_shape_is_read_as_its_bytes():
    # A tensor frame as a 2-D float view (not encode's flat bytes): decoded from its bytes.
    key, t = MsgKey("j", 1, 0, 1, ACT), torch.arange(6, dtype=torch.float32).reshape(2, 3)
    head = encode(key, [t])[0]
    got = decode([head, memoryview(t.numpy())])[1][0]
    assert torch.equal(got, t)


def test_refused_headers_cannot_make_the_cache_hold_gigabytes():
    """A peer that sends header-only messages declaring thousands of empty tensors (each refused:
    no tensor frames) must not be able to make this rank hold gigabytes: what one such message
    leaves in the known-header cache, times the most entries the cache keeps, stays under
    256 MiB (before the cache, such a message left nothing behind)."""
    import gc
    import tracemalloc

    import msgpack

    n = 16
    heads = [msgpack.packb({"job": "j", "step": 1, "microbatch": m, "stage": 0, "direction": int(ACT),
                            "tensors": [["float32", [0], False]] * 2000, "meta": {}}) for m in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for h in heads:
            assert _outcome([h]) == ("error", "frame count mismatch: header declares 2000 tensor frames, got 0")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    at_most = held / n * max(codec._TAILS_MAX, codec._CACHE_MAX)
    assert at_most <= 256 * 2**20, f"{held / n:.0f} bytes held per refused header: {at_most / 2**30:.1f} GiB at the bound"


def test_a_refused_message_teaches_nothing_and_a_long_header_is_never_learned(monkeypatch):
    parses = _count_full_parses(monkeypatch)
    frames = encode(MsgKey("j", 2, 0, 1, ACT), [torch.ones(2)])
    assert _outcome(frames[:1])[0] == "error"  # refused for its frame count: nothing learned
    assert not codec._known_tail and not codec._known_prefix
    many = [torch.zeros(0) for _ in range(40)]  # accepted, its header over _LEARN_MAX bytes
    long_frames = encode(MsgKey("j", 2, 1, 1, ACT), many)
    assert len(long_frames[0]) > codec._LEARN_MAX
    for _ in range(2):
        assert _outcome(long_frames)[1] == MsgKey("j", 2, 1, 1, ACT)
    assert not codec._known_tail and len(parses) == 3
    assert _outcome(frames)[0] == "ok" and _outcome(frames)[0] == "ok"
    assert len(parses) == 4  # the short one is learned once accepted
