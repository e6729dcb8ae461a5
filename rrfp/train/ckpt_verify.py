"""Checking a checkpoint's files before loading them: a damaged checkpoint is one line naming
the file, not a wall of tracebacks from every rank (or, worse, silently wrong weights).

``torch.distributed.checkpoint`` (DCP) stores each tensor as a ``torch.save`` record inside a
shard file (``__<rank>_<n>.distcp``) at an offset listed in ``.metadata``. It has no checksum:
a truncated shard fails deep inside ``torch.load`` on the rank that reads it, and flipped bytes
inside a tensor's data load without any error. So each rank hashes the shard files it wrote
(:func:`digesting_writer`), rank 0 records the digests in ``rrfp.json`` with the checkpoint,
and :func:`check_files` compares them before anything is loaded. A checkpoint without a digest
for each of its files (its ``files`` map deleted or cut) is refused: it cannot be verified.

Also one line each for the other ways a checkpoint goes wrong: an ``rrfp.json`` whose fields
do not have their types (:func:`meta_problem`, the one place its structure is checked, called
by :func:`rrfp.train.checkpoint.read_meta`), and a save that fails, a full disk above all
(:func:`save_errors`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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


class CheckpointNotSaved(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost mount); the previous one stands."""


@contextlib.contextmanager
def save_errors(root: str | os.PathLike, step: int, rank: int):
    """Around a checkpoint's save (collective): a failure to write it, which DCP reports as a
    ``CheckpointException`` holding every rank's traceback (a ``BaseException``, hundreds of
    lines), becomes one :class:`CheckpointNotSaved` line naming the folder, the step and the
    root error (``No space left on device``). Rank 0 then deletes the job's half-written
    folder, so its space is free again; the last committed checkpoint is untouched.

    Raises:
        CheckpointNotSaved: the save failed.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, OSError) as e:
        cause = first_line(e) if isinstance(e, CheckpointException) else f"{type(e).__name__}: {e}"
        if "No space left" not in cause and (full := disk_full(root)):
            cause = f"{full}; {cause}"  # torch's zip writer reports a full disk as "unexpected pos"
        if rank == 0:
            from .ckpt_lock import remove_tmp

            remove_tmp(root)
        raise CheckpointNotSaved(f"the checkpoint of step {step} could not be written in {os.fspath(root)!r} "
                                 f"({cause}); the last committed checkpoint is kept") from None


FULL_BELOW_BYTES = 16 << 20
"""After a failed save, a folder whose file system has less than this free (16 MiB) is
reported as full: the failed writes filled it up to the last block."""


def disk_full(root: str | os.PathLike) -> str | None:
    """``No space left on device (N bytes free)`` when ``root``'s file system has less than
    :data:`FULL_BELOW_BYTES` free for unprivileged writers, else None."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"No space left on device ({free} bytes free)" if free < FULL_BELOW_BYTES else None


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


ARG_TYPES = {"stages": int, "virtual_stages": int, "placement": str, "model": str, "max_len": int, "tp": int,
             "dp": int, "dp_shard": str, "seed": int, "batch_size": int}
"""The flags ``rrfp.json`` records (``args``) and their types, checked where present; the model
(:data:`_ARGS_REQUIRED`) is always there, the others are compared with the run's flags (a
missing one is named as a mismatch) or default (written before they were recorded)."""
_ARGS_REQUIRED = ("model",)
_SHA256 = frozenset("0123456789abcdef")


def meta_problem(meta, where: str, formats: tuple[int, ...]) -> str | None:
    """What is wrong with the structure of a checkpoint's ``rrfp.json`` (parsed), as one line
    naming ``where`` (the file), the field and what was expected; None when every field that
    resuming or exporting reads has its type (a damaged or hand-edited file is refused here,
    not by a ``KeyError`` deep in a rank).

    Args:
        meta: the parsed JSON.
        where: the file, for the line.
        formats: the formats this rrfp reads.
    """
    if not isinstance(meta, dict):
        return f"{where}: {_kind(meta)}, expected an rrfp checkpoint description (an object)"
    if meta.get("format") not in formats:
        return (f"{where}: \"format\" is {meta.get('format')!r}, expected an rrfp checkpoint description of "
                f"format {' or '.join(map(str, formats))}")
    for key, want in (("step", "a number of steps >= 0"), ("world_size", "a number of ranks >= 1")):
        if key in meta or key == "step":
            v = meta.get(key)
            if not _int(v) or v < (key == "world_size"):
                return f"{where}: \"{key}\" is {_kind(v)}, expected {want}"
    return _args_problem(meta.get("args"), where) or _data_problem(meta.get("data"), where) \
        or _files_problem(meta.get("files"), where) or _extras_problem(meta, where)


def _args_problem(a, where: str) -> str | None:
    if not isinstance(a, dict):
        return f"{where}: \"args\" is {_kind(a)}, expected an object of the run's flags"
    for key, typ in ARG_TYPES.items():
        if key not in a and key not in _ARGS_REQUIRED:
            continue
        v = a.get(key)
        if not (_int(v) if typ is int else isinstance(v, typ)):
            return f"{where}: \"args.{key}\" is {_kind(v)}, expected {'an integer' if typ is int else 'a string'}"
    return None


def _data_problem(d, where: str) -> str | None:
    if not isinstance(d, dict):
        return f"{where}: \"data\" is {_kind(d)}, expected an object with next_step and n_samples"
    for key in ("next_step", "n_samples"):
        if not _int(d.get(key)) or d[key] < 0:
            return f"{where}: \"data.{key}\" is {_kind(d.get(key))}, expected an integer >= 0"
    return None


def _files_problem(files, where: str) -> str | None:
    if files is None:
        return None  # absent: check_files refuses a checkpoint without digests, naming it
    if not isinstance(files, dict):
        return f"{where}: \"files\" is {_kind(files)}, expected an object of file names and digests"
    for name, d in files.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return f"{where}: \"files\" names {name!r}, expected a file name inside the checkpoint folder"
        ok = isinstance(d, dict) and _int(d.get("bytes")) and d["bytes"] >= 0 and isinstance(d.get("sha256"), str) \
            and len(d["sha256"]) == 64 and set(d["sha256"]) <= _SHA256
        if not ok:
            return f"{where}: \"files.{name}\" is {_kind(d)}, expected {{\"bytes\": size, \"sha256\": 64 hex digits}}"
    return None


def _extras_problem(meta: dict, where: str) -> str | None:
    for key, typ, want in (("lr_schedule", dict, "an object or null"), ("hint", str, "a hint name or null"),
                           ("model_config", dict, "an object or null"), ("run_id", str, "a string or null")):
        v = meta.get(key)
        if v is not None and not isinstance(v, typ):
            return f"{where}: \"{key}\" is {_kind(v)}, expected {want}"
    mc = meta.get("model_config")
    if mc and not (isinstance(mc.get("kind"), str) and isinstance(mc.get("config"), dict)):
        return f"{where}: \"model_config\" lacks its kind or config, expected {{\"kind\": ..., \"config\": {{...}}}}"
    return None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v) -> str:
    """A JSON value, shortly: ``a list``, ``an empty object``, ``the string 'x'``, ``-3``."""
    if v is None:
        return "missing or null"
    if isinstance(v, bool) or _int(v) or isinstance(v, float):
        return json.dumps(v)
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    if isinstance(v, list):
        return "an empty list" if not v else "a list"
    return "an empty object" if not v else "an object"
