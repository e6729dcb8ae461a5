"""Resuming a checkpoint under another layout. Checkpoints are keyed by the model's own names,
so a run continues under another ``--dp``, ``--stages``, ``--virtual-stages`` or ``--tp`` with
the losses of a run that never stopped (bit for bit where the layout keeps the arithmetic: the
pipeline split does; DP and TP all-reduces round differently), and ``rrfp export`` writes the
model of any of them as a Hugging Face folder. A checkpoint of format 2 (keyed by stage index)
still loads, at its own layout.

The reference is one uninterrupted ``rrfp train`` run with the same flags (``--deterministic``):
its per-step losses (``--loss-file``) and its checkpoints. Each run is a subprocess under a
timeout; no sleeps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch
from runs import SMALL
from runs import losses as _losses
from runs import train as _train

from rrfp.train import checkpoint as ck


def _tensors(path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a committed checkpoint, by name (DCP, no process group:
    each tensor reassembled from the pieces the ranks wrote)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith(("model.", "optim.")) and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


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
@pytest.mark.timeout(3600)
def test_resume_under_other_stages_and_virtual_stages_is_bit_for_bit(tmp_path, pp2_run):
    """--stages 2 for steps 1-2 (pp2_run), --stages 4 for steps 3-4, --stages 2 --virtual-stages 2
    for steps 5-6: the losses and the final weights and AdamW state are the uninterrupted
    run's, bit for bit (a pipeline split computes the same ops in the same order)."""
    ref, d = pp2_run
    d2 = tmp_path / "ck"
    out = _train("--stages", "4", "--steps", "4", "--checkpoint-dir", str(d2), "--resume", str(ck.step_dir(d, 2)),
                 "--loss-file", str(tmp_path / "pp4"))
    assert f"resumed from {ck.step_dir(d, 2)} at step 2" in out, out
    out = _train("--stages", "2", "--virtual-stages", "2", "--steps", "6", "--checkpoint-dir", str(d2),
                 "--resume", "auto", "--loss-file", str(tmp_path / "v2"))
    assert f"resumed from {ck.step_dir(d2, 4)} at step 4" in out, out
    assert {**_losses(tmp_path / "pp4"), **_losses(tmp_path / "v2")} == {k: ref[k] for k in (3, 4, 5, 6)}
    meta = ck.read_meta(ck.step_dir(d2, 6))
    assert (meta["format"], meta["args"]["stages"], meta["args"]["virtual_stages"]) == (3, 2, 2)
    assert ck.read_meta(ck.step_dir(d2, 4))["args"]["stages"] == 4
    got, want = _tensors(ck.step_dir(d2, 6)), _tensors(ck.step_dir(d, 6))
    assert got.keys() == want.keys() and "model.blocks.3.mlp.fc.weight" in got
    assert any(k.startswith("optim.state.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_resume_from_tp1_to_tp2_then_export_from_the_tp2_checkpoint(tmp_path):
    """--tp 1 for steps 1-2, --tp 2 for steps 3-5, under a cosine schedule with warm-up: the
    losses follow the uninterrupted --tp 1 run's (TP's all-reduce may round differently), the
    learning rate included (before format 3 a resume restarted the schedule: step 5's loss
    was 4.8101 instead of 4.8972). ``rrfp export`` of the --tp 2 checkpoint writes a GPT-2 folder
    whose logits equal the two-stage pipeline's, loaded from the same checkpoint by name."""
    transformers = pytest.importorskip("transformers")
    from rrfp.model.gpt import GPT_PRESETS, build_stage
    from rrfp.model.names import full_names

    flags = ["--stages", "1", "--lr-schedule", "cosine", "--warmup", "1", "--steps", "5"]
    _train(*flags, "--checkpoint-dir", str(tmp_path / "ref"), "--checkpoint-every", "2",
           "--loss-file", str(tmp_path / "ref.txt"))
    d = tmp_path / "ck"
    out = _train(*flags, "--tp", "2", "--checkpoint-dir", str(d), "--resume", str(ck.step_dir(tmp_path / "ref", 2)),
                 "--loss-file", str(tmp_path / "tp2.txt"))
    assert "at step 2" in out, out
    ref, got = _losses(tmp_path / "ref.txt"), _losses(tmp_path / "tp2.txt")
    assert sorted(got) == [3, 4, 5]
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=0), (step, loss, ref[step])
    step5 = ck.step_dir(d, 5)
    meta = ck.read_meta(step5)
    assert meta["args"]["tp"] == 2 and meta["lr_schedule"]["last_epoch"] == 5

    hf = tmp_path / "hf"
    from rrfp.cli import main

    assert main(["export", str(step5), "--out", str(hf)]) == 0
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tensors = _tensors(step5)
    cfg = dataclasses.replace(GPT_PRESETS["tiny"], max_len=32)
    stages = [build_stage(cfg, 2, s) for s in range(2)]
    for st in stages:
        st.load_state_dict({n: tensors[f"model.{full_names(st)[n]}"] for n in st.state_dict()})
    x = tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for st in stages:
            x = st.eval()(x)
        assert torch.equal(model(tokens).logits, x)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_format_2_checkpoint_still_loads_at_its_layout(tmp_path, pp2_run, capsys, monkeypatch):
    """A checkpoint keyed by stage index, as rrfp wrote before format 3 (the test hook writes its
    keys; the 855 keys and a few names below are those of a checkpoint written by that rrfp with
    these flags), resumes at its own layout with the uninterrupted run's losses; another
    --stages on it is refused in one line before any process starts."""
    ref, _ = pp2_run
    d = tmp_path / "ck"
    monkeypatch.setenv(ck.FORMAT_ENV, "2")
    _train("--stages", "2", "--steps", "2", "--checkpoint-dir", str(d))
    monkeypatch.delenv(ck.FORMAT_ENV)
    step2 = ck.step_dir(d, 2)
    meta = ck.read_meta(step2)
    assert meta["format"] == 2 and "lr_schedule" not in meta
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata)
    assert len(keys) == 855 and {"model.stage0.tok_emb.weight", "model.stage1.blocks.0.attn.qkv.weight",
                                 "optim.state.stage1.head.weight.exp_avg", "optim.param_groups.stage0.pos_emb.weight.lr",
                                 "rng.pp1dp0tp0.rng.torch", "train.step"} <= keys
    _train("--stages", "2", "--steps", "4", "--checkpoint-dir", str(d), "--resume", "auto",
           "--loss-file", str(tmp_path / "res"))
    assert _losses(tmp_path / "res") == {3: ref[3], 4: ref[4]}
    assert ck.read_meta(ck.step_dir(d, 4))["format"] == ck.FORMAT  # written anew by name
    from rrfp.cli import main

    monkeypatch.setattr("rrfp.train.cli.launch", lambda *a, **k: pytest.fail("a process was launched"))
    capsys.readouterr()
    assert main(["train", *SMALL, "--stages", "4", "--steps", "4", "--resume", str(step2)]) == 2
    err = capsys.readouterr().err
    assert err == (f"rrfp train: error: --resume={str(step2)!r} was written with --pp 2, this run has --pp 4: "
                   "expected the same (a checkpoint of format 2, keyed by stage index, resumes under another --dp "
                   "only)\n")
    assert os.environ.get(ck.FORMAT_ENV) is None
