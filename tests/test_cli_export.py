"""``rrfp export`` of an ``hf:`` run: the exported state dict loads into the unsplit
``transformers`` model, whose logits equal the trained stages' chained (loaded from the same
checkpoint's shards), bit for bit; a checkpoint export cannot take is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from rrfp.hf import hf_model, split_hf  # noqa: E402


def _shards(path) -> dict[str, torch.Tensor]:
    """The model tensors of a committed checkpoint (DCP, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _rrfp(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rrfp", *argv], capture_output=True, text=True, timeout=840, cwd=cwd)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_of_an_hf_run_loads_into_the_transformers_model(tmp_path):
    ckdir = tmp_path / "ck"
    p = _rrfp("train", "--model", "hf:gpt2", "--pp", "2", "--steps", "1", "--batch-size", "4", "--microbatches", "2",
              "--max-len", "32", "--quiet", "--checkpoint-dir", str(ckdir), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    step = ckdir / "step-00000001"
    out = tmp_path / "model.pt"
    p = _rrfp("export", str(step), "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "hf_model('gpt2', max_len=32)" in p.stdout

    model = hf_model("gpt2", max_len=32).eval()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(torch.load(out))  # strict: every name of the model, nothing else
    assert any(not torch.equal(init[k], v) for k, v in model.state_dict().items())  # trained weights

    shards = _shards(step)
    stages = split_hf(hf_model("gpt2", max_len=32), 2)
    for s, st in enumerate(stages):
        st.load_state_dict({n: shards[f"model.stage{s}.{n}"] for n in st.state_dict()})
        st.eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stages[1](*stages[0](ids))
        assert torch.equal(model(ids).logits, want)


def test_export_refuses_a_multimodal_checkpoint_in_one_line(tmp_path):
    step = tmp_path / "step-00000001"
    step.mkdir()
    meta = {"format": 1, "step": 1, "args": {"model": "multimodal", "tp": 1}}
    (step / "rrfp.json").write_text(json.dumps(meta))
    p = _rrfp("export", str(step), "--out", str(tmp_path / "m.pt"), cwd=tmp_path)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, err
    assert "a --model multimodal checkpoint: export writes the text models" in err[0]


def test_an_output_folder_that_refuses_files_is_found_before_the_work():
    # Root's os.access says yes to /proc; creating a file there fails, as the command's would.
    from rrfp._paths import output_file_problem

    assert output_file_problem("/proc/model.pt").startswith("cannot write into its folder '/proc'")
