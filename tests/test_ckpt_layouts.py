"""Resuming a checkpoint under another layout: another ``--dp`` continues the run through
DCP's resharding (losses as if it never stopped); a ``--tp`` checkpoint resumes bit for bit.

The reference is one uninterrupted ``rrfp train`` run with the same flags (``--deterministic``):
its per-step losses (``--loss-file``). Each run is a subprocess under a timeout; no sleeps.
"""

from __future__ import annotations

import json

import pytest
from runs import SMALL
from runs import losses as _losses
from runs import train as _train

from rrfp.train import checkpoint as ck


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_resume_under_another_dp_continues_the_losses(tmp_path, pp2_run):
    """dp 1 for steps 1-2, dp 2 for steps 3-4, dp 1 again for 5-6: every continued loss is
    the uninterrupted dp-1 run's (the global batch of a step does not depend on --dp). The
    uninterrupted run (conftest's pp2_run) also wrote the step-2 checkpoint the dp-2 run
    resumes from: a checkpoint does not change the run that writes it."""
    ref, d = pp2_run
    d2 = tmp_path / "ck2"
    out = _train("--stages", "2", "--dp", "2", "--steps", "4", "--checkpoint-dir", str(d2),
                 "--resume", str(ck.step_dir(d, 2)), "--loss-file", str(tmp_path / "dp2"))
    assert out.count("resumed from") == 1 and f"resumed from {ck.step_dir(d, 2)} at step 2" in out, out
    meta = ck.read_meta(ck.step_dir(d2, 4))
    assert (meta["args"]["dp"], meta["args"]["tp"], meta["world_size"]) == (2, 1, 4)
    out = _train("--stages", "2", "--steps", "6", "--checkpoint-dir", str(d2), "--resume", "auto",
                 "--loss-file", str(tmp_path / "dp1"))
    assert f"resumed from {ck.step_dir(d2, 4)} at step 4" in out, out
    got = {**_losses(tmp_path / "dp2"), **_losses(tmp_path / "dp1")}
    assert sorted(got) == [3, 4, 5, 6]
    for step, loss in got.items():  # a DP all-reduce may round differently from one process
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=0), (step, loss, ref[step])
    assert ref[3] != ref[1]  # the continued losses are not a restart's


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_tp_checkpoint_resumes_bit_for_bit_and_refuses_another_tp(tmp_path, capsys):
    """Each TP rank's shard is its own key: a --tp 2 run resumed at --tp 2 equals the
    uninterrupted one bit for bit; --tp 1 on it is refused before any process starts."""
    from rrfp.cli import main

    d = tmp_path / "ck"
    tp = ["--stages", "1", "--tp", "2"]
    # The uninterrupted run writes the step-2 checkpoint that the second run resumes from.
    _train(*tp, "--steps", "4", "--checkpoint-dir", str(d), "--checkpoint-every", "2",
           "--loss-file", str(tmp_path / "ref"))
    out = _train(*tp, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck2"), "--resume", str(ck.step_dir(d, 2)),
                 "--loss-file", str(tmp_path / "res"))
    assert f"resumed from {ck.step_dir(d, 2)} at step 2" in out, out
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
