"""A run without ``--resume`` refuses a ``--checkpoint-dir`` that holds an earlier run's committed
checkpoints (one line, exit 2, nothing touched), and pruning never deletes the checkpoint a run
just committed and reported."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rrfp.train import checkpoint
from rrfp.train.checkpoint import Checkpointer, check_flags, committed, step_dir


def _args(root, resume=None, keep=3) -> argparse.Namespace:
    return argparse.Namespace(checkpoint_every=0, checkpoint_keep=keep, checkpoint_dir=os.fspath(root),
                              resume=resume, steps=4)


def _fake(root, *steps) -> None:
    """Committed-looking step folders (a step folder with its description file is what
    :func:`committed` lists)."""
    for s in steps:
        d = step_dir(root, s)
        d.mkdir(parents=True)
        (d / checkpoint.META_FILE).write_text(json.dumps({"step": s}))


def _listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_folder_with_committed_checkpoints_is_refused_without_resume(tmp_path):
    _fake(tmp_path, 8, 12, 14)
    problem = check_flags(_args(tmp_path))
    assert problem == (f"--checkpoint-dir={os.fspath(tmp_path)!r}: holds 3 committed checkpoints of an earlier run "
                       "(newest: step 14, step-00000014): expected --resume auto to continue it, or an empty or new folder")


def test_empty_new_or_half_written_folders_are_accepted_and_resume_auto_starts_at_step_0(tmp_path):
    assert check_flags(_args(tmp_path / "new")) is None
    assert check_flags(_args(tmp_path / "new", resume="auto")) is None  # empty: starts from step 0
    assert checkpoint.nothing_to_do(_args(tmp_path / "new", resume="auto")) is None
    crashed = tmp_path / "crashed"
    (crashed / ".tmp-step-00000002-job-abc").mkdir(parents=True)  # never committed: no run's checkpoint
    (crashed / "step-00000004").mkdir()  # no description file: not committed either
    assert check_flags(_args(crashed)) is None


def test_the_refusal_is_exit_2_one_line_before_anything_runs_and_touches_nothing(tmp_path):
    ck = tmp_path / "ck"
    _fake(ck, 4)
    before = _listing(ck)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "rrfp", "train", "--stages", "2", "--steps", "2", "--seed", "1",
                          "--checkpoint-dir", os.fspath(ck)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds 1 committed checkpoint of an earlier run (newest: step 4" in lines[0]
    assert "--resume auto" in lines[0]
    assert _listing(ck) == before


def _pruner(root, keep) -> Checkpointer:
    c = Checkpointer.__new__(Checkpointer)  # _prune reads only these two
    c.root, c.args = root, _args(root, keep=keep)
    return c


def test_pruning_keeps_the_checkpoint_just_committed_below_newer_ones(tmp_path):
    # A run resumed from step 8 of a folder holding 8/12/14 commits step 10: with the newest-K
    # rule alone, keep=1 would delete 10 at once, right after reporting it committed.
    _fake(tmp_path, 8, 10, 12, 14)
    _pruner(tmp_path, keep=1)._prune(10)
    assert [p.name for p in committed(tmp_path)] == ["step-00000010"]
    _fake(tmp_path, 12, 14)
    _pruner(tmp_path, keep=3)._prune(10)  # 10 plus the newest two others
    assert [p.name for p in committed(tmp_path)] == ["step-00000010", "step-00000012", "step-00000014"]


def test_pruning_keeps_the_newest_k_in_a_forward_run(tmp_path):
    _fake(tmp_path, 2, 4, 6, 8)
    _pruner(tmp_path, keep=3)._prune(8)
    assert [p.name for p in committed(tmp_path)] == ["step-00000004", "step-00000006", "step-00000008"]
