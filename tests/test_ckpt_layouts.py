"""Resuming a checkpoint under another layout: another ``--dp`` continues the run through
DCP's resharding (losses as if it never stopped); a ``--tp`` checkpoint resumes bit for bit.

The reference is one uninterrupted ``rrfp train`` run with the same flags (``--deterministic``):
its per-step losses (``--loss-file``). Each run is a subprocess under a timeout; no sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp.train import checkpoint as ck

SMALL = ["--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1", "--deterministic", "--quiet"]


def _train(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *SMALL, *flags], capture_output=True, text=True,
                       timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _losses(path: Path) -> dict[int, float]:
    return {int(s): float.fromhex(x) for s, x in (ln.split() for ln in path.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_resume_under_another_dp_continues_the_losses(tmp_path):
    """dp 1 for steps 1-2, dp 2 for steps 3-4, dp 1 again for 5-6: every continued loss is
    the uninterrupted dp-1 run's (the global batch of a step does not depend on --dp)."""
    d = tmp_path / "ck"
    _train("--stages", "2", "--steps", "6", "--loss-file", str(tmp_path / "ref"))
    ref = _losses(tmp_path / "ref")
    _train("--stages", "2", "--steps", "2", "--checkpoint-dir", str(d))
    out = _train("--stages", "2", "--dp", "2", "--steps", "4", "--checkpoint-dir", str(d), "--resume", "auto",
                 "--loss-file", str(tmp_path / "dp2"))
    assert out.count("resumed from") == 1 and f"resumed from {ck.step_dir(d, 2)} at step 2" in out, out
    meta = ck.read_meta(ck.step_dir(d, 4))
    assert (meta["args"]["dp"], meta["args"]["tp"], meta["world_size"]) == (2, 1, 4)
    out = _train("--stages", "2", "--steps", "6", "--checkpoint-dir", str(d), "--resume", "auto",
                 "--loss-file", str(tmp_path / "dp1"))
    assert f"resumed from {ck.step_dir(d, 4)} at step 4" in out, out
    got = {**_losses(tmp_path / "dp2"), **_losses(tmp_path / "dp1")}
    assert sorted(got) == [3, 4, 5, 6]
    for step, loss in got.items():  # a DP all-reduce may round differently from one process
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=0), (step, loss, ref[step])
    assert ref[3] != ref[1]  # the continued losses are not a restart's


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_tp_checkpoint_resumes_bit_for_bit_and_refuses_another_tp(tmp_path, capsys):
    """Each TP rank's shard is its own key: a --tp 2 run resumed at --tp 2 equals the
    uninterrupted one bit for bit; --tp 1 on it is refused before any process starts."""
    from rrfp.cli import main

    d = tmp_path / "ck"
    tp = ["--stages", "1", "--tp", "2"]
    _train(*tp, "--steps", "4", "--loss-file", str(tmp_path / "ref"))
    _train(*tp, "--steps", "2", "--checkpoint-dir", str(d))
    _train(*tp, "--steps", "4", "--checkpoint-dir", str(d), "--resume", "auto", "--loss-file", str(tmp_path / "res"))
    ref, got = _losses(tmp_path / "ref"), _losses(tmp_path / "res")
    assert got == {3: ref[3], 4: ref[4]}
    shards = json.loads((ck.step_dir(d, 4) / ck.META_FILE).read_text())["args"]
    assert shards["tp"] == 2
    rc = main(["train", *SMALL, "--stages", "1", "--steps", "6", "--checkpoint-dir", str(d), "--resume", "auto"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"rrfp train: error: --resume auto (newest checkpoint {str(ck.step_dir(d, 4))!r}) was "
                               "written with --tp 2, this run has --tp 1: expected the same (a checkpoint resumes "
                               "under another --dp only)\n")
    with pytest.raises(ValueError, match="holds --tp 2 shards of each stage: export takes checkpoints written with --tp 1"):
        ck.export(ck.step_dir(d, 4), tmp_path / "model.pt")
