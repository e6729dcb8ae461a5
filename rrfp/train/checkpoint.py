"""Checkpoints of ``rrfp train``: sharded with ``torch.distributed.checkpoint`` (DCP), committed
atomically, resumed bit for bit.

What one checkpoint holds (every rank writes its own part; the keys never collide because
every model key carries its stage index):

* ``model.stage{s}.<name>``: the parameters of stage ``s`` (its :class:`~rrfp.model.gpt.GPTStage`
  names; with ``--tp`` above 1, ``model.stage{s}.tp{t}.<name>``: TP rank ``t``'s shard), and
  ``optim.*``: the AdamW state of the same parameters, keyed the same way
  (``torch.distributed.checkpoint.state_dict.get_state_dict``). DP replicas hold equal copies
  under equal keys: DCP writes each key once and every replica reads it back, so a checkpoint
  resumes under another ``--dp`` (DCP's resharding; the global batch of a step does not depend
  on ``--dp``). Another ``--tp`` or pipeline layout is refused (:data:`LAYOUT_KEYS`);
* ``train.step``: optimizer steps done; ``train.data``: the data position (the sampler's seed,
  batch size and pool size, and the next step's index: :class:`~rrfp.data.batches.BatchSampler`
  is random access by step, so the next step's index *is* its state);
* ``rng.pp{p}dp{d}tp{t}``: the torch, Python ``random`` and numpy generator states of the rank
  at those coordinates (a rank resumed at a DP index the checkpoint lacks takes replica
  ``d % dp``'s).

Layout on disk (``--checkpoint-dir DIR``)::

    DIR/step-00000040/       a committed checkpoint: DCP's shards + .metadata + rrfp.json
    DIR/.tmp-step-00000042-<job>-<id>/   one being written (or left by a crash): never loaded
    DIR/.rrfp-lock           the job that owns the folder (rrfp.train.ckpt_lock)

A checkpoint is committed in three moves: every rank writes its shards into the ``.tmp-``
folder, DCP's coordinator (rank 0) writes ``.metadata`` once all shards are in, then rank 0
writes ``rrfp.json`` (the layout and step) and renames the folder to ``step-N``. A rename is
atomic, so a crash at any point leaves either no new ``step-N`` or a whole one, and the
previous checkpoint stays loadable. ``--resume auto`` takes the newest ``step-N`` that has
``rrfp.json``. ``<job>`` is the job's tag (:func:`~rrfp.train.ckpt_lock.job_tag`): pruning
deletes only the job's own half-written folders, never another job's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import uuid
import warnings
from pathlib import Path

META_FILE = "rrfp.json"
"""Written last into a checkpoint, just before the rename that commits it."""

FORMAT = 2
_FORMATS = (1, 2)  # 1: one pipeline, RNG states keyed ``rank{pp_rank}``
_STEP_DIR = re.compile(r"^step-(\d{8})$")

CRASH_ENV = "RRFP_TEST_CRASH_IN_CHECKPOINT"
"""Test hook, ``RANK:STEP``: that rank SIGKILLs itself while writing the checkpoint of that
step, after its own shard is on disk and before the checkpoint is committed, in the first
attempt of the job only (``TORCHELASTIC_RESTART_COUNT`` 0). It lets a test kill a writer at a
chosen point instead of racing a timer."""

LAYOUT_KEYS = ("stages", "virtual_stages", "placement", "model", "max_len", "tp")
"""Flags a checkpoint must be resumed with (the shapes and keys of its shards depend on them);
``--dp`` may change."""
_DEFAULTS = {"tp": 1, "dp": 1}  # flags of checkpoints written before they were recorded
DATA_KEYS = ("seed", "batch_size")


# ----------------------------------------------------------------------------- flags
def add_flags(p: argparse.ArgumentParser) -> None:
    """``--checkpoint-dir``, ``--checkpoint-every``, ``--checkpoint-keep`` and ``--resume``."""
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="write sharded checkpoints (torch.distributed.checkpoint) under DIR, one folder per step")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint every N steps (0: only at the end and on a graceful stop)")
    p.add_argument("--checkpoint-keep", type=int, default=3, metavar="K",
                   help="keep the newest K committed checkpoints, delete older ones")
    p.add_argument("--resume", metavar="auto|PATH", default=None,
                   help="resume from a checkpoint: 'auto' takes the newest committed one in --checkpoint-dir "
                   "(none there: start from step 0), or a checkpoint folder")


def check_flags(args: argparse.Namespace) -> str | None:
    """The first problem with the checkpoint flags as one line, or None. Creates
    ``--checkpoint-dir`` and checks that it is writable (before any process starts)."""
    if args.checkpoint_every < 0:
        return f"--checkpoint-every={args.checkpoint_every}: expected 0 (only at the end) or a positive number of steps"
    if args.checkpoint_keep < 1:
        return f"--checkpoint-keep={args.checkpoint_keep}: expected a positive integer"
    if args.checkpoint_every and args.checkpoint_dir is None:
        return "--checkpoint-every needs --checkpoint-dir DIR"
    if args.checkpoint_dir is not None:
        problem = check_writable(args.checkpoint_dir)
        if problem:
            return f"--checkpoint-dir={args.checkpoint_dir!r}: {problem}"
    if args.resume is not None:
        if args.resume == "auto":
            if args.checkpoint_dir is None:
                return "--resume auto needs --checkpoint-dir DIR (where to look for checkpoints)"
            path = latest(args.checkpoint_dir)
            if path is None:
                return None  # nothing yet: the run starts from step 0
            what = f"--resume auto (newest checkpoint {os.fspath(path)!r})"
        else:
            path, what = args.resume, f"--resume={args.resume!r}"
        try:
            meta = read_meta(path)
        except ValueError as e:
            return f"{what}: {e}"
        problem = check_compatible(meta, args, what)
        if problem is None and meta["step"] > args.steps:
            problem = (f"{what} is at step {meta['step']}, past --steps={args.steps}: --steps counts every "
                       f"optimizer step of the run, expected at least {meta['step']}")
        from .._launch_env import in_launched_worker

        if problem is None and not in_launched_worker():
            # Before any process starts; the ranks check again, each its share (Checkpointer.load).
            from .ckpt_verify import check_files

            problem = check_files(path, meta)
        return problem
    return None


def nothing_to_do(args: argparse.Namespace, path: str | os.PathLike | None = None) -> str | None:
    """The line ``rrfp train`` prints, exiting 0, when ``--resume`` names a checkpoint at
    ``--steps`` already (a finished run started again, e.g. a restarted job), or None. A
    checkpoint past ``--steps`` is refused instead (:func:`check_flags`).

    Args:
        path: the checkpoint resumed from; None: the one ``--resume`` names.
    """
    if path is None:
        if args.resume is None:
            return None
        path = latest(args.checkpoint_dir) if args.resume == "auto" else args.resume
        if path is None:
            return None
    step = read_meta(path)["step"]
    if step < args.steps:
        return None
    return (f"rrfp train: nothing to do: checkpoint {os.fspath(path)} is at step {step}, --steps={args.steps} "
            "(--steps counts every optimizer step of the run: raise it to train further)")


def check_writable(path: str | os.PathLike) -> str | None:
    """Create ``path`` if needed and try writing a file there; the reason it fails, or None."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".rrfp-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"not a writable folder ({e.strerror or e})"
    return None


def check_compatible(meta: dict, args: argparse.Namespace, what: str) -> str | None:
    """Why a checkpoint cannot resume this run (another layout, model or data stream), or None."""
    for key in LAYOUT_KEYS + DATA_KEYS:
        have, want = meta["args"].get(key, _DEFAULTS.get(key)), getattr(args, key, _DEFAULTS.get(key))
        if have != want:
            flag = "--pp" if key == "stages" else "--" + key.replace("_", "-")  # --stages: an alias
            why = " (a checkpoint resumes under another --dp only)" if key in LAYOUT_KEYS else ""
            return f"{what} was written with {flag} {have}, this run has {flag} {want}: expected the same{why}"
    return None


# ----------------------------------------------------------------------------- finding
def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def read_meta(path: str | os.PathLike) -> dict:
    """The ``rrfp.json`` of a committed checkpoint folder.

    Raises:
        ValueError: one line if ``path`` is not a committed rrfp checkpoint.
    """
    f = Path(path) / META_FILE
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise ValueError(f"not a committed checkpoint (no {META_FILE} in {os.fspath(path)!r})") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {META_FILE}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS or not isinstance(meta.get("step"), int):
        raise ValueError(f"{f} is not an rrfp checkpoint description of format {' or '.join(map(str, _FORMATS))}")
    return meta


def committed(root: str | os.PathLike) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first. Folders being written or left
    half-written by a crash (``.tmp-*``) and folders without ``rrfp.json`` are not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / META_FILE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under ``root``, or None."""
    found = committed(root)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- state
def _rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is a dependency, but the state is not essential to training
        pass
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


class Checkpointer:
    """One rank's side of saving and resuming (collective: every rank calls the same methods
    at the same steps).

    Args:
        args: the ``rrfp train`` flags (``checkpoint_dir``, ``resume``, the layout).
        layout: this rank's :class:`~rrfp.parallel.layout.ParallelLayout` (global rank,
            world size ``pp * dp * tp``, coordinates).
        stages: this rank's :class:`~rrfp.runtime.engine.stage.PipelineStage` objects.
        optimizer: the optimizer over exactly these stages' parameters.
        n_samples: size of the sample pool the sampler draws from (0 on ranks without data).
    """

    def __init__(self, args: argparse.Namespace, layout, stages, optimizer, n_samples: int = 0) -> None:
        self.args = args
        self.layout = layout
        self.rank = layout.rank
        self.n_ranks = layout.pp * layout.dp * layout.tp
        self.root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        self.optimizer = optimizer
        self.n_samples = n_samples
        import torch

        # One module whose parameter names carry the stage index (and the TP rank: a shard),
        # so DCP's keys say which stage a tensor belongs to, and only DP replicas share keys.
        def part(m):
            return torch.nn.ModuleDict({f"tp{layout.tp_rank}": m}) if layout.tp > 1 else m

        self.module = torch.nn.ModuleDict({f"stage{s.stage_index}": part(s.submod) for s in stages})
        self.last_saved: int | None = None

    # ------------------------------------------------------------------ state dicts
    def _rng_key(self, meta: dict | None = None) -> str:
        """This rank's RNG entry; in a checkpoint ``meta`` of another ``--dp``, the entry of
        replica ``dp_rank % dp`` at the same coordinates."""
        lay = self.layout
        if meta is not None and meta["format"] == 1:
            return f"rank{lay.pp_rank}"
        dp = lay.dp if meta is None else meta["args"].get("dp", 1)
        return f"rng.pp{lay.pp_rank}dp{lay.dp_rank % dp}tp{lay.tp_rank}"

    def _state(self, step: int, meta: dict | None = None) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # Flattened: every optimizer entry keyed by its parameter's name (``state.stage1.x.exp_avg``,
        # ``param_groups.stage1.x.lr``), so no two ranks write the same key.
        model, optim = get_state_dict(self.module, self.optimizer, options=_options())
        return {
            "model": model,
            "optim": optim,
            "train": {"step": step},
            self._rng_key(meta): {"rng": _rng_state()},
        }

    def _meta(self, step: int) -> dict:
        return {
            "format": FORMAT,
            "step": step,
            "world_size": self.n_ranks,
            "args": {k: getattr(self.args, k, _DEFAULTS.get(k)) for k in LAYOUT_KEYS + DATA_KEYS + ("dp",)},
            "data": {"next_step": step, "n_samples": self.n_samples},
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        }

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> Path:
        """Write and commit the checkpoint of ``step`` optimizer steps done (collective).

        Returns:
            The committed folder ``DIR/step-NNNNNNNN``.
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        assert self.root is not None
        from .ckpt_lock import job_tag

        token = [f"{job_tag()}-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)  # every rank writes into the same folder
        tmp = self.root / f".tmp-step-{step:08d}-{token[0]}"
        from .ckpt_verify import METADATA, digest, digesting_writer

        writer = _crashing_writer(tmp, self.rank, step) if _crash_requested(self.rank, step) else digesting_writer(tmp)
        dcp.save(self._state(step), storage_writer=writer)
        # Every rank hashed the shards it wrote; rank 0 records them all with the checkpoint.
        digests = [None] * self.n_ranks if self.rank == 0 else None
        dist.gather_object(getattr(writer, "digests", {}), digests, dst=0)
        final = step_dir(self.root, step)
        if self.rank == 0:
            files = {name: d for part in digests for name, d in (part or {}).items()}
            files[METADATA] = digest(tmp / METADATA)
            from .ckpt_lock import check_owner

            if (other := check_owner(self.root)) is not None:  # our lease ran out while we hung
                shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(f"--checkpoint-dir={os.fspath(self.root)!r} was taken over by job {other!r}: "
                                 f"the checkpoint of step {step} is not committed")
            _commit(tmp, final, {**self._meta(step), "files": files})
            self._prune()
        dist.barrier()  # nobody reports the checkpoint before it is committed
        self.last_saved = step
        return final

    def _prune(self) -> None:
        keep = self.args.checkpoint_keep
        for old in committed(self.root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        # Half-written folders of this job's crashed earlier attempts (this attempt's own are
        # gone); another job's are not ours to judge.
        from .ckpt_lock import remove_tmp

        remove_tmp(self.root)

    # ------------------------------------------------------------------ resume
    def resume_path(self) -> Path | None:
        """Which checkpoint ``--resume`` names (rank 0 decides; all ranks get its answer)."""
        import torch.distributed as dist

        if self.args.resume is None:
            return None
        choice = [None]
        if self.rank == 0:
            path = latest(self.root) if self.args.resume == "auto" else self.args.resume
            choice[0] = os.fspath(path) if path else None
        dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] else None

    def load(self, path: str | os.PathLike) -> int:
        """Load model, optimizer, RNG and data position from ``path`` (collective).

        Returns:
            The step to continue from (optimizer steps done).

        Raises:
            ValueError: the checkpoint is not committed or was written for another layout.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        meta = read_meta(path)
        problem = check_compatible(meta, self.args, f"checkpoint {os.fspath(path)!r}")
        if problem is None and self.n_samples and meta["data"]["n_samples"] not in (0, self.n_samples):
            problem = (f"checkpoint {os.fspath(path)!r} drew batches from {meta['data']['n_samples']} samples, "
                       f"this run has {self.n_samples}: expected the same --data")
        if problem:
            raise ValueError(problem)
        self._check_files(path, meta)
        state = self._state(0, meta)
        from torch.distributed.checkpoint.api import CheckpointException

        from .ckpt_verify import first_line

        try:
            dcp.load(state, checkpoint_id=os.fspath(path))
        except CheckpointException as e:  # a BaseException, whose text is every rank's traceback
            raise ValueError(f"checkpoint {os.fspath(path)!r}: cannot load its shards: {first_line(e)}") from None
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options())
        _set_rng_state(state[self._rng_key(meta)]["rng"])
        step = int(state["train"]["step"])
        if step != meta["step"] or meta["data"]["next_step"] != step:
            raise ValueError(f"checkpoint {os.fspath(path)!r}: step {step} in the shards, {meta['step']} in {META_FILE}")
        self.last_saved = step
        return step


    def _check_files(self, path: str | os.PathLike, meta: dict) -> None:
        """Every rank hashes its share of the shard files against the digests written with
        them (rank 0 also ``.metadata``), then all agree on the first problem (collective).

        Raises:
            ValueError: one line naming the damaged file, on every rank.
        """
        import torch.distributed as dist

        from .ckpt_verify import METADATA, check_files, shard_names

        if shard_names(meta):
            share = shard_names(meta)[self.rank::self.n_ranks] + ([METADATA] if self.rank == 0 else [])
        else:  # written before the digests: rank 0 checks that every shard is there and long enough
            share = None if self.rank == 0 else []
        problems = [None] * self.n_ranks
        dist.all_gather_object(problems, check_files(path, meta, only=share))
        problem = next((p for p in problems if p), None)
        if problem:
            raise ValueError(problem)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _commit(tmp: Path, final: Path, meta: dict) -> None:
    """Make ``tmp`` the committed checkpoint ``final``: description file (synced), then one
    atomic rename, then sync the parent folder so the rename survives a power cut."""
    f = tmp / META_FILE
    with open(f, "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():
        # The same step again (a resumed run re-reaching it): swap, old one out of the way first.
        old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crash_requested(rank: int, step: int) -> bool:
    spec = os.environ.get(CRASH_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    want_rank, _, want_step = spec.partition(":")
    return want_rank == str(rank) and want_step == str(step)


def _crashing_writer(path, rank: int, step: int):
    import sys

    import torch.distributed.checkpoint as dcp

    from ..lines import say

    class CrashingWriter(dcp.FileSystemWriter):
        """DCP's file writer that SIGKILLs its process once its shard is written (:data:`CRASH_ENV`)."""

        def __init__(self, path, rank: int, step: int) -> None:
            super().__init__(path)
            self._what = (rank, step)

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            fut.wait()
            say(f"rrfp train: rank {self._what[0]}: test hook {CRASH_ENV}: killed while writing the checkpoint "
                f"of step {self._what[1]}", sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)
            return fut

    return CrashingWriter(path, rank, step)


# ----------------------------------------------------------------------------- export
def export_problem(meta: dict, checkpoint: str | os.PathLike) -> str | None:
    """Why :func:`export` cannot write the model of checkpoint ``meta`` (torch-free), or None."""
    a = meta["args"]
    if a.get("tp", 1) != 1:
        return (f"checkpoint {os.fspath(checkpoint)!r} holds --tp {a['tp']} shards of each stage: export takes "
                "checkpoints written with --tp 1")
    if a.get("model") == "multimodal":
        return "a --model multimodal checkpoint: export writes the text models (the GPT presets and hf:<model>)"
    return None


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the model of a committed checkpoint as one state dict of the unsplit model: a
    GPT preset's :class:`~rrfp.model.gpt.GPT`, or for ``hf:<model>`` the ``transformers``
    model :func:`rrfp.model.hf.hf_model` builds.

    Reads only the ``model.*`` tensors (no process group: DCP's ``no_dist`` load), renames
    each stage's parameters to the full model's names (``stage1.blocks.0.x`` ->
    ``blocks.2.x``) and saves ``{name: tensor}`` with ``torch.save`` (written to a temporary
    file, then renamed). Load it with ``GPT(cfg).load_state_dict(torch.load(out))``, where
    ``cfg`` is the preset named in the returned description with its ``max_len``, or
    ``hf_model(spec, max_len=...).load_state_dict(torch.load(out))``.

    Returns:
        The checkpoint's description (``rrfp.json``).

    Raises:
        ValueError: ``checkpoint`` is not a committed checkpoint, a shard or ``.metadata`` is
            missing, truncated or differs from its recorded digest, it was written with
            ``--tp`` above 1 or ``--model multimodal``, or its stages do not cover the model.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .ckpt_verify import check_files

    meta = read_meta(checkpoint)
    if (problem := export_problem(meta, checkpoint) or check_files(checkpoint, meta)) is not None:
        raise ValueError(problem)  # the same check as --resume: a damaged shard is one line, not a traceback
    reader = dcp.FileSystemReader(os.fspath(checkpoint))
    md = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP notes it loads in one process: the intent
        dcp.load(state, storage_reader=reader, no_dist=True)
    full_name, expected = _export_names(meta["args"])
    full = {}
    for key, t in state.items():
        stage, name = key.removeprefix("model.").split(".", 1)
        full[full_name(int(stage.removeprefix("stage")), name)] = t
    if set(full) != expected:  # the reference model's names: nothing missing, nothing extra
        missing, extra = sorted(expected - set(full)), sorted(set(full) - expected)
        raise ValueError(f"checkpoint {os.fspath(checkpoint)!r} does not hold the whole model "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    torch.save(full, tmp)
    os.replace(tmp, out)
    return meta


def _export_names(a: dict):
    """``(full_name(stage, name), expected names)`` for the model a run of arguments ``a`` trained."""
    import dataclasses

    from ..model.gpt import GPT, GPT_PRESETS, _full_param_name, stage_layer_ranges
    from .models import HF_PREFIX

    n_stages = a["stages"] * a["virtual_stages"]
    if a["model"].startswith(HF_PREFIX):
        from ..model.hf import _family, _full_name, hf_layer_count, hf_model

        model = hf_model(a["model"][len(HF_PREFIX):], a["seed"], a["max_len"])
        fam = _family(model.config)
        ranges = stage_layer_ranges(hf_layer_count(model.config), n_stages)
        prefix = f"{fam.base}.{fam.layers}."
        return (lambda s, name: _full_name(name, prefix, ranges[s].start)), set(model.state_dict())
    cfg = dataclasses.replace(GPT_PRESETS[a["model"]], max_len=a["max_len"])
    ranges = stage_layer_ranges(cfg.n_layer, n_stages)
    return (lambda s, name: _full_param_name(name, ranges[s].start)), set(GPT(cfg).state_dict())
