"""Each rank builds and loads only its stages (issue 31 item 2): modules are built on the meta
device and a stage materialises its own tensors alone. rrfp's GPT presets draw every parameter
from a generator seeded by its name in the unsplit model, so every split (stages, virtual
stages, placement, TP) holds the unsplit model's values; a Hugging Face folder's stage reads its
own tensors from the safetensors files (sharded, tied, saved by the base model, bf16), and
equals transformers' own ``from_pretrained`` of the whole folder. Folders that cannot be read are
refused before any rank starts, in one line, without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import pytest
import torch

from rrfp.model import GPT, GPT_PRESETS, build_stage
from rrfp.model.names import full_names
from rrfp.model.tp import shard_gpt_stage, tp_slice
from rrfp.scheduler.tasks import Placement
from rrfp.train.models import text_stages

CFG = dataclasses.replace(GPT_PRESETS["small"], max_len=32)  # 8 layers: splits 1, 2, 4, 8


def _by_model_name(modules) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for mod in modules:
        for local, full in full_names(mod).items():
            assert full not in got, f"{full} built twice"
            got[full] = mod.state_dict()[local]
    return got


@pytest.mark.parametrize("pp,v,placement", [(1, 1, "loop"), (2, 1, "loop"), (4, 1, "loop"), (8, 1, "loop"),
                                            (2, 2, "loop"), (2, 2, "v"), (4, 2, "v")])
def test_every_gpt_split_holds_the_unsplit_models_parameters_bit_for_bit(pp, v, placement):
    want = GPT(CFG, seed=7).state_dict()
    place = Placement(pp, v, placement)
    args = argparse.Namespace(model="small", max_len=CFG.max_len, seed=7)
    modules = []
    for rank in range(pp):  # what each rank of `rrfp train` builds
        mods, tied = text_stages(args, place.n_stages, place.stages_of(rank))
        assert tied is None
        modules += mods
    got = _by_model_name(modules)
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_gpt_initialisation_follows_the_names():
    """Hand-computed rules: LayerNorms 1 and 0, biases 0, weights N(0, 0.02), the residual
    projections N(0, 0.02 / sqrt(2 n_layer)); another seed draws other values."""
    a, b = GPT(CFG, seed=1).state_dict(), GPT(CFG, seed=2).state_dict()
    resid = 0.02 / math.sqrt(2 * CFG.n_layer)
    for name, t in a.items():
        if ".ln_" in name or name.startswith("ln_f"):
            assert torch.equal(t, torch.full_like(t, 1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith(".bias"):
            assert not t.any(), name
        else:
            std = resid if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
            assert abs(float(t.std()) / std - 1) < 0.1 and abs(float(t.mean())) < 0.1 * std, (name, float(t.std()))
            assert not torch.equal(t, b[name]), name
    # No two parameters share a stream: e.g. two blocks' qkv differ.
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], a["blocks.1.attn.qkv.weight"])


def test_a_gpt_stage_draws_only_its_own_parameters(monkeypatch):
    import rrfp.model.gpt as gpt

    drawn = []
    real = gpt._param_generator
    monkeypatch.setattr(gpt, "_param_generator", lambda seed, name: drawn.append(name) or real(seed, name))
    state = torch.get_rng_state()
    stage = build_stage(CFG, 4, 1, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # torch's global stream is untouched
    assert set(drawn) == {f"blocks.{i}.{p}" for i in (2, 3) for p in
                          ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")}
    assert len(drawn) == len(set(drawn))
    assert not any(p.is_meta for p in stage.parameters())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_hold_slices_of_the_unsplit_model(tp):
    want = GPT(CFG, seed=5).state_dict()
    for tp_rank in range(tp):
        stage = shard_gpt_stage(build_stage(CFG, 2, 1, seed=5), tp_rank, tp, group=None, impl="manual")
        for local, full in full_names(stage).items():
            want_t = tp_slice(full, want[full], tp_rank, tp, CFG.d_model, CFG.n_head)
            assert torch.equal(stage.state_dict()[local], want_t), (tp_rank, full)


# --- Hugging Face ----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from rrfp.model.hf import build_hf_stages, hf_model, split_hf  # noqa: E402


def _from_pretrained(folder) -> dict[str, torch.Tensor]:
    """transformers' own load of the whole folder: the reference, by the model's names."""
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers())


class _Spy:
    """Records every tensor read through ``safetensors.safe_open`` and the files opened to read
    tensors (``"pt"``; the pre-launch check reads headers only, through ``"np"``)."""

    def __init__(self, monkeypatch):
        import safetensors

        self.read, self.files = [], set()
        real, spy = safetensors.safe_open, self

        class Opened:
            def __init__(self, path, framework, device="cpu"):
                self._cm = real(path, framework, device=device)
                if framework == "pt":
                    spy.files.add(os.path.basename(path))

            def __enter__(self):
                self._f = self._cm.__enter__()
                return self

            def __exit__(self, *exc):
                return self._cm.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_tensor(self, key):
                spy.read.append(key)
                return self._f.get_tensor(key)

        monkeypatch.setattr(safetensors, "safe_open", Opened)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A 4-layer GPT-2 (tied head) saved in many small shards, with an index."""
    folder = tmp_path_factory.mktemp("gpt2")
    hf_model("gpt2", seed=3, max_len=32).save_pretrained(folder, max_shard_size="300KB")
    return folder


def test_the_fixture_is_sharded_and_tied(gpt2_folder):
    index = json.loads((gpt2_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 4 and "lm_head.weight" not in index  # saved once, as the embedding


@pytest.mark.parametrize("stage", range(4))
def test_a_folder_stage_equals_from_pretrained_and_reads_only_its_tensors(gpt2_folder, stage, monkeypatch):
    want = _from_pretrained(gpt2_folder)
    index = json.loads((gpt2_folder / "model.safetensors.index.json").read_text())["weight_map"]
    spy = _Spy(monkeypatch)
    (mod,), tied = build_hf_stages(str(gpt2_folder), 4, [stage])
    assert tied == {"embeddings": {0: "transformer.wte.weight", -1: "lm_head.weight"}}
    names = full_names(mod)
    for local, full in names.items():
        assert torch.equal(mod.state_dict()[local], want[full]), full
    assert mod.training and not any(t.is_meta for t in (*mod.parameters(), *mod.buffers()))
    # Exactly its own tensors were read (the tied head as the embedding's saved tensor), once
    # each, and only the files holding them were opened.
    own = {n if n in index else "transformer.wte.weight" for n in names.values()}
    assert sorted(spy.read) == sorted(own)
    assert {n for n in own if n.startswith("transformer.h.")} == {n for n in index if n.startswith(f"transformer.h.{stage}.")}
    assert spy.files == {index[n] for n in own}


def test_folder_stages_chained_give_from_pretrained_logits(gpt2_folder):
    ref = transformers.AutoModelForCausalLM.from_pretrained(gpt2_folder, dtype=torch.float32).train()
    stages, _ = build_hf_stages(str(gpt2_folder), 3, [0, 1, 2])
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    h = stages[0](ids)
    for st in stages[1:]:
        h = st(*h)
    assert torch.equal(h, ref(ids).logits)


def test_a_bf16_tied_rotary_folder_loads_as_float32(tmp_path):
    hf_model("qwen2", seed=4, max_len=32).to(torch.bfloat16).save_pretrained(tmp_path)
    want = _from_pretrained(tmp_path)
    stages, tied = build_hf_stages(str(tmp_path), 2, [0, 1])
    assert tied is not None
    for st in stages:
        for local, full in full_names(st).items():
            t = st.state_dict()[local]
            assert t.dtype == torch.float32 and torch.equal(t, want[full]), full
        for local, b in st.named_buffers():  # rotary frequencies: computed, not saved
            assert torch.equal(b, want[st.model_name(local)]), local


def test_a_base_model_folder_loads_under_the_lm_names(tmp_path):
    """Saved by ``GPT2Model`` (keys ``h.0...``, ``wte.weight``, as the original GPT-2 files):
    read under ``transformer.`` with the head tied to the embedding, as from_pretrained does."""
    hf_model("gpt2", seed=6, max_len=32).transformer.save_pretrained(tmp_path)
    want = _from_pretrained(tmp_path)
    (last,), _ = build_hf_stages(str(tmp_path), 2, [1])
    for local, full in full_names(last).items():
        assert torch.equal(last.state_dict()[local], want[full]), full
    assert torch.equal(last.lm_head.weight, want["transformer.wte.weight"])


def test_a_built_stage_is_a_copy_of_the_file(gpt2_folder):
    (mod,), _ = build_hf_stages(str(gpt2_folder), 4, [2])
    before = {n: p.detach().clone() for n, p in mod.named_parameters()}
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(1.0)  # what an optimizer step does in place
    (again,), _ = build_hf_stages(str(gpt2_folder), 4, [2])
    for n, q in again.named_parameters():
        assert torch.equal(before[n], q), n


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("llama", seed=1, max_len=32).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    gone = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    build_hf_stages(str(tmp_path), 2, [1])  # another stage's tensor: not read, not needed
    with pytest.raises(ValueError, match="no tensor 'model.layers.1.mlp.up_proj.weight' in its safetensors files"):
        build_hf_stages(str(tmp_path), 2, [0])
    tensors["model.layers.1.mlp.up_proj.weight"] = gone[:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \(344, 127\), "
                                         r"expected \(344, 128\)"):
        build_hf_stages(str(tmp_path), 2, [0])


def test_a_misshapen_tensor_of_a_later_stage_is_named_as_saved(tmp_path):
    """Layer 3 is the second stage's local layer 1: the message names the file's tensor
    (layers.3), not the stage's local name (layers.1, a tensor that is fine)."""
    from safetensors.torch import load_file, save_file

    hf_model("llama", seed=1, max_len=32).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.mlp.up_proj.weight"] = tensors["model.layers.3.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.3.mlp.up_proj.weight' has shape \(344, 127\)") as e:
        build_hf_stages(str(tmp_path), 2, [1])
    assert "layers.1" not in str(e.value)


@pytest.mark.parametrize("family", ["gpt2", *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "qwen2"))])
def test_preset_stages_equal_the_unsplit_preset(family):
    want = hf_model(family, seed=9, max_len=32)
    ref = dict(want.named_parameters(remove_duplicate=False)) | dict(want.named_buffers())
    for n in (1, 2, 4):
        state = torch.get_rng_state()
        stages, _ = build_hf_stages(family, n, list(range(n)), seed=9, max_len=32)
        assert torch.equal(torch.get_rng_state(), state)
        for st, split in zip(stages, split_hf(want, n)):
            assert full_names(st) == full_names(split)
            for local, full in full_names(st).items():
                assert torch.equal(st.state_dict()[local], ref[full]), (n, full)
    other = hf_model(family, seed=10, max_len=32)
    assert not torch.equal(other.lm_head.weight, want.lm_head.weight)


def test_a_preset_stage_initialises_only_its_modules(monkeypatch):
    import rrfp.model.hf_init as hf_init

    seen = []
    real = hf_init.module_seed
    monkeypatch.setattr(hf_init, "module_seed", lambda seed, name: seen.append(name) or real(seed, name))
    build_hf_stages("llama", 4, [2], seed=0, max_len=32)
    layers = {n.split(".")[2] for n in seen if n.startswith("model.layers.")}
    assert layers == {"2"} and not any("embed" in n or "lm_head" in n for n in seen), seen


# --- refused before launch -------------------------------------------------------------------

def _bad_folders(tmp_path):
    config = json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 2, "n_positions": 256,
                         "vocab_size": 256})
    cases = {}
    for name in ("noweights", "binonly", "badindex", "truncated", "short"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    (tmp_path / "binonly" / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "badindex" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}))
    (tmp_path / "truncated" / "model.safetensors").write_bytes((1000).to_bytes(8, "little") + b'{"a": ')
    (tmp_path / "short" / "model.safetensors").write_bytes(b"")
    cases["noweights"] = "no weights: expected model.safetensors or model.safetensors.index.json"
    cases["binonly"] = "its pytorch_model.bin is not read"
    cases["badindex"] = "names model-00001-of-00002.safetensors, which is not in"
    cases["truncated"] = "not a readable safetensors file"
    cases["short"] = "not a readable safetensors file"
    return cases


def test_unreadable_folders_are_refused_before_launch_without_torch(tmp_path, gpt2_folder):
    from test_cli_early import run_child

    cases = _bad_folders(tmp_path)
    argvs = [["train", "--model", f"hf:{tmp_path / name}", "--pp", "2"] for name in cases]
    argvs.append(["train", "--model", f"hf:{gpt2_folder}", "--pp", "5", "--max-len", "32"])
    needles = [*cases.values(), "5 stages exceeds the 4 layers"]
    for argv, needle, r in zip(argvs, needles, run_child(argvs, tmp_path)):
        assert not r["torch"], argv
        assert r["rc"] == 2 and len(r["err"]) == 1 and needle in r["err"][0], (argv, r)
