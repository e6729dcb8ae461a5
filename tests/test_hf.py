"""Hugging Face causal LMs split by rrfp.hf: the chained stages equal the whole model, the
pipeline's gradients equal the unsplit model's (PyTorch's own backward on one process), a
folder saved with save_pretrained loads, and `rrfp train --model hf:...` trains."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing downloads, here or in the ranks started below

from rrfp import LocalPipeline  # noqa: E402
from rrfp.hf import hf_model, hf_ties, split_hf  # noqa: E402
from rrfp.model.gpt import IGNORE_INDEX, count_tokens, lm_loss  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3"]


def _batch(seed: int, b: int = 6, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t), generator=g)
    targets = torch.randint(0, 256, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[1, 7:] = 0  # right padding: masked keys, no loss there
    mask[4, 9:] = 0
    targets[mask == 0] = IGNORE_INDEX
    return ids, mask, targets


@pytest.fixture(scope="module", params=[f if f in ("gpt2", "qwen2") else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def model(request):
    return hf_model(request.param, seed=3, max_len=32)


@pytest.mark.parametrize("n_stages", [1, 3, 4])
def test_chained_stages_equal_the_whole_model(model, n_stages):
    ids, mask, _ = _batch(0)
    want = copy.deepcopy(model)(ids, attention_mask=mask).logits
    stages = split_hf(model, n_stages)
    h = stages[0](ids, attention_mask=mask)
    for st in stages[1:]:
        h = st(*h)
    assert torch.equal(h, want)
    names = {full for st in stages for full in st.stage_param_names.values()}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("hint", ["bf", "bfw"])
def test_pipeline_gradients_equal_the_unsplit_model(model, hint):
    ids, mask, targets = _batch(1)
    ref = copy.deepcopy(model)
    loss = lm_loss(ref(ids, attention_mask=mask).logits, targets)
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    stages = split_hf(model, 4)
    with LocalPipeline(stages, 3, lm_loss, hint=hint, loss_weight_fn=count_tokens, delay=(0.0, 0.001)) as pipe:
        got_loss = pipe.step(ids, target=targets, attention_mask=mask)
    torch.testing.assert_close(float(got_loss), loss.item(), rtol=RTOL, atol=ATOL)
    got: dict[str, torch.Tensor] = {}
    for st in stages:
        for n, p in st.named_parameters():
            full = st.stage_param_names[n]
            got[full] = p.grad if full not in got else got[full] + p.grad  # a tie's copies add up
    ties = hf_ties(model, 4)
    if ties:  # the tied head's copy is the embedding: its gradient is the sum of both
        (emb, head), = ([v[0], v[-1]] for v in ties.values())
        got[emb] = got[head] = got[emb] + got[head]
    assert set(got) == set(want)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=RTOL, atol=ATOL, msg=n)


def test_ties_are_declared_only_for_shared_weights():
    tie = lambda first: {"embeddings": {0: first, -1: "lm_head.weight"}}  # noqa: E731
    assert hf_ties(hf_model("gpt2", max_len=16), 2) == tie("transformer.wte.weight")
    assert hf_ties(hf_model("qwen2", max_len=16), 2) == tie("model.embed_tokens.weight")
    assert hf_ties(hf_model("llama", max_len=16), 2) is None  # Llama's head is its own weight
    assert hf_ties(hf_model("gpt2", max_len=16), 1) is None  # one stage: one parameter already


def test_a_saved_folder_loads_as_the_same_model(tmp_path):
    m = hf_model("llama", seed=5, max_len=32)
    m.save_pretrained(tmp_path)
    again = hf_model(str(tmp_path))
    ids, mask, _ = _batch(2)
    assert torch.equal(again(ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits)


def test_the_torch_free_table_names_the_supported_families():
    from rrfp.model.hf import FAMILIES
    from rrfp.model.spec import FAMILY_NAMES

    assert tuple(FAMILIES) == FAMILY_NAMES


def test_unsupported_types_are_refused_in_one_line():
    from transformers import BertConfig, BertLMHeadModel

    with pytest.raises(ValueError, match="model type 'bert': expected one of gpt2, llama"):
        split_hf(BertLMHeadModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                            intermediate_size=64, is_decoder=True)), 2)


@pytest.mark.parametrize("model_arg,needle", [
    ("hf:nope", "--model='hf:nope': expected one of hf:gpt2, hf:llama"),
    ("hf:EMPTY", "cannot read"),
    ("hf:gpt2 --tp 2", "expected --tp 1"),
    ("hf:gpt2 --stages 5", "exceeds the 4 layers"),
])
def test_bad_hf_models_are_one_line_errors(model_arg, needle, tmp_path, capsys, monkeypatch):
    from rrfp.cli import main

    monkeypatch.setattr("rrfp.train.cli.launch", lambda args: 0)
    argv = model_arg.replace("EMPTY", str(tmp_path)).split()
    assert main(["train", "--model", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def _train(tmp_path, model: str, stages: int, *extra: str) -> list[float]:
    losses = tmp_path / "losses.txt"
    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--model", model, "--stages", str(stages), "--steps", "8",
         "--batch-size", "8", "--microbatches", "4", "--max-len", "64", "--quiet", "--loss-file", str(losses), *extra],
        capture_output=True, text=True, timeout=840, cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [float.fromhex(line.split()[1]) for line in losses.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,stages", [("hf:gpt2", 4), ("hf:llama", 2)])
def test_rrfp_train_hf_models_losses_fall(tmp_path, model, stages):
    losses = _train(tmp_path, model, stages)
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0], losses


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rrfp_train_reads_a_saved_folder(tmp_path):
    folder = tmp_path / "qwen"
    hf_model("qwen2", seed=0, max_len=64).save_pretrained(folder)
    losses = _train(tmp_path, f"hf:{folder}", 2)
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0], losses
