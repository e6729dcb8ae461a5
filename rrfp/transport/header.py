"""The wire header's limits and checks: what one message may declare, and the validation of a
received header before anything is allocated.

The header is frame 0 of every message (:mod:`.codec` holds the wire format, the encoder and
the frames): a msgpack map ``{"job", "step", "microbatch", "stage", "direction", "tensors",
"meta"}``. This module fixes the limits (:data:`MAX_HEADER_BYTES`, :data:`MAX_TENSORS`,
:data:`MAX_NDIM`, :data:`DEFAULT_MAX_BYTES`, :data:`MAX_META_DEPTH`), the dtypes on the wire
(:data:`DTYPES`), and parses an untrusted header (:func:`unpack_header`, :func:`parse_header`):
msgpack bounded by the header size, no ext types turned into objects, every field's type and
range checked, and the declared payload summed against ``max_bytes`` before any tensor exists.
Every problem raises :class:`CodecError` with a one-line message. A data plane's announcement
carries the same tensor descriptors and is checked here too (:func:`parse_descriptors`).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor

from .keys import Direction, MsgKey

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_JOB_LEN",
    "MAX_META_DEPTH",
    "MAX_NDIM",
    "MAX_TENSORS",
    "CodecError",
    "check_key",
    "check_meta",
    "descriptor",
    "parse_descriptors",
    "parse_header",
    "unpack_header",
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
"""Longest job id, in characters."""

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
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
HEADER_KEYS = frozenset(("job", "step", "microbatch", "stage", "direction", "tensors", "meta"))
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class CodecError(ValueError):
    """A message could not be encoded or decoded; the message says why, on one line."""

    def __init__(self, msg: str) -> None:
        first = msg.splitlines()[0] if msg else "codec error"
        super().__init__(first[:500])


class DTypeInfo:
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


DTYPE_INFO: dict[str, DTypeInfo] = {k: DTypeInfo(k, v) for k, v in DTYPES.items()}
Desc = tuple[DTypeInfo, list[int], bool, int]
"""One checked tensor entry: ``(dtype info, shape, requires_grad, nbytes)``."""
_DIRECTION_OF = {int(d): d for d in Direction}


def descriptor(i: int, t: Tensor) -> list:
    """``[dtype name, shape, requires_grad]``: how the wire describes tensor ``i`` of a message.

    Raises:
        CodecError: a dtype outside :data:`DTYPES`, or more than :data:`MAX_NDIM` dims.
    """
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"tensor {i}: unsupported dtype {t.dtype}")
    if t.dim() > MAX_NDIM:
        raise CodecError(f"tensor {i}: ndim {t.dim()} > {MAX_NDIM}")
    return [name, list(t.shape), bool(t.requires_grad)]


def check_key(key: MsgKey) -> None:
    """Raise CodecError unless ``key`` is a :class:`MsgKey` the header can carry (a job of at
    most :data:`MAX_JOB_LEN` characters, int64 step/microbatch/stage, a known direction)."""
    if not isinstance(key, MsgKey):
        raise CodecError(f"key: expected MsgKey, got {type(key).__name__}")
    if not isinstance(key.job, str) or len(key.job) > MAX_JOB_LEN:
        raise CodecError(f"key.job must be a str of at most {MAX_JOB_LEN} characters")
    for field in ("step", "microbatch", "stage"):
        v = getattr(key, field)
        if not is_int64(v):
            raise CodecError(f"key.{field} must be an int64, got {v!r}")
    try:
        Direction(key.direction)
    except ValueError as e:
        raise CodecError(f"key.direction: unknown direction {key.direction!r}") from e


def unpack_header(head: Any) -> Any:
    """The msgpack object of a header frame, every length bounded by :data:`MAX_HEADER_BYTES`.

    Raises:
        CodecError: bad msgpack, or nesting too deep.
    """
    try:
        # No ext_hook: ext payloads stay inert ExtType/Timestamp values that
        # check_meta rejects; nothing is ever turned into an arbitrary object.
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


def parse_header(obj: Any, max_bytes: int) -> tuple[MsgKey, list[Desc | None], int, dict]:
    """Validate a header; return its key, tensor descriptors, tensor frame count and
    meta. Raises CodecError, also when the declared payload exceeds ``max_bytes``."""
    if type(obj) is not dict:
        raise CodecError(f"header: expected a map, got {_tname(obj)}")
    if obj.keys() != HEADER_KEYS:
        keys = set(obj)
        missing = sorted(HEADER_KEYS - keys)
        if missing:
            raise CodecError(f"header: missing field {missing[0]!r}")
        raise CodecError(f"header: unexpected field {min(map(str, keys - HEADER_KEYS))!r}")
    job = obj["job"]
    if type(job) is not str or len(job) > MAX_JOB_LEN:
        raise CodecError(f"header.job: expected a str of at most {MAX_JOB_LEN} chars")
    step, microbatch, stage, d = obj["step"], obj["microbatch"], obj["stage"], obj["direction"]
    # msgpack yields exact ints, and bools as bool: ``type is int`` excludes them. One test of
    # all four first (the message path); the loop names the first bad field.
    if not (type(step) is int and type(microbatch) is int and type(stage) is int and type(d) is int
            and INT64_MIN <= step <= INT64_MAX and INT64_MIN <= microbatch <= INT64_MAX
            and INT64_MIN <= stage <= INT64_MAX and INT64_MIN <= d <= INT64_MAX):
        for field, v in (("step", step), ("microbatch", microbatch), ("stage", stage), ("direction", d)):
            if type(v) is not int or not INT64_MIN <= v <= INT64_MAX:
                raise CodecError(f"header.{field}: expected an int64, got {_tname(v)}")
    direction = _DIRECTION_OF.get(d)
    if direction is None:
        raise CodecError(f"header.direction: unknown direction {d}")
    key = MsgKey(job, step, microbatch, stage, direction)
    descs, n_frames = _parse_tensors(obj["tensors"], max_bytes)
    meta = obj["meta"]
    if type(meta) is not dict:
        raise CodecError(f"header.meta: expected a map, got {_tname(meta)}")
    if meta:
        check_meta(meta, where="meta")
    return key, descs, n_frames, meta


def _parse_tensors(tl: Any, max_bytes: int) -> tuple[list[Desc | None], int]:
    """A header's ``tensors`` field checked entry by entry, the declared bytes summed as they
    go: ``(descriptors, tensor frame count)``. Raises CodecError."""
    if type(tl) is not list:
        raise CodecError(f"header.tensors: expected a list, got {_tname(tl)}")
    if len(tl) > MAX_TENSORS:
        raise CodecError(f"too many tensors: {len(tl)} > {MAX_TENSORS}")
    descs: list[Desc | None] = []
    total = 0
    n_frames = 0
    for i, d in enumerate(tl):
        if d is None:
            descs.append(None)
            continue
        if type(d) is not list or len(d) != 3:
            raise CodecError(f"tensor {i}: expected [dtype, shape, requires_grad]")
        name, shape, rg = d
        info = DTYPE_INFO.get(name) if type(name) is str else None
        if info is None:
            raise CodecError(f"tensor {i}: unknown dtype {str(name)[:40]!r}")
        if type(shape) is not list:
            raise CodecError(f"tensor {i}: shape must be a list, got {_tname(shape)}")
        if len(shape) > MAX_NDIM:
            raise CodecError(f"tensor {i}: ndim {len(shape)} > {MAX_NDIM}")
        for s in shape:
            if type(s) is not int or not 0 <= s <= INT64_MAX:
                if not is_int64(s):
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
    return descs, n_frames


def check_meta(v: Any, where: str, depth: int = 0) -> None:
    """Accept only plain msgpack data (no ext types), nested at most MAX_META_DEPTH.

    Raises:
        CodecError: naming where in ``v`` the first bad value is.
    """
    if v is None or isinstance(v, (bool, float, str, bytes)):
        return
    if isinstance(v, int):
        if not (INT64_MIN <= v <= 2**64 - 1):
            raise CodecError(f"{where}: integer out of range")
        return
    if isinstance(v, (msgpack.ExtType, msgpack.Timestamp)):
        raise CodecError(f"{where}: ext type not allowed")
    if depth >= MAX_META_DEPTH and isinstance(v, (list, tuple, dict)):
        raise CodecError(f"{where}: nesting deeper than {MAX_META_DEPTH}")
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            check_meta(x, f"{where}[{i}]", depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise CodecError(f"{where}: map keys must be str, got {_tname(k)}")
            check_meta(x, f"{where}.{k}", depth + 1)
        return
    raise CodecError(f"{where}: unexpected type {_tname(v)}")


def is_int64(v: Any) -> bool:
    """True for an int (not a bool) in int64's range."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX


def _tname(v: Any) -> str:
    return type(v).__name__


def parse_descriptors(tensors: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[torch.dtype, list[int], bool, int] | None]:
    """Validate a list of tensor descriptors ``[dtype_name, shape, requires_grad] | None``
    (a header's ``tensors`` field, as a data-plane announcement carries it) with the same
    limits as :func:`~rrfp.transport.codec.decode`, before anything is allocated.

    Returns:
        per entry ``(dtype, shape, requires_grad, nbytes)`` or None.

    Raises:
        CodecError: as :func:`~rrfp.transport.codec.decode` for a bad ``tensors`` field.
    """
    descs, _ = _parse_tensors(tensors, max_bytes)
    return [None if d is None else (d[0].torch, d[1], d[2], d[3]) for d in descs]
