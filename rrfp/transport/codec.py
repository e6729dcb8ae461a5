"""Wire format: one msgpack header frame followed by one raw frame per tensor.

Frame 0 is a msgpack map::

    {"job": str, "step": int, "microbatch": int, "stage": int, "direction": int,
     "tensors": [[dtype_name, shape, requires_grad] | None, ...], "meta": {...}}

Frames 1.. hold the C-contiguous bytes of every non-None tensor, in order, in the
sender's native byte order (all supported platforms are little-endian).

Decoding treats its input as untrusted: the declared payload is checked against
fixed limits before any tensor is allocated, and each frame's length against the
header before its tensor is, so no allocation exceeds the bytes actually received;
nothing is ever unpickled. Every problem raises :class:`CodecError` with a
one-line message. The limits, the dtypes and the header's checks are :mod:`.header`'s; this
module assembles and reads the frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch
import zmq
from torch import Tensor

from .header import (
    DEFAULT_MAX_BYTES,
    DTYPES,
    HEADER_KEYS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
    CodecError,
    check_key,
    check_meta,
    descriptor,
    is_int64,
    parse_descriptors,
    parse_header,
    unpack_header,
)
from .keys import Direction, MsgKey

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "CodecError",
    "Frame",
    "decode",
    "descriptor",
    "encode",
    "encode_sized",
    "frames_nbytes",
    "parse_descriptors",
    "wire_bytes",
]

_ALLOC_COPY_MIN = 64 * 1024

Frame = bytes | memoryview
"""An outgoing frame. Decoding accepts anything with the buffer protocol (bytes,
bytearray, memoryview, zmq.Frame)."""


# ---------------------------------------------------------------------------
# encode
#
# The header is assembled from pre-packed byte fragments instead of packing a dict
# per message: the bytes are exactly what ``msgpack.packb(header)`` would produce
# (the tests check this), at a fraction of the cost for small messages.


def _fixstr(s: str) -> bytes:
    b = s.encode()
    return bytes([0xA0 | len(b)]) + b


_H_MAP = bytes([0x80 | len(HEADER_KEYS)])
_H_JOB = _fixstr("job")
_H_STEP = _fixstr("step")
_H_MICROBATCH = _fixstr("microbatch")
_H_STAGE = _fixstr("stage")
_H_DIRECTION = _fixstr("direction")
_H_TENSORS = _fixstr("tensors")
_H_META = _fixstr("meta")
_H_EMPTY_META = _H_META + b"\x80"
_NIL = b"\xc0"
_EMPTY = memoryview(b"")
# Packed int64s from -32 to 255: every stage, direction and most microbatch indices.
_SMALL_INTS = {v: msgpack.packb(v) for v in range(-32, 256)}
_DIRECTIONS = {int(d): msgpack.packb(int(d)) for d in Direction}
_CACHE_MAX = 4096
_STRIDED = torch.strided
# job -> map marker + packed job + "step" key; (dtype, shape, requires_grad) -> packed
# tensor descriptor. Both are cleared when full rather than managed as LRUs: the
# working set of a training job is small and a miss only costs one packb.
_job_prefix: dict[str, bytes] = {}
_desc_cache: dict[tuple[torch.dtype, torch.Size, bool], bytes] = {}


def _pack_int(v: Any, what: str) -> bytes:
    # Never b"" (encode's inline cache reads rely on it: `cached or _pack_int(...)`).
    b = _SMALL_INTS.get(v) if type(v) is int else None
    if b is not None:
        return b
    if not is_int64(v):
        raise CodecError(f"key.{what} must be an int64, got {v!r}")
    return msgpack.packb(int(v))


_FIXARRAYS = tuple(bytes([0x90 | n]) for n in range(16))


def _array_header(n: int) -> bytes:
    # n <= MAX_TENSORS < 2**16: array16.
    return b"\xdc" + n.to_bytes(2, "big")


def encode(
    key: MsgKey, tensors: Sequence[Tensor | None], meta: dict[str, Any] | None = None
) -> list[Frame]:
    """Serialize one message into frames without copying contiguous CPU tensors.

    Args:
        key: message key; ``key.job`` at most 256 characters.
        tensors: up to 4096 entries, each a tensor (any shape including 0-d and
            zero-size, at most 16 dims, a dtype from :data:`DTYPES`, any device) or
            None. Non-contiguous tensors are copied; CPU-contiguous ones are not.
        meta: small dict (str keys) of msgpack scalars, strings, bytes, lists and
            dicts, for control messages.

    Returns:
        ``[header, tensor frames...]``: the header as bytes, then one memoryview of
        uint8 per non-None tensor. The memoryviews alias the tensors' storage, so
        the caller must not modify those tensors in place while the frames are in
        use (the same contract as ``torch.distributed.isend``).

    Raises:
        CodecError: unsupported dtype, too many tensors or dims, meta not a dict
            or not serializable, or header over 64 KiB (the decoder would reject
            them).
    """
    return encode_sized(key, tensors, meta)[0]


def encode_sized(
    key: MsgKey, tensors: Sequence[Tensor | None], meta: dict[str, Any] | None = None
) -> tuple[list[Frame], int]:
    """:func:`encode`'s frames and their total size in bytes (what :func:`frames_nbytes` would
    count), for a transport's statistics without a second pass over the frames. Raises as
    :func:`encode`."""
    n = len(tensors)
    if n > MAX_TENSORS:
        raise CodecError(f"too many tensors: {n} > {MAX_TENSORS}")
    if type(key) is not MsgKey:
        check_key(key)
    job = key.job
    prefix = _job_prefix.get(job) if type(job) is str else None
    if prefix is None:
        prefix = _new_prefix(key)
    try:
        direction = _DIRECTIONS.get(key.direction)
    except TypeError:  # unhashable
        direction = None
    if direction is None:
        raise CodecError(f"key.direction: unknown direction {key.direction!r}")
    # _pack_int's cache read inline (3 calls/message; a bool is no int: the cache would take it for 0 or 1).
    step, mb, stage = key.step, key.microbatch, key.stage
    parts = [prefix, (type(step) is int and _SMALL_INTS.get(step)) or _pack_int(step, "step"),
             _H_MICROBATCH, (type(mb) is int and _SMALL_INTS.get(mb)) or _pack_int(mb, "microbatch"),
             _H_STAGE, (type(stage) is int and _SMALL_INTS.get(stage)) or _pack_int(stage, "stage"),
             _H_DIRECTION, direction, _H_TENSORS, _FIXARRAYS[n] if n < 16 else _array_header(n)]
    frames: list[Frame] = [b""]
    size = 0
    for i, t in enumerate(tensors):
        if t is None:
            parts.append(_NIL)
            continue
        if not isinstance(t, Tensor):
            raise CodecError(f"tensor {i}: expected a Tensor or None, got {type(t).__name__}")
        if t.layout is not _STRIDED and t.layout != _STRIDED:
            raise CodecError(f"tensor {i}: unsupported layout {t.layout}")
        rg = t.requires_grad
        ck = (t.dtype, t.shape, rg)
        desc = _desc_cache.get(ck)
        parts.append(desc if desc is not None else _new_desc(i, t, ck))
        if t.is_cpu and t.is_contiguous():
            try:
                # numpy() refuses exactly what needs the slow path: bfloat16 (no numpy
                # dtype) and lazy conjugate/negative views (unresolved storage).
                a = (t.detach() if rg else t).numpy()
            except (TypeError, RuntimeError):
                f = _tensor_bytes(t)
            else:
                # The ndarray keeps the tensor, and so its storage, alive as long as the
                # memoryview lives. cast() refuses views with a zero in the shape.
                f = memoryview(a).cast("B") if a.size else _EMPTY
        else:
            f = _tensor_bytes(t)
        frames.append(f)
        size += f.nbytes
    if meta is None or (type(meta) is dict and not meta):
        parts.append(_H_EMPTY_META)
    else:
        parts += (_H_META, _pack_meta(meta))
    packed = b"".join(parts)
    if len(packed) > MAX_HEADER_BYTES:
        raise CodecError(f"header too big: {len(packed)} bytes > {MAX_HEADER_BYTES}")
    frames[0] = packed
    return frames, size + len(packed)


# The rare paths of encode(), out of its per-message path: a job, a tensor description
# or a meta dict not seen before.
def _new_prefix(key: MsgKey) -> bytes:
    check_key(key)
    job = key.job
    prefix = _H_MAP + msgpack.packb({"job": job})[1:] + _H_STEP
    if len(_job_prefix) >= _CACHE_MAX:
        _job_prefix.clear()
    _job_prefix[job] = prefix
    return prefix


def _new_desc(i: int, t: Tensor, ck: tuple) -> bytes:
    desc = _pack_desc(i, t)
    if len(_desc_cache) >= _CACHE_MAX:
        _desc_cache.clear()
    _desc_cache[ck] = desc
    return desc


def _pack_meta(meta: Any) -> bytes:
    if not isinstance(meta, dict):
        raise CodecError(f"meta: expected a dict, got {type(meta).__name__}")
    check_meta(meta, where="meta")
    try:
        return msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"header not serializable: {e}") from e


def _pack_desc(i: int, t: Tensor) -> bytes:
    return msgpack.packb(descriptor(i, t))


def _tensor_bytes(t: Tensor) -> memoryview:
    if t.numel() == 0:
        # A zero-size view may keep any strides (an empty slice's is 2), which the uint8
        # view refuses for 2-byte dtypes; there are no bytes to ship anyway.
        return _EMPTY
    b = wire_bytes(t)  # the ndarray keeps the bytes alive as long as the memoryview lives
    return memoryview((b if b.device.type == "cpu" else b.cpu()).numpy())


def wire_bytes(t: Tensor) -> Tensor:
    """The bytes of ``t`` as every transport sends them: a flat uint8 view of its data on its own
    device in C order (copied only if not contiguous or a lazy conjugate/negative view). Raises
    CodecError for a tensor on the meta device (shapes without data)."""
    t = t.detach()
    if t.device.type == "meta":
        raise CodecError(f"a tensor on the meta device has no data to send (shape {tuple(t.shape)})")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().reshape(-1)
    if t.numel() and t.stride(0) != 1:
        # One element whose view kept another stride (x[0:1, 0]): contiguous() leaves it
        # as is, and the uint8 view refuses a last stride other than 1.
        t = t.as_strided((1,), (1,))
    # Viewing as uint8 sidesteps dtypes numpy lacks (bfloat16).
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------
# decode


_BOOL = torch.bool
_BOOL_BYTES = b"\x00\x01"
_BOOL_SCAN_MAX = 1024

# Headers read before (issue 33, the per-task cost). A data message's header is the encoder's
# map in its order: a prefix (the map marker, "job" and the job, "step" and the step), then a
# tail ("microbatch" and the microbatch ... an empty "meta"). A job sends one prefix per step
# and the same tails every step. A header made of a prefix and a tail that were, byte for byte,
# parts of headers :func:`parse_header` accepted parses as they did: msgpack reads a map's
# entries one after the other, so the tail's entries parse the same after any prefix of the
# same entries, and the limits bound each entry alone. Its key and descriptors are then the
# ones checked before (the declared bytes against this caller's limit); any other header (a
# control message's meta, another layout, an unknown prefix or tail) takes the full parse,
# whose success teaches this one (decode reads them; _learn_header keeps them).
_known_prefix: dict[bytes, tuple[str, int]] = {}  # prefix bytes -> (job, step)
_known_tail: dict[bytes, tuple] = {}  # tail bytes -> (microbatch, stage, direction, descs, n_frames, declared bytes)
_TAILS_MAX = 1 << 14  # the tails of a step: microbatches x stages x directions (x shapes)
# Longest header learned (a data header: ~50 bytes and ~20 per tensor): a peer's accepted
# messages with many empty tensors must not make the tails and their descriptors hold gigabytes
# (at most ~8 KB an entry here, 50 empty tensors: ~124 MiB at _TAILS_MAX, measured with
# tracemalloc); a longer one is parsed in full.
_LEARN_MAX = 512
# The length of a msgpack int from its first byte (0: not an int).
_INT_LEN = bytes(1 if b < 0x80 or b >= 0xE0 else {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5,
                                                    0xD3: 9}.get(b, 0) for b in range(256))


# By a header's byte 5 (the job's str marker, after the map marker and "job"): where the step's
# int begins for a fixstr job (its length, then "step"); 1: a str8 job (its length is byte 6);
# 0: another marker, which encode never writes.
_STEP_AT = bytes((b & 0x1F) + 11 if 0xA0 <= b <= 0xBF else 1 if b == 0xD9 else 0 for b in range(256))


def _step_at(head: bytes) -> int:
    """Where the step's int begins in a header laid out as :func:`encode` lays it out, judged
    by the job's str marker (0: not a fixstr or str8). Raises IndexError on a header cut short."""
    k = _STEP_AT[head[5]]
    return head[6] + 12 if k == 1 else k  # a str8: its length, then "step"


def _learn_header(head: bytes, key: MsgKey, descs: list, n_frames: int) -> None:
    # A header parse_header accepted, with an empty meta: remember its prefix and tail when it
    # is laid out as encode lays it out (each part checked, the ints read back against the key).
    if len(head) > _LEARN_MAX:
        return
    try:
        k = _step_at(head)
        i = k + _INT_LEN[head[k]]
        j = i + len(_H_MICROBATCH)
        t = j + _INT_LEN[head[j]]
    except IndexError:
        return
    if (k == 0 or i == k or t == j or head[:5] != _H_MAP + _H_JOB or head[k - 5:k] != _H_STEP
            or head[i:j] != _H_MICROBATCH or head[t:t + len(_H_STAGE)] != _H_STAGE
            or msgpack.unpackb(head[k:i]) != key.step or msgpack.unpackb(head[j:t]) != key.microbatch):
        return
    if len(_known_prefix) >= _CACHE_MAX:
        _known_prefix.clear()
    if len(_known_tail) >= _TAILS_MAX:
        _known_tail.clear()
    _known_prefix[head[:i]] = (key.job, key.step)
    total = sum(d[3] for d in descs if d is not None)
    _known_tail[head[i:]] = (key.microbatch, key.stage, key.direction, descs, n_frames, total)


def decode(
    frames: Sequence[Any], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[MsgKey, list[Tensor | None], dict[str, Any]]:
    """Parse one message produced by :func:`encode`.

    Args:
        frames: ``[header, tensor frames...]``, each with the buffer protocol.
        max_bytes: limit on the sum of declared tensor bytes.

    Returns:
        ``(key, tensors, meta)``. Tensors are freshly allocated, writable CPU
        tensors that share nothing with ``frames``; float/complex tensors whose
        header says so are leaf tensors with ``requires_grad=True``.

    Raises:
        CodecError: for any malformed input (bad msgpack, header over 64 KiB,
            unexpected fields or types, ext types, unknown dtype, ndim > 16,
            negative dims, more than 4096 tensors, payload over ``max_bytes``,
            frame count or frame length not matching the header).
    """
    n = len(frames)
    if n == 0:
        raise CodecError("empty message: no header frame")
    head = frames[0]
    if type(head) not in _LEN_IS_NBYTES:
        head = _byte_view(head, "header")
    if len(head) > MAX_HEADER_BYTES:
        raise CodecError(f"header too big: {len(head)} bytes > {MAX_HEADER_BYTES}")
    if type(head) is not bytes:  # a zmq.Frame (from another process), a bytearray, a view: as bytes
        head = bytes(head)  # (<= 64 KiB) for the known-header read and learning (a zmq.Frame's [i] is no byte)
    # A header whose prefix and tail were accepted before (see _known_prefix) parses as they
    # did, its declared bytes checked against this caller's limit; any other is parsed in full.
    key, tail = _known_header(head, max_bytes)
    if tail is not None:
        descs, n_frames, meta = tail[3], tail[4], {}
    else:
        key, descs, n_frames, meta = parse_header(unpack_header(head), max_bytes)
    if n - 1 != n_frames:
        raise CodecError(f"frame count mismatch: header declares {n_frames} tensor frames, got {n - 1}")

    out: list[Tensor | None] = []
    fi = 1
    for i, d in enumerate(descs):
        if d is None:
            out.append(None)
            continue
        info, shape, rg, nbytes = d
        buf = frames[fi]
        fi += 1
        if type(buf) is memoryview:  # encode's frames: a flat view of bytes needs no new one
            if buf.ndim != 1 or buf.format != "B" or not buf.c_contiguous:
                buf = _byte_view(buf, i)
        elif type(buf) not in _LEN_IS_NBYTES:
            buf = _byte_view(buf, i)
        if len(buf) != nbytes:
            raise CodecError(f"tensor {i}: frame has {len(buf)} bytes, expected {nbytes} for {info.name}{shape}")
        if info.torch is _BOOL and nbytes and not _bool_bytes_ok(buf):
            # torch assumes bool bytes are 0 or 1; anything else is not a bool.
            raise CodecError(f"tensor {i}: bool frame holds bytes other than 0 and 1")
        # Exactly one copy into fresh storage: the receive buffer may be reused or
        # read-only, and tensors must not alias it.
        if nbytes >= _ALLOC_COPY_MIN or nbytes == 0:
            t = _allocated_copy(i, shape, info, buf, nbytes)
        else:
            # Small tensors: numpy wrapping a bytearray copy costs a fraction of an
            # allocator tensor plus a copy (the storage is then not resizable).
            t = torch.from_numpy(np.ndarray(shape, info.numpy, bytearray(buf)))
            if info.view is not None:
                t = t.view(info.view)
        if rg:
            t.requires_grad_(True)
        out.append(t)
    if tail is None and not meta:  # a message accepted whole teaches its header, a refused one nothing
        _learn_header(head, key, descs, n_frames)
    return key, out, meta


_UNKNOWN = (None, None)


def _known_header(head: bytes, max_bytes: int) -> tuple[Any, Any]:
    """``(key, tail entry)`` of a header whose prefix and tail were accepted before
    (:func:`_learn_header`) and whose declared bytes are within ``max_bytes``; else
    ``(None, None)``."""
    try:
        k = _STEP_AT[head[5]]  # _step_at's table read inline (once per message): a fixstr job
        if k == 1:
            k = _step_at(head)
        i = k + _INT_LEN[head[k]]
    except IndexError:  # cut short: the full parse says how
        return _UNKNOWN
    js = _known_prefix.get(head[:i]) if i > k else None
    if js is None:
        return _UNKNOWN
    tail = _known_tail.get(head[i:])
    if tail is None or tail[5] > max_bytes:
        return _UNKNOWN
    return MsgKey(js[0], js[1], tail[0], tail[1], tail[2]), tail


def _allocated_copy(i: int, shape: Any, info: Any, buf: Any, nbytes: int) -> Tensor:
    # Allocator memory: 64-byte aligned and resizable, like any tensor (large or empty frames).
    try:
        t = torch.empty(shape, dtype=info.torch)
    except RuntimeError as e:
        # Zero bytes pass the payload limit, but a zero-size shape whose other dims
        # overflow torch's stride or storage arithmetic cannot be allocated.
        raise CodecError(f"tensor {i}: shape {shape} not allocatable: {e}") from e
    if nbytes:
        np.copyto(t.view(-1).view(torch.uint8).numpy(), np.frombuffer(buf, np.uint8))
    return t


def _bool_bytes_ok(buf: Any) -> bool:
    if len(buf) <= _BOOL_SCAN_MAX:
        # Small frames: deleting the valid bytes beats a numpy reduction's overhead.
        return not bytes(buf).translate(None, _BOOL_BYTES)
    return int(np.frombuffer(buf, np.uint8).max()) <= 1


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size of ``frames`` in bytes (for statistics)."""
    n = 0
    for f in frames:
        if type(f) is memoryview:  # encode's tensor frames: their own size, no new view
            n += f.nbytes
        else:
            n += len(f) if type(f) in _LEN_IS_NBYTES else memoryview(f).nbytes
    return n


# Flat byte buffers whose len() is their size in bytes: no memoryview is needed to
# size or read them.
_LEN_IS_NBYTES = {bytes, bytearray, zmq.Frame}


def _byte_view(f: Any, what: str | int) -> memoryview:
    # ``what``: "header", or a tensor's index (named only in an error: once per frame).
    try:
        mv = memoryview(f)
    except TypeError as e:
        raise CodecError(f"{_frame_name(what)}: frame of type {type(f).__name__} has no buffer") from e
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise CodecError(f"{_frame_name(what)}: frame buffer is not contiguous") from e
    elif not mv.c_contiguous:  # a stepped slice: numpy and msgpack would refuse it later
        raise CodecError(f"{_frame_name(what)}: frame buffer is not contiguous")
    return mv


def _frame_name(what: str | int) -> str:
    return what if isinstance(what, str) else f"tensor {what}"
