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
one-line message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch
import zmq
from torch import Tensor

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
    "frames_nbytes",
    "parse_descriptors",
    "wire_bytes",
]

MAX_HEADER_BYTES = 64 * 1024
"""Largest accepted header frame, in bytes."""
MAX_TENSORS = 4096
"""Most tensor entries (None included) in one message."""
MAX_NDIM = 16
"""Most dimensions of one tensor."""
DEFAULT_MAX_BYTES = 256 * 1024**2
"""Default limit on the declared payload of one message (sum of tensor bytes): well under
the 4 GiB a hostile peer could once make a rank buffer, above any activation of the presets."""
MAX_META_DEPTH = 8
"""Deepest nesting of lists/maps accepted inside ``meta``."""
MAX_JOB_LEN = 256
_ALLOC_COPY_MIN = 64 * 1024

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}
_GRAD_DTYPES = frozenset(
    k for k, v in DTYPES.items() if v.is_floating_point or v.is_complex
)
_HEADER_KEYS = frozenset(
    ("job", "step", "microbatch", "stage", "direction", "tensors", "meta")
)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Frame = bytes | memoryview
"""An outgoing frame. Decoding accepts anything with the buffer protocol (bytes,
bytearray, memoryview, zmq.Frame)."""


class CodecError(ValueError):
    """A message could not be encoded or decoded; the message says why, on one line."""

    def __init__(self, msg: str) -> None:
        first = msg.splitlines()[0] if msg else "codec error"
        super().__init__(first[:500])


# ---------------------------------------------------------------------------
# encode
#
# The header is assembled from pre-packed byte fragments instead of packing a dict
# per message: the bytes are exactly what ``msgpack.packb(header)`` would produce
# (the tests check this), at a fraction of the cost for small messages.


def _fixstr(s: str) -> bytes:
    b = s.encode()
    return bytes([0xA0 | len(b)]) + b


_H_MAP = bytes([0x80 | len(_HEADER_KEYS)])
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
# job -> map marker + packed job + "step" key; (dtype, shape, requires_grad) -> packed
# tensor descriptor. Both are cleared when full rather than managed as LRUs: the
# working set of a training job is small and a miss only costs one packb.
_job_prefix: dict[str, bytes] = {}
_desc_cache: dict[tuple[torch.dtype, torch.Size, bool], bytes] = {}


def _pack_int(v: Any, what: str) -> bytes:
    b = _SMALL_INTS.get(v) if type(v) is int else None
    if b is not None:
        return b
    if not _is_int64(v):
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
    n = len(tensors)
    if n > MAX_TENSORS:
        raise CodecError(f"too many tensors: {n} > {MAX_TENSORS}")
    if type(key) is not MsgKey:
        _check_key(key)
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
    parts = [
        prefix,
        _pack_int(key.step, "step"),
        _H_MICROBATCH,
        _pack_int(key.microbatch, "microbatch"),
        _H_STAGE,
        _pack_int(key.stage, "stage"),
        _H_DIRECTION,
        direction,
        _H_TENSORS,
        _FIXARRAYS[n] if n < 16 else _array_header(n),
    ]
    frames: list[Frame] = [b""]
    for i, t in enumerate(tensors):
        if t is None:
            parts.append(_NIL)
            continue
        if not isinstance(t, Tensor):
            raise CodecError(f"tensor {i}: expected a Tensor or None, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise CodecError(f"tensor {i}: unsupported layout {t.layout}")
        rg = t.requires_grad
        ck = (t.dtype, t.shape, rg)
        desc = _desc_cache.get(ck)
        parts.append(desc if desc is not None else _new_desc(i, t, ck))
        frames.append(_tensor_frame(t, rg))
    if meta is None or (type(meta) is dict and not meta):
        parts.append(_H_EMPTY_META)
    else:
        parts += (_H_META, _pack_meta(meta))
    packed = b"".join(parts)
    if len(packed) > MAX_HEADER_BYTES:
        raise CodecError(f"header too big: {len(packed)} bytes > {MAX_HEADER_BYTES}")
    frames[0] = packed
    return frames


# The rare paths of encode(), out of its per-message path: a job, a tensor description
# or a meta dict not seen before.
def _new_prefix(key: MsgKey) -> bytes:
    _check_key(key)
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
        raise CodecError(f"meta: expected a dict, got {_tname(meta)}")
    _check_meta(meta, where="meta")
    try:
        return msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"header not serializable: {e}") from e


def descriptor(i: int, t: Tensor) -> list:
    """``[dtype name, shape, requires_grad]``: how the wire describes tensor ``i`` of a message.

    Raises:
        CodecError: a dtype outside :data:`DTYPES`, or more than :data:`MAX_NDIM` dims.
    """
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"tensor {i}: unsupported dtype {t.dtype}")
    if t.dim() > MAX_NDIM:
        raise CodecError(f"tensor {i}: ndim {t.dim()} > {MAX_NDIM}")
    return [name, list(t.shape), bool(t.requires_grad)]


def _pack_desc(i: int, t: Tensor) -> bytes:
    return msgpack.packb(descriptor(i, t))


def _tensor_frame(t: Tensor, rg: bool) -> memoryview:
    if t.is_cpu and t.is_contiguous():
        try:
            # numpy() refuses exactly what needs the slow path: bfloat16 (no numpy
            # dtype) and lazy conjugate/negative views (unresolved storage).
            a = (t.detach() if rg else t).numpy()
        except (TypeError, RuntimeError):
            return _tensor_bytes(t)
        # The ndarray keeps the tensor, and so its storage, alive as long as the
        # memoryview lives. cast() refuses views with a zero in the shape.
        return memoryview(a).cast("B") if a.size else _EMPTY
    return _tensor_bytes(t)


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


def _check_key(key: MsgKey) -> None:
    if not isinstance(key, MsgKey):
        raise CodecError(f"key: expected MsgKey, got {type(key).__name__}")
    if not isinstance(key.job, str) or len(key.job) > MAX_JOB_LEN:
        raise CodecError(f"key.job must be a str of at most {MAX_JOB_LEN} characters")
    for field in ("step", "microbatch", "stage"):
        v = getattr(key, field)
        if not _is_int64(v):
            raise CodecError(f"key.{field} must be an int64, got {v!r}")
    try:
        Direction(key.direction)
    except ValueError as e:
        raise CodecError(f"key.direction: unknown direction {key.direction!r}") from e


# ---------------------------------------------------------------------------
# decode


class _DType:
    """What decoding needs to know about one wire dtype name."""

    __slots__ = ("grad", "itemsize", "name", "numpy", "torch", "view")

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.torch = dtype
        self.itemsize = dtype.itemsize
        self.grad = dtype.is_floating_point or dtype.is_complex
        # numpy lacks bfloat16: build an int16 array, then reinterpret in torch.
        self.view = dtype if dtype == torch.bfloat16 else None
        self.numpy = np.dtype(np.int16) if self.view is not None else torch.empty(
            0, dtype=dtype
        ).numpy().dtype


_DTYPE_INFO: dict[str, _DType] = {k: _DType(k, v) for k, v in DTYPES.items()}
_BOOL_BYTES = b"\x00\x01"
_BOOL_SCAN_MAX = 1024
_Desc = tuple[_DType, list[int], bool, int]


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
    key, descs, n_frames, meta = _parse_header(_unpack(head), max_bytes)
    if n - 1 != n_frames:
        raise CodecError(
            f"frame count mismatch: header declares {n_frames} tensor frames, got {n - 1}"
        )

    out: list[Tensor | None] = []
    fi = 1
    for i, d in enumerate(descs):
        if d is None:
            out.append(None)
            continue
        info, shape, rg, nbytes = d
        buf = frames[fi]
        fi += 1
        if type(buf) not in _LEN_IS_NBYTES:
            buf = _byte_view(buf, f"tensor {i}")
        if len(buf) != nbytes:
            raise CodecError(
                f"tensor {i}: frame has {len(buf)} bytes, expected {nbytes} "
                f"for {info.name}{shape}"
            )
        if info.torch is torch.bool and nbytes and not _bool_bytes_ok(buf):
            # torch assumes bool bytes are 0 or 1; anything else is not a bool.
            raise CodecError(f"tensor {i}: bool frame holds bytes other than 0 and 1")
        # Exactly one copy into fresh storage: the receive buffer may be reused or
        # read-only, and tensors must not alias it.
        if nbytes >= _ALLOC_COPY_MIN or nbytes == 0:
            # Allocator memory: 64-byte aligned and resizable, like any tensor.
            try:
                t = torch.empty(shape, dtype=info.torch)
            except RuntimeError as e:
                # Zero bytes pass the payload limit, but a zero-size shape whose other dims
                # overflow torch's stride or storage arithmetic cannot be allocated.
                raise CodecError(f"tensor {i}: shape {shape} not allocatable: {e}") from e
            if nbytes:
                np.copyto(t.view(-1).view(torch.uint8).numpy(), np.frombuffer(buf, np.uint8))
        else:
            # Small tensors: numpy wrapping a bytearray copy costs a fraction of an
            # allocator tensor plus a copy (the storage is then not resizable).
            t = torch.from_numpy(np.ndarray(shape, info.numpy, bytearray(buf)))
            if info.view is not None:
                t = t.view(info.view)
        if rg:
            t.requires_grad_(True)
        out.append(t)
    return key, out, meta


def _bool_bytes_ok(buf: Any) -> bool:
    if len(buf) <= _BOOL_SCAN_MAX:
        # Small frames: deleting the valid bytes beats a numpy reduction's overhead.
        return not bytes(buf).translate(None, _BOOL_BYTES)
    return int(np.frombuffer(buf, np.uint8).max()) <= 1


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size of ``frames`` in bytes (for statistics)."""
    n = 0
    for f in frames:
        n += len(f) if type(f) in _LEN_IS_NBYTES else memoryview(f).nbytes
    return n


# Flat byte buffers whose len() is their size in bytes: no memoryview is needed to
# size or read them.
_LEN_IS_NBYTES = {bytes, bytearray, zmq.Frame}


def _byte_view(f: Any, what: str) -> memoryview:
    try:
        mv = memoryview(f)
    except TypeError as e:
        raise CodecError(f"{what}: frame of type {type(f).__name__} has no buffer") from e
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise CodecError(f"{what}: frame buffer is not contiguous") from e
    elif not mv.c_contiguous:  # a stepped slice: numpy and msgpack would refuse it later
        raise CodecError(f"{what}: frame buffer is not contiguous")
    return mv


def _unpack(head: Any) -> Any:
    try:
        # No ext_hook: ext payloads stay inert ExtType/Timestamp values that
        # _check_meta rejects; nothing is ever turned into an arbitrary object.
        # Keywords spelled out: expanding a dict of them costs ~20% of the call.
        return msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=MAX_HEADER_BYTES,
            max_map_len=MAX_HEADER_BYTES // 2,
            max_ext_len=MAX_HEADER_BYTES,
        )
    except msgpack.StackError as e:
        raise CodecError("bad msgpack header: nesting too deep") from e
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"bad msgpack header: {e}") from e


_DIRECTION_OF = {int(d): d for d in Direction}


def _parse_header(obj: Any, max_bytes: int) -> tuple[MsgKey, list[_Desc | None], int, dict]:
    """Validate a header; return its key, tensor descriptors, tensor frame count and
    meta. Raises CodecError, also when the declared payload exceeds ``max_bytes``."""
    if type(obj) is not dict:
        raise CodecError(f"header: expected a map, got {_tname(obj)}")
    if obj.keys() != _HEADER_KEYS:
        keys = set(obj)
        missing = sorted(_HEADER_KEYS - keys)
        if missing:
            raise CodecError(f"header: missing field {missing[0]!r}")
        raise CodecError(f"header: unexpected field {min(map(str, keys - _HEADER_KEYS))!r}")
    job = obj["job"]
    if type(job) is not str or len(job) > MAX_JOB_LEN:
        raise CodecError(f"header.job: expected a str of at most {MAX_JOB_LEN} chars")
    step, microbatch, stage, d = obj["step"], obj["microbatch"], obj["stage"], obj["direction"]
    for field, v in (("step", step), ("microbatch", microbatch), ("stage", stage), ("direction", d)):
        # msgpack yields exact ints, and bools as bool: ``type is int`` excludes them.
        if type(v) is not int or not _INT64_MIN <= v <= _INT64_MAX:
            raise CodecError(f"header.{field}: expected an int64, got {_tname(v)}")
    direction = _DIRECTION_OF.get(d)
    if direction is None:
        raise CodecError(f"header.direction: unknown direction {d}")
    key = MsgKey(job, step, microbatch, stage, direction)

    tl = obj["tensors"]
    if type(tl) is not list:
        raise CodecError(f"header.tensors: expected a list, got {_tname(tl)}")
    if len(tl) > MAX_TENSORS:
        raise CodecError(f"too many tensors: {len(tl)} > {MAX_TENSORS}")
    descs: list[_Desc | None] = []
    total = 0
    n_frames = 0
    for i, d in enumerate(tl):
        if d is None:
            descs.append(None)
            continue
        if type(d) is not list or len(d) != 3:
            raise CodecError(f"tensor {i}: expected [dtype, shape, requires_grad]")
        name, shape, rg = d
        info = _DTYPE_INFO.get(name) if type(name) is str else None
        if info is None:
            raise CodecError(f"tensor {i}: unknown dtype {str(name)[:40]!r}")
        if type(shape) is not list:
            raise CodecError(f"tensor {i}: shape must be a list, got {_tname(shape)}")
        if len(shape) > MAX_NDIM:
            raise CodecError(f"tensor {i}: ndim {len(shape)} > {MAX_NDIM}")
        for s in shape:
            if type(s) is not int or not 0 <= s <= _INT64_MAX:
                if not _is_int64(s):
                    raise CodecError(f"tensor {i}: dim must be an int, got {_tname(s)}")
                raise CodecError(f"tensor {i}: negative dim {s}")
        if type(rg) is not bool:
            raise CodecError(f"tensor {i}: requires_grad must be a bool")
        if rg and not info.grad:
            raise CodecError(f"tensor {i}: requires_grad on non-floating dtype {name}")
        # Python ints: a giant declared shape cannot overflow, it just exceeds the limit.
        nbytes = math.prod(shape) * info.itemsize
        total += nbytes
        if total > max_bytes:
            raise CodecError(f"declared payload exceeds limit: > {max_bytes} bytes at tensor {i}")
        descs.append((info, shape, rg, nbytes))
        n_frames += 1

    meta = obj["meta"]
    if type(meta) is not dict:
        raise CodecError(f"header.meta: expected a map, got {_tname(meta)}")
    if meta:
        _check_meta(meta, where="meta")
    return key, descs, n_frames, meta


def _check_meta(v: Any, where: str, depth: int = 0) -> None:
    """Accept only plain msgpack data (no ext types), nested at most MAX_META_DEPTH."""
    if v is None or isinstance(v, (bool, float, str, bytes)):
        return
    if isinstance(v, int):
        if not (_INT64_MIN <= v <= 2**64 - 1):
            raise CodecError(f"{where}: integer out of range")
        return
    if isinstance(v, (msgpack.ExtType, msgpack.Timestamp)):
        raise CodecError(f"{where}: ext type not allowed")
    if depth >= MAX_META_DEPTH and isinstance(v, (list, tuple, dict)):
        raise CodecError(f"{where}: nesting deeper than {MAX_META_DEPTH}")
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_meta(x, f"{where}[{i}]", depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise CodecError(f"{where}: map keys must be str, got {_tname(k)}")
            _check_meta(x, f"{where}.{k}", depth + 1)
        return
    raise CodecError(f"{where}: unexpected type {_tname(v)}")


def _is_int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _INT64_MIN <= v <= _INT64_MAX


def _tname(v: Any) -> str:
    return type(v).__name__


def parse_descriptors(tensors: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[torch.dtype, list[int], bool, int] | None]:
    """Validate a list of tensor descriptors ``[dtype_name, shape, requires_grad] | None``
    (a header's ``tensors`` field, as a data-plane announcement carries it) with the same
    limits as :func:`decode`, before anything is allocated.

    Returns:
        per entry ``(dtype, shape, requires_grad, nbytes)`` or None.

    Raises:
        CodecError: as :func:`decode` for a bad ``tensors`` field.
    """
    header = {"job": "", "step": 0, "microbatch": 0, "stage": 0, "direction": 0, "tensors": tensors, "meta": {}}
    _, descs, _, _ = _parse_header(header, max_bytes)
    return [None if d is None else (d[0].torch, d[1], d[2], d[3]) for d in descs]
