"""``auto`` across a resume: the hint a run kept is written to its checkpoint (``rrfp.json``'s
``"hint"``) and a resumed ``rrfp train --hint auto`` keeps it (``AutoHint.adopt``) without
measuring or a trial, unless the checkpoint was written at another layout."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from rrfp.train import checkpoint as ck
from runs import SMALL, losses


class _Chooser:
    def __init__(self) -> None:
        self.adopted: list[tuple[str, str]] = []
        self.lines: list[str] = []
        self.say = self.lines.append

    def adopt(self, hint: str, source: str) -> bool:
        self.adopted.append((hint, source))
        return True


def _checkpoint(tmp_path, hint, **written) -> str:
    d = tmp_path / "step-00000040"
    d.mkdir()
    args = {"model": "tiny", "stages": 2, "virtual_stages": 1, "placement": "loop", "tp": 1, "dp": 1,
            "dp_shard": "none", **written}
    # The fields every rrfp.json carries (ckpt_verify.meta_problem refuses a file without them).
    data = {"next_step": 40, "n_samples": 640}
    (d / ck.META_FILE).write_text(json.dumps({"format": 3, "step": 40, "args": args, "data": data, "hint": hint}))
    return str(d)


def _args(**over) -> argparse.Namespace:
    return argparse.Namespace(**{"stages": 2, "virtual_stages": 1, "placement": "loop", "tp": 1, "dp": 1, **over})


def test_the_recorded_choice_is_adopted_at_the_same_layout(tmp_path) -> None:
    from rrfp.train.worker import _keep_recorded_hint

    c = _Chooser()
    _keep_recorded_hint(c, _args(), _checkpoint(tmp_path, "bf"))
    assert c.adopted == [("bf", "checkpoint step-00000040")] and c.lines == []


@pytest.mark.parametrize("over, said", [
    ({"stages": 4}, "(--stages 2)"),
    ({"virtual_stages": 2}, "(--virtual-stages 1)"),
    ({"dp": 2}, "(--dp 1)"),
])
def test_a_choice_measured_at_another_layout_is_measured_anew(tmp_path, over, said) -> None:
    from rrfp.train.worker import _keep_recorded_hint

    c = _Chooser()
    _keep_recorded_hint(c, _args(**over), _checkpoint(tmp_path, "bf"))
    assert c.adopted == []
    assert c.lines == [f"hint auto: the checkpoint's choice bf was measured at another layout {said}; measuring anew"]


@pytest.mark.parametrize("hint", [None, ""])
def test_no_recorded_choice_changes_nothing(tmp_path, hint) -> None:
    from rrfp.train.worker import _keep_recorded_hint

    c = _Chooser()
    _keep_recorded_hint(c, _args(), _checkpoint(tmp_path, hint))
    assert c.adopted == [] and c.lines == []


def test_a_recorded_hint_that_is_not_a_name_is_refused_in_one_line(tmp_path) -> None:
    """A hand-edited "hint": 3 is damage (ckpt_verify.meta_problem), not "no choice"."""
    from rrfp.train.worker import _keep_recorded_hint

    c = _Chooser()
    with pytest.raises(ValueError, match='"hint" is 3, expected a hint name or null'):
        _keep_recorded_hint(c, _args(), _checkpoint(tmp_path, 3))
    assert c.adopted == [] and c.lines == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_resumed_rrfp_train_keeps_the_checkpoints_auto_choice(tmp_path, pp2_run) -> None:
    """pp2_run (6 steps, too short to choose) recorded no choice; its step-4 checkpoint with
    ``"hint": "bf"`` written in (as a run that kept bf writes it) resumes for steps 5-6: they
    run bf from the first (said in one line), the summary says it was kept, the new
    checkpoint records it, and the losses are the uninterrupted run's, bit for bit (bf and
    strict 1F1B have the same backward form, and --deterministic accumulates in microbatch
    order)."""
    ref, d = pp2_run
    assert ck.read_meta(ck.step_dir(d, 6))["hint"] is None  # too short to choose: nothing recorded
    root = tmp_path / "ck"
    dst = ck.step_dir(root, 4)
    shutil.copytree(ck.step_dir(d, 4), dst)
    meta = json.loads((dst / ck.META_FILE).read_text())
    meta["hint"] = "bf"
    (dst / ck.META_FILE).write_text(json.dumps(meta))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    flags = [f for f in SMALL if f != "--quiet"]
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *flags, "--stages", "2", "--steps", "6",
                        "--checkpoint-dir", str(root), "--resume", "auto", "--loss-file", str(tmp_path / "losses")],
                       capture_output=True, text=True, timeout=1200, env={**env, "OMP_NUM_THREADS": "1"})
    out = p.stdout
    assert p.returncode == 0, out[-2000:] + p.stderr[-3000:]
    assert ("rrfp train: hint auto: keeps bf, the choice of checkpoint step-00000004 (no measuring, no trial, "
            "no re-check; --hint bf pins it)") in out, out
    assert "measure costs" not in out and "hint auto (kept bf)" in out, out
    assert ck.read_meta(ck.step_dir(root, 6))["hint"] == "bf"
    assert losses(tmp_path / "losses") == {k: ref[k] for k in (5, 6)}
