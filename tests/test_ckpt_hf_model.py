"""A checkpoint of an ``hf:FOLDER`` run resumes under another spelling of the folder (absolute,
``./qx/``, a copy elsewhere): the model is compared by the configuration ``rrfp.json`` records,
not by the ``--model`` text; another architecture is refused in one line before any process
starts. A checkpoint folder given where one of its step folders is meant (``rrfp export``,
``--resume PATH``) is one line naming the newest step folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from rrfp.cli import main  # noqa: E402

FLAGS = ["--stages", "1", "--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1"]


def _run(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "rrfp", *argv], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A folder holding qx/ (a saved llama) and ck/step-00000001, written with --model hf:qx."""
    from rrfp.hf import hf_model

    d = tmp_path_factory.mktemp("hfck")
    hf_model("llama", seed=0, max_len=32).save_pretrained(d / "qx")
    p = _run("train", "--model", "hf:qx", *FLAGS, "--steps", "1", "--quiet", "--checkpoint-dir", "ck", cwd=d)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def _resume(written, model: str, *extra: str) -> int:
    return main(["train", "--model", model, *FLAGS, "--steps", "2", "--checkpoint-dir", str(written / "ck"),
                 "--resume", "auto", *extra])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spelling", ["ABS/qx", "./qx/", "ABS/copy"])
def test_resume_takes_the_hf_folder_spelled_another_way(written, spelling, monkeypatch, capsys, no_launch):
    # On main: "was written with --model hf:qx, this run has --model hf:/tmp/.../qx: expected the same".
    if spelling == "ABS/copy" and not (written / "copy").exists():
        shutil.copytree(written / "qx", written / "copy")
    monkeypatch.chdir(written)
    with pytest.raises(AssertionError, match="a process was launched"):
        _resume(written, "hf:" + spelling.replace("ABS", str(written)))
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(600)
def test_resume_refuses_another_hf_architecture_in_one_line(written, tmp_path, capsys, no_launch):
    import transformers

    from rrfp.model.hf import hf_config

    config = hf_config("llama", 32)
    config.num_hidden_layers = 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "qx")
    capsys.readouterr()  # save_pretrained's progress bar
    assert _resume(written, f"hf:{tmp_path / 'qx'}") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("rrfp train: error: --resume auto (newest checkpoint ") and err.rstrip().endswith(
        f"was written with --model hf:qx, this run has --model hf:{tmp_path / 'qx'}: expected the same model "
        "configuration (num_hidden_layers: 4 in the checkpoint, 2 here)"), err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_ranks_take_the_hf_folder_by_its_absolute_path(written, tmp_path):
    """The ranks check the checkpoint again as they load it (Checkpointer.load): the same rule."""
    p = _run("train", "--model", f"hf:{written / 'qx'}", *FLAGS, "--steps", "2", "--quiet",
             "--resume", str(written / "ck" / "step-00000001"), "--loss-file", str(tmp_path / "loss"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [ln.split()[0] for ln in (tmp_path / "loss").read_text().splitlines()] == ["2"]


def test_a_checkpoint_dir_given_for_a_step_folder_names_the_newest(tmp_path, capsys, no_launch):
    # On main: "not a committed checkpoint (no rrfp.json in 'CK')", and nothing about what to pass.
    for step in (1, 3):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "rrfp.json").write_text(json.dumps({"format": 3, "step": step, "args": {}}))
    (tmp_path / "step-00000005").mkdir()  # not committed: no rrfp.json
    newest = repr(str(tmp_path / "step-00000003"))
    want = (f"not a committed checkpoint (no rrfp.json in {str(tmp_path)!r}): a checkpoint folder holding 2 "
            f"committed checkpoints, expected one of them, e.g. the newest {newest}")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(want), err
    assert main(["train", "--steps", "4", "--resume", str(tmp_path)]) == 2  # --resume PATH: the same rule
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(want), err
