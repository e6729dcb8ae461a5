"""``rrfp export`` of an ``hf:`` run: a Hugging Face folder that ``from_pretrained`` loads, whose
logits equal the trained stages' chained (loaded from the same checkpoint by the model's names),
bit for bit; a checkpoint export cannot take, or an ``--out`` it cannot write, is refused in one
line. (The GPT presets, exported as GPT-2 from a --tp 2 checkpoint: tests/test_ckpt_layouts.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from rrfp.hf import hf_model, split_hf  # noqa: E402


def _by_name(path, modules) -> None:
    """Load stage modules from a committed checkpoint by the unsplit model's names (DCP, no
    process group)."""
    import torch.distributed.checkpoint as dcp

    from rrfp.model.names import full_names

    for st in modules:
        names = full_names(st)
        state = {f"model.{names[n]}": t for n, t in st.state_dict().items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        st.load_state_dict({n: state[f"model.{names[n]}"] for n in st.state_dict()})


def _rrfp(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rrfp", *argv], capture_output=True, text=True, timeout=840, cwd=cwd)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_of_an_hf_run_loads_with_from_pretrained(tmp_path):
    import transformers

    ckdir = tmp_path / "ck"
    p = _rrfp("train", "--model", "hf:gpt2", "--pp", "2", "--steps", "1", "--batch-size", "4", "--microbatches", "2",
              "--max-len", "32", "--quiet", "--checkpoint-dir", str(ckdir), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    step = ckdir / "step-00000001"
    out = tmp_path / "hf"
    p = _rrfp("export", str(step), "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"as GPT2LMHeadModel; load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})" in p.stdout
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    init = hf_model("gpt2", max_len=32).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in model.state_dict().items())  # trained weights
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied

    stages = split_hf(hf_model("gpt2", max_len=32), 2)
    _by_name(step, stages)
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stages[1].eval()(*stages[0].eval()(ids))
        assert torch.equal(model(ids).logits, want)
    p = _rrfp("export", str(step), "--out", str(out), cwd=tmp_path)  # not over a folder that holds files
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "is a folder that is not empty" in p.stderr


def test_export_refuses_a_multimodal_checkpoint_in_one_line(tmp_path):
    step = tmp_path / "step-00000001"
    step.mkdir()
    meta = {"format": 3, "step": 1, "args": {"model": "multimodal", "tp": 1}, "data": {"next_step": 1, "n_samples": 0}}
    (step / "rrfp.json").write_text(json.dumps(meta))
    p = _rrfp("export", str(step), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, err
    assert "a --model multimodal checkpoint: no transformers class computes rrfp's multimodal model" in err[0]


def test_export_refuses_tp_shards_keyed_by_stage_and_an_out_it_cannot_use(tmp_path):
    from rrfp.train.export import export_problem, out_problem

    old = {"format": 2, "step": 1, "args": {"model": "tiny", "tp": 2}}
    assert export_problem(old, "ck") == ("checkpoint 'ck' holds --tp 2 shards keyed by stage (format 2): export "
                                         "takes checkpoints of that format written with --tp 1")
    assert export_problem({**old, "format": 3}, "ck") is None  # keyed by name: any layout
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    assert out_problem(tmp_path / "full").startswith("is a folder that is not empty")
    assert out_problem(tmp_path / "file").startswith("is a file")
    assert out_problem(tmp_path / "empty") is None and out_problem(tmp_path / "new") is None
    assert out_problem(tmp_path / "no" / "such").startswith("its folder")


def test_an_output_folder_that_refuses_files_is_found_before_the_work():
    # Root's os.access says yes to /proc; creating a file there fails, as the command's would.
    from rrfp._paths import output_file_problem

    assert output_file_problem("/proc/model.pt").startswith("cannot write into its folder '/proc'")


@pytest.mark.parametrize("absent", ["transformers", "safetensors"])
def test_export_without_the_hf_packages_is_one_line_before_the_work(tmp_path, monkeypatch, absent):
    # export writes with transformers' save_pretrained; without it (no 'rrfp[hf]') the command
    # used to end in a ModuleNotFoundError traceback after loading the checkpoint.
    import argparse
    import importlib.util

    from rrfp.train import export_cli

    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "rrfp.json").write_text(json.dumps({"format": 3, "step": 1, "args": {"model": "tiny", "tp": 1},
                                                "data": {"next_step": 1, "n_samples": 8}}))  # the fields read_meta checks
    args = argparse.Namespace(checkpoint=str(step), out=str(tmp_path / "hf"))
    assert export_cli.check(args) is None  # both installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    assert export_cli.check(args) == f"rrfp export needs the {absent} package (pip install 'rrfp[hf]')"
