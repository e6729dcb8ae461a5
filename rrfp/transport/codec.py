"""Wire format: one msgpack header frame followed by one raw frame per tensor.

Frame 0 is a msgpack map::

    {"job": str, "step": int, "microbatch": int, "stage": int, "direction": int,
     "tensors": [[dtype_name, shape, requires_grad] | None, ...], "meta": {...}}

Frames 1.. hold the C-contiguous bytes of every non-None tensor, in order, in the
sender's native byte order (all supported platforms are little-endian).

Decoding treats its input as untrusted: every size is checked against the header
and against fixed limits before anything is allocated, and nothing is ever
unpickled. Every problem raises :class:`CodecError` with a one-line message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor

from .keys import Direction, MsgKey

__all__ = [
    "CodecError",
    "DEFAULT_MAX_BYTES",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "Frame",
    "decode",
    "encode",
    "frames_nbytes",
]

MAX_HEADER_BYTES = 64 * 1024
"""Largest accepted header frame, in bytes."""
MAX_TENSORS = 4096
"""Most tensor entries (None included) in one message."""
MAX_NDIM = 16
"""Most dimensions of one tensor."""
DEFAULT_MAX_BYTES = 2 * 1024**3
"""Default limit on the declared payload of one message (sum of tensor bytes)."""
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
        CodecError: unsupported dtype, too many tensors or dims, meta not
            serializable, or header over 64 KiB (the decoder would reject them).
    """
    if len(tensors) > MAX_TENSORS:
        raise CodecError(f"too many tensors: {len(tensors)} > {MAX_TENSORS}")
    descs: list[list[Any] | None] = []
    frames: list[Frame] = []
    for i, t in enumerate(tensors):
        if t is None:
            descs.append(None)
            continue
        if not isinstance(t, Tensor):
            raise CodecError(f"tensor {i}: expected a Tensor or None, got {type(t).__name__}")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise CodecError(f"tensor {i}: unsupported dtype {t.dtype}")
        if t.dim() > MAX_NDIM:
            raise CodecError(f"tensor {i}: ndim {t.dim()} > {MAX_NDIM}")
        if t.layout != torch.strided:
            raise CodecError(f"tensor {i}: unsupported layout {t.layout}")
        descs.append([name, list(t.shape), bool(t.requires_grad)])
        frames.append(_tensor_bytes(t))
    meta = {} if meta is None else meta
    _check_meta(meta, where="meta")
    _check_key(key)
    header = {
        "job": key.job,
        "step": int(key.step),
        "microbatch": int(key.microbatch),
        "stage": int(key.stage),
        "direction": int(key.direction),
        "tensors": descs,
        "meta": meta,
    }
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"header not serializable: {e}") from e
    if len(packed) > MAX_HEADER_BYTES:
        raise CodecError(f"header too big: {len(packed)} bytes > {MAX_HEADER_BYTES}")
    return [packed, *frames]


def _tensor_bytes(t: Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # Lazy conjugate/negative views would otherwise ship their unresolved storage.
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    # Viewing as uint8 sidesteps dtypes numpy lacks (bfloat16); the ndarray keeps
    # the tensor, and so its storage, alive as long as the memoryview lives.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
    if len(frames) == 0:
        raise CodecError("empty message: no header frame")
    head = _byte_view(frames[0], "header")
    if head.nbytes > MAX_HEADER_BYTES:
        raise CodecError(f"header too big: {head.nbytes} bytes > {MAX_HEADER_BYTES}")
    obj = _unpack(head)
    key, descs, meta = _parse_header(obj)

    total = 0
    for i, d in enumerate(descs):
        if d is not None:
            total += _nbytes(d)
            if total > max_bytes:
                raise CodecError(
                    f"declared payload exceeds limit: > {max_bytes} bytes at tensor {i}"
                )
    n_frames = sum(d is not None for d in descs)
    if len(frames) - 1 != n_frames:
        raise CodecError(
            f"frame count mismatch: header declares {n_frames} tensor frames, "
            f"got {len(frames) - 1}"
        )

    bufs: list[memoryview] = []
    fi = 1
    for i, d in enumerate(descs):
        if d is None:
            continue
        buf = _byte_view(frames[fi], f"tensor {i}")
        want = _nbytes(d)
        if buf.nbytes != want:
            raise CodecError(
                f"tensor {i}: frame has {buf.nbytes} bytes, expected {want} "
                f"for {d[0]}{list(d[1])}"
            )
        if d[0] == "bool" and want and int(np.frombuffer(buf, np.uint8).max()) > 1:
            # torch assumes bool bytes are 0 or 1; anything else is not a bool.
            raise CodecError(f"tensor {i}: bool frame holds bytes other than 0 and 1")
        bufs.append(buf)
        fi += 1

    out: list[Tensor | None] = []
    bi = 0
    for d in descs:
        if d is None:
            out.append(None)
            continue
        name, shape, rg = d
        buf = bufs[bi]
        # Exactly one copy into fresh storage: the receive buffer may be reused or
        # read-only, and tensors must not alias it.
        if buf.nbytes >= _ALLOC_COPY_MIN or buf.nbytes == 0:
            # Allocator memory: 64-byte aligned and resizable, like any tensor.
            t = torch.empty(shape, dtype=DTYPES[name])
            if buf.nbytes:
                np.copyto(t.view(-1).view(torch.uint8).numpy(), np.frombuffer(buf, np.uint8))
        else:
            # Small tensors: a bytearray copy is ~5x cheaper per tensor than the
            # numpy route (the storage is then not resizable).
            t = torch.frombuffer(bytearray(buf), dtype=DTYPES[name]).view(shape)
        if rg:
            t.requires_grad_(True)
        out.append(t)
        bi += 1
    return key, out, meta


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size of ``frames`` in bytes (for statistics)."""
    return sum(memoryview(f).nbytes for f in frames)


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
    return mv


def _unpack(head: memoryview) -> Any:
    try:
        # No ext_hook: ext payloads stay inert ExtType/Timestamp values that
        # _check_meta rejects; nothing is ever turned into an arbitrary object.
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


def _parse_header(obj: Any) -> tuple[MsgKey, list[tuple[str, list[int], bool] | None], dict]:
    if not isinstance(obj, dict):
        raise CodecError(f"header: expected a map, got {_tname(obj)}")
    keys = set(obj)
    if keys != _HEADER_KEYS:
        missing = sorted(_HEADER_KEYS - keys)
        if missing:
            raise CodecError(f"header: missing field {missing[0]!r}")
        raise CodecError(f"header: unexpected field {sorted(map(str, keys - _HEADER_KEYS))[0]!r}")
    job = obj["job"]
    if not isinstance(job, str) or len(job) > MAX_JOB_LEN:
        raise CodecError(f"header.job: expected a str of at most {MAX_JOB_LEN} chars")
    ints = {}
    for field in ("step", "microbatch", "stage", "direction"):
        v = obj[field]
        if not _is_int64(v):
            raise CodecError(f"header.{field}: expected an int64, got {_tname(v)}")
        ints[field] = v
    try:
        direction = Direction(ints["direction"])
    except ValueError as e:
        raise CodecError(f"header.direction: unknown direction {ints['direction']}") from e
    key = MsgKey(job, ints["step"], ints["microbatch"], ints["stage"], direction)

    tl = obj["tensors"]
    if not isinstance(tl, list):
        raise CodecError(f"header.tensors: expected a list, got {_tname(tl)}")
    if len(tl) > MAX_TENSORS:
        raise CodecError(f"too many tensors: {len(tl)} > {MAX_TENSORS}")
    descs: list[tuple[str, list[int], bool] | None] = []
    for i, d in enumerate(tl):
        if d is None:
            descs.append(None)
            continue
        if not isinstance(d, list) or len(d) != 3:
            raise CodecError(f"tensor {i}: expected [dtype, shape, requires_grad]")
        name, shape, rg = d
        if not isinstance(name, str) or name not in DTYPES:
            raise CodecError(f"tensor {i}: unknown dtype {str(name)[:40]!r}")
        if not isinstance(shape, list):
            raise CodecError(f"tensor {i}: shape must be a list, got {_tname(shape)}")
        if len(shape) > MAX_NDIM:
            raise CodecError(f"tensor {i}: ndim {len(shape)} > {MAX_NDIM}")
        for s in shape:
            if not _is_int64(s):
                raise CodecError(f"tensor {i}: dim must be an int, got {_tname(s)}")
            if s < 0:
                raise CodecError(f"tensor {i}: negative dim {s}")
        if not isinstance(rg, bool):
            raise CodecError(f"tensor {i}: requires_grad must be a bool")
        if rg and name not in _GRAD_DTYPES:
            raise CodecError(f"tensor {i}: requires_grad on non-floating dtype {name}")
        descs.append((name, shape, rg))

    meta = obj["meta"]
    if not isinstance(meta, dict):
        raise CodecError(f"header.meta: expected a map, got {_tname(meta)}")
    _check_meta(meta, where="meta")
    return key, descs, meta


def _nbytes(d: tuple[str, list[int], bool]) -> int:
    # Python ints: a giant declared shape cannot overflow, it just exceeds the limit.
    return math.prod(d[1]) * _ITEMSIZE[d[0]]


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
