"""Checking a checkpoint's files before loading them: a damaged checkpoint is one line naming
the file, not a wall of tracebacks from every rank (or, worse, silently wrong weights).

``torch.distributed.checkpoint`` (DCP) stores each tensor as a ``torch.save`` record inside a
shard file (``__<rank>_<n>.distcp``) at an offset listed in ``.metadata``. It has no checksum:
a truncated shard fails deep inside ``torch.load`` on the rank that reads it, and flipped bytes
inside a tensor's data load without any error. So each rank hashes the shard files it wrote
(:func:`digesting_writer`), rank 0 records the digests in ``rrfp.json`` with the checkpoint,
and :func:`check_files` compares them before anything is loaded. A checkpoint without a digest
for each of its files (its ``files`` map deleted or cut) is refused: it cannot be verified.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

METADATA = ".metadata"


def digest(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file (read once, in 1 MiB blocks)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
    return {"bytes": n, "sha256": h.hexdigest()}


def digesting_writer(path: str | os.PathLike):
    """DCP's file writer for ``path`` that also hashes every shard file it wrote (its
    ``digests``: file name -> :func:`digest`), once the data is on disk."""
    import torch.distributed.checkpoint as dcp

    class DigestingWriter(dcp.FileSystemWriter):
        def __init__(self, path) -> None:
            super().__init__(path)
            self.digests: dict[str, dict] = {}

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            for name in sorted({r.storage_data.relative_path for r in fut.wait()}):
                self.digests[name] = digest(Path(self.path) / name)
            return fut

    return DigestingWriter(path)


def shard_extents(path: str | os.PathLike) -> dict[str, int]:
    """Each shard file named in the checkpoint's ``.metadata`` with the bytes it must hold
    (the end of its last record).

    Raises:
        ValueError: ``.metadata`` is missing or unreadable (one line naming it).
    """
    import torch.distributed.checkpoint as dcp

    try:
        md = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        extents: dict[str, int] = {}
        for info in md.storage_data.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # unpickling garbage raises anything from EOFError to UnpicklingError
        raise ValueError(f"{os.fspath(Path(path) / METADATA)} is unreadable "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'damaged'})") from None
    return extents


def check_files(path: str | os.PathLike, meta: dict, only: list[str] | None = None) -> str | None:
    """The first problem with a committed checkpoint's files, as one line naming the file, or None.

    Args:
        path: the checkpoint folder (``step-N``).
        meta: its ``rrfp.json`` (:func:`rrfp.train.checkpoint.read_meta`); ``meta["files"]``
            holds the digests written with it.
        only: check just these files (a rank's share of the work; ``.metadata`` among them or
            not); None: all. Either way every file must have a recorded digest.
    """
    where = os.fspath(path)
    recorded = meta.get("files")
    if not isinstance(recorded, dict) or not _is_digest(recorded.get(METADATA)):
        return (f"checkpoint {where!r}: its rrfp.json records no digests of its files ('files' is missing or has "
                f"no {METADATA}), so it cannot be verified before loading: expected a checkpoint as rrfp train "
                "commits it")
    try:
        if (only is None or METADATA in only) and digest(Path(path) / METADATA) != recorded[METADATA]:
            return f"checkpoint {where!r}: {METADATA} differs from the one written with it (damaged after saving)"
        extents = shard_extents(path)
    except FileNotFoundError:
        return f"checkpoint {where!r}: {METADATA} is missing"
    except (OSError, ValueError) as e:
        return f"checkpoint {where!r}: {e}"
    unrecorded = sorted(n for n in extents if not _is_digest(recorded.get(n)))
    if unrecorded:
        return f"checkpoint {where!r}: shard {unrecorded[0]} has no digest in its rrfp.json, so it cannot be verified"
    for name in sorted(extents if only is None else set(only) & set(extents)):
        f = Path(path) / name
        try:
            size = f.stat().st_size
        except OSError as e:
            return f"checkpoint {where!r}: shard {name} is unreadable ({e.strerror or e})"
        want = recorded[name]["bytes"]
        if size < extents[name] or size != want:
            return f"checkpoint {where!r}: shard {name} has {size} bytes, expected {want} (truncated or damaged)"
        try:
            same = digest(f)["sha256"] == recorded[name]["sha256"]
        except OSError as e:
            return f"checkpoint {where!r}: shard {name} is unreadable ({e.strerror or e})"
        if not same:
            return f"checkpoint {where!r}: shard {name} differs from the one written with it (damaged after saving)"
    return None


def _is_digest(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("bytes"), int) and isinstance(d.get("sha256"), str)


def shard_names(meta: dict) -> list[str]:
    """The shard files a checkpoint's digests list, sorted (``.metadata`` excluded)."""
    return sorted(k for k in (meta.get("files") or {}) if k != METADATA)


def first_line(e: BaseException) -> str:
    """The root error of a DCP failure, one line: ``CheckpointException`` formats every rank's
    traceback into its message; its ``failures`` hold the exceptions themselves."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (exc, _) = min(failures.items())
        text = str(exc).strip().splitlines()
        return f"rank {rank}: {type(exc).__name__}: {text[0] if text else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
