"""Checkpoints of ``rrfp train``: sharded with ``torch.distributed.checkpoint`` (DCP), keyed by
the model's own parameter names, committed atomically, resumed under any layout.

What one checkpoint holds (every rank writes its share; DCP writes a tensor, or a piece of one,
once however many ranks hold it):

* ``model.<name>`` and ``optim.*``: the parameters and their AdamW state under the unsplit
  model's ``state_dict()`` names (:mod:`rrfp.train.dcp`): a checkpoint resumes under another
  ``--stages``, ``--virtual-stages``, ``--placement``, ``--tp``, ``--dp`` or ``--dp-shard``
  (DCP reassembles each tensor from the pieces written and reads each rank the pieces it holds
  now), and ``rrfp export`` reads it in one process (:mod:`rrfp.train.export`);
* ``train.step``: optimizer steps done; the data position is in ``rrfp.json`` (the sampler's
  seed, batch size and pool size, and the next step's index:
  :class:`~rrfp.data.batches.BatchSampler` is random access by step, so the next step's index
  *is* its state; a step's global batch does not depend on the layout);
* ``rng.pp{p}dp{d}tp{t}``: the torch, Python ``random`` and numpy generator states of the rank
  at those coordinates (a rank resumed at coordinates the checkpoint lacks takes those of
  ``(p % pp, d % dp, t % tp)`` of the written layout: draws, e.g. dropout's, then differ from
  an uninterrupted run's; the presets have no dropout).

``rrfp.json`` also records the layout it was written at, the learning-rate schedule's state,
the hint ``--hint auto`` kept (if any), the model's configuration (what ``rrfp export`` writes as
``config.json``) and the SHA-256 of every file (:mod:`rrfp.train.ckpt_verify`; a checkpoint
without them is refused). Checkpoints of format 1 and 2 (keyed by stage index) still load, at the
layout that wrote them.

Layout on disk (``--checkpoint-dir DIR``)::

    DIR/step-00000040/       a committed checkpoint: DCP's shards + .metadata + rrfp.json
    DIR/.tmp-step-00000042-<job>-<id>/   one being written (or left by a crash): never loaded
    DIR/.rrfp-lock           the job that owns the folder (rrfp.train.ckpt_lock)

A checkpoint is committed in three moves: every rank writes its shards into the ``.tmp-``
folder, DCP's coordinator (rank 0) writes ``.metadata`` once all shards are in, then rank 0
writes ``rrfp.json`` and renames the folder to ``step-N``. A rename is atomic, so a crash at any
point leaves either no new ``step-N`` or a whole one, and the previous checkpoint stays
loadable. ``--resume auto`` takes the newest ``step-N`` that has ``rrfp.json``. ``<job>`` is the
job's tag (:func:`~rrfp.train.ckpt_lock.job_tag`): pruning deletes only the job's own
half-written folders, never another job's.
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

FORMAT = 3
_FORMATS = (1, 2, 3)  # 1: one pipeline, RNG states keyed ``rank{pp_rank}``; 1-2: keyed by stage index
_STEP_DIR = re.compile(r"^step-(\d{8})$")

CRASH_ENV = "RRFP_TEST_CRASH_IN_CHECKPOINT"
"""Test hook, ``RANK:STEP``: that rank SIGKILLs itself while writing the checkpoint of that
step, after its own shard is on disk and before the checkpoint is committed, in the first
attempt of the job only (``TORCHELASTIC_RESTART_COUNT`` 0). It lets a test kill a writer at a
chosen point instead of racing a timer."""

FORMAT_ENV = "RRFP_TEST_CHECKPOINT_FORMAT"
"""Test hook: ``2`` writes checkpoints keyed by stage index, as rrfp did before format 3, so a
test can check that those still load."""

LAYOUT_KEYS = ("stages", "virtual_stages", "placement", "model", "max_len", "tp")
"""Flags a checkpoint of format 1-2 must be resumed with (the shapes and keys of its shards
depend on them); ``--dp`` may change."""
MODEL_KEYS = ("model", "max_len")
"""Flags a checkpoint of format 3 must be resumed with: the layout may change, the model not."""
_DEFAULTS = {"tp": 1, "dp": 1, "dp_shard": "none"}  # flags of checkpoints written before they were recorded
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
        problem = occupied(args) or check_writable(args.checkpoint_dir)
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
        from .._launch_env import in_launched_worker

        problem = _resume_problem(path, args, what, files=False)
        if problem is None and not in_launched_worker():
            # Before any process starts; the ranks check again, each its share (Checkpointer.load).
            from .ckpt_verify import check_files

            problem = check_files(path, read_meta(path))
            if problem is not None and args.resume == "auto":
                older = _intact_before(args)
                if older is not None:
                    problem += f"; the newest intact one is {older!r} (resume it with --resume {older})"
        return problem
    return None


def _resume_problem(path: str | os.PathLike, args: argparse.Namespace, what: str, files: bool) -> str | None:
    """Why this run cannot resume the checkpoint ``path`` (``what`` names it in the line), or
    None: unreadable, written for another run, past ``--steps``, or with ``files`` its files not
    the ones written with it."""
    try:
        meta = read_meta(path)
    except ValueError as e:
        return f"{what}: {e}"
    problem = check_compatible(meta, args, what)
    if problem is None and meta["step"] > args.steps:
        problem = (f"{what} is at step {meta['step']}, past --steps={args.steps}: --steps counts every "
                   f"optimizer step of the run, expected at least {meta['step']}")
    if problem is None and files:
        from .ckpt_verify import check_files

        problem = check_files(path, meta)
    return problem


def _intact_before(args: argparse.Namespace) -> str | None:
    """The newest committed checkpoint before the newest in ``--checkpoint-dir`` that this run
    could resume (:func:`_resume_problem`), or None: the way on when ``--resume auto``'s newest
    is damaged (never taken silently: which step to lose is the user's call)."""
    for path in reversed(committed(args.checkpoint_dir)[:-1]):
        if _resume_problem(path, args, os.fspath(path), files=True) is None:
            return os.fspath(path)
    return None


def occupied(args: argparse.Namespace) -> str | None:
    """Why a run without ``--resume`` may not write into ``--checkpoint-dir`` (the line after
    the flag's name): the folder holds committed checkpoints already (an earlier run's), and this
    run's would overwrite some of them and be pruned among the rest, two runs mixed in one
    folder. None: the folder holds none, or ``--resume`` continues them.
    Checked by the launcher only: a rank starts after its own launcher's check, when its run's
    checkpoints may be there already."""
    from .._launch_env import in_launched_worker

    if args.resume is not None or in_launched_worker() or (newest := latest(args.checkpoint_dir)) is None:
        return None
    n, step = len(committed(args.checkpoint_dir)), int(_STEP_DIR.match(newest.name).group(1))
    return (f"holds {n} committed checkpoint{'s' * (n > 1)} of an earlier run "
            f"(newest: step {step}, {newest.name}): expected --resume auto to continue it, or an empty or new folder")


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
    """Why a checkpoint cannot resume this run (another model or data stream; for a checkpoint
    keyed by stage index, another layout), or None."""
    from .models import model_difference

    by_stage = meta["format"] < 3
    for key in (LAYOUT_KEYS if by_stage else MODEL_KEYS) + DATA_KEYS:
        have, want = meta["args"].get(key, _DEFAULTS.get(key)), getattr(args, key, _DEFAULTS.get(key))
        if key == "model":  # hf:qx and hf:/abs/qx name one model: compared by its configuration
            why = model_difference(have, meta.get("model_config"), args)
            if why is not None:
                return f"{what} was written with --model {have}, this run has --model {want}: expected the same{why}"
        elif have != want:
            flag = "--pp" if key == "stages" else "--" + key.replace("_", "-")  # --stages: an alias
            why = (f" (a checkpoint of format {meta['format']}, keyed by stage index, resumes under another --dp "
                   "only)") if by_stage and key not in MODEL_KEYS else ""
            return f"{what} was written with {flag} {have}, this run has {flag} {want}: expected the same{why}"
    return None


# ----------------------------------------------------------------------------- finding
def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def read_meta(path: str | os.PathLike) -> dict:
    """The ``rrfp.json`` of a committed checkpoint folder.

    Raises:
        ValueError: one line if ``path`` is not a committed rrfp checkpoint; for a
            ``--checkpoint-dir`` (step folders inside), naming the newest committed one.
    """
    f = Path(path) / META_FILE
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        inside = committed(path)  # a --checkpoint-dir given where one of its step folders was meant
        hint = (f": a checkpoint folder holding {len(inside)} committed checkpoint{'s' * (len(inside) > 1)}, "
                f"expected one of them, e.g. the newest {os.fspath(inside[-1])!r}") if inside else ""
        raise ValueError(f"not a committed checkpoint (no {META_FILE} in {os.fspath(path)!r}){hint}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {META_FILE}: {e}") from None
    from .ckpt_verify import meta_problem

    if problem := meta_problem(meta, os.fspath(f), _FORMATS):
        raise ValueError(problem)
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
        schedule: the learning-rate scheduler (its state is saved and restored), or None.
        chooser: the ``--hint auto`` controller, whose kept hint is recorded, or None.

    Saving and loading raise ValueError (one line) for a stage module without a map to the
    unsplit model's names (:func:`rrfp.model.names.full_names`).
    """

    def __init__(self, args: argparse.Namespace, layout, stages, optimizer, n_samples: int = 0,
                 schedule=None, chooser=None) -> None:
        self.args = args
        self.layout = layout
        self.rank = layout.rank
        self.n_ranks = layout.pp * layout.dp * layout.tp
        self.root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        self.stages, self.optimizer, self.schedule, self.chooser = stages, optimizer, schedule, chooser
        self.n_samples = n_samples
        self._keyed = None
        self.model_config = model_config(stages) if self.rank == 0 else None
        self.last_saved: int | None = None

    # ------------------------------------------------------------------ state dicts
    @property
    def keyed(self):
        """The name-keyed state (:class:`~rrfp.train.dcp.NameKeyed`), built when first needed:
        importing DCP takes seconds, which a run without checkpoints does not spend."""
        if self._keyed is None:
            from .dcp import NameKeyed

            self._keyed = NameKeyed(self.stages, self.optimizer, self.layout.tp_rank, self.layout.tp)
        return self._keyed

    def _by_stage(self):
        from .dcp import StageKeyed

        return StageKeyed(self.stages, self.optimizer, self.layout.tp_rank, self.layout.tp)

    def _rng_key(self, meta: dict | None = None) -> str:
        """This rank's RNG entry; in a checkpoint ``meta`` of another layout, the entry at the
        coordinates modulo that layout's degrees."""
        lay = self.layout
        if meta is not None and meta["format"] == 1:
            return f"rank{lay.pp_rank}"
        a = {} if meta is None else meta["args"]
        pp, dp, tp = a.get("stages", lay.pp), a.get("dp", 1 if a else lay.dp), a.get("tp", 1 if a else lay.tp)
        return f"rng.pp{lay.pp_rank % pp}dp{lay.dp_rank % dp}tp{lay.tp_rank % tp}"

    def _state(self, keyed, step: int, meta: dict | None = None) -> dict:
        return {**keyed.state(), "train": {"step": step}, self._rng_key(meta): {"rng": _rng_state()}}

    def _meta(self, step: int, fmt: int) -> dict:
        meta = {
            "format": fmt,
            "step": step,
            "world_size": self.n_ranks,
            "args": {k: getattr(self.args, k, _DEFAULTS.get(k)) for k in LAYOUT_KEYS + DATA_KEYS + ("dp", "dp_shard")},
            "data": {"next_step": step, "n_samples": self.n_samples},
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        }
        if fmt >= 3:
            meta["lr_schedule"] = None if self.schedule is None else self.schedule.state_dict()
            meta["hint"] = None if self.chooser is None else self.chooser.chosen
            meta["model_config"] = self.model_config
        return meta

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

        from .dcp import SavePlanner

        writer = _crashing_writer(tmp, self.rank, step) if _crash_requested(self.rank, step) else digesting_writer(tmp)
        fmt = 2 if os.environ.get(FORMAT_ENV) == "2" else FORMAT
        dcp.save(self._state(self.keyed if fmt >= 3 else self._by_stage(), step), storage_writer=writer,
                 planner=SavePlanner())
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
            _commit(tmp, final, {**self._meta(step, fmt), "files": files})
            self._prune(step)
        dist.barrier()  # nobody reports the checkpoint before it is committed
        self.last_saved = step
        return final

    def _prune(self, step: int) -> None:
        # The checkpoint just committed (and reported) stays whatever its step: a run resumed
        # from an older checkpoint of this folder commits below its newest ones.
        final = step_dir(self.root, step)
        others = [d for d in committed(self.root) if d != final]
        for old in others[:len(others) - (self.args.checkpoint_keep - 1)]:
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
            ValueError: the checkpoint is not committed, its files differ from their digests
                (or it has none), or it was written for another model or data stream (a
                checkpoint of format 1-2: another layout).
        """
        import torch.distributed.checkpoint as dcp

        from .dcp import LoadPlanner

        meta = read_meta(path)
        problem = check_compatible(meta, self.args, f"checkpoint {os.fspath(path)!r}")
        if problem is None and self.n_samples and meta["data"]["n_samples"] not in (0, self.n_samples):
            problem = (f"checkpoint {os.fspath(path)!r} drew batches from {meta['data']['n_samples']} samples, "
                       f"this run has {self.n_samples}: expected the same --data")
        if problem:
            raise ValueError(problem)
        self._check_files(path, meta)
        keyed = self.keyed if meta["format"] >= 3 else self._by_stage()
        state = self._state(keyed, 0, meta)
        from torch.distributed.checkpoint.api import CheckpointException

        from .ckpt_verify import first_line

        try:
            dcp.load(state, checkpoint_id=os.fspath(path), planner=LoadPlanner())
        except CheckpointException as e:  # a BaseException, whose text is every rank's traceback
            raise ValueError(f"checkpoint {os.fspath(path)!r}: cannot load its shards: {first_line(e)}") from None
        step = int(state["train"]["step"])
        if step != meta["step"] or meta["data"]["next_step"] != step:
            raise ValueError(f"checkpoint {os.fspath(path)!r}: step {step} in the shards, {meta['step']} in {META_FILE}")
        self._resume_schedule(meta, step)
        keyed.apply(state)
        _set_rng_state(state[self._rng_key(meta)]["rng"])
        self.last_saved = step
        return step

    def _resume_schedule(self, meta: dict, step: int) -> None:
        """The learning-rate schedule as it was after ``step`` steps: its saved state, or, for
        a checkpoint written before that was saved, the schedule stepped ``step`` times from
        its start, as the run that wrote it stepped it (before the optimizer's state, whose
        learning rate the recursive schedules start from, is loaded over the fresh one)."""
        if self.schedule is None:
            return
        if meta.get("lr_schedule") is not None:
            self.schedule.load_state_dict(meta["lr_schedule"])
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()": on purpose
            for _ in range(step):
                self.schedule.step()

    def _check_files(self, path: str | os.PathLike, meta: dict) -> None:
        """Every rank hashes its share of the shard files against the digests written with
        them (rank 0 also ``.metadata``), then all agree on the first problem (collective).

        Raises:
            ValueError: one line naming the damaged file, on every rank.
        """
        import torch.distributed as dist

        from .ckpt_verify import METADATA, check_files, shard_names

        share = shard_names(meta)[self.rank::self.n_ranks] + ([METADATA] if self.rank == 0 else [])
        problems = [None] * self.n_ranks
        dist.all_gather_object(problems, check_files(path, meta, only=share))
        problem = next((p for p in problems if p), None)
        if problem:
            raise ValueError(problem)


def model_config(stages) -> dict | None:
    """What ``rrfp export`` needs to write the model's ``config.json``: the configuration of a
    stage (every stage of a model holds the same), ``{"kind": "hf", "config": ...}`` for a
    ``transformers`` model, ``{"kind": "gpt", "config": ...}`` for a GPT preset, or None."""
    import dataclasses

    from ..model.gpt import GPTConfig

    mod = stages[0].submod
    config = getattr(mod, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        return {"kind": "hf", "config": json.loads(config.to_json_string(use_diff=False))}
    cfg = getattr(mod, "cfg", None)
    if isinstance(cfg, GPTConfig):
        return {"kind": "gpt", "config": dataclasses.asdict(cfg)}
    return None


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
