"""Checkpoints keyed by the model's own names, in one process: each stage's names map to the
unsplit model's (GPT, Hugging Face with a tied head, multimodal), tensor-parallel shards are the
pieces of the unsplit tensors that ``tp_slice`` gives, a state saved at one split loads into
another (weights and AdamW state, then one more step bit for bit), rrfp's GPT computes what the
GPT-2 it exports as computes, and the learning-rate schedule survives a resume.

References: the unsplit model built in the test (``GPT``, the ``transformers`` model, the
one-stage multimodal model), PyTorch's own AdamW steps on it, ``transformers``' GPT-2."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rrfp.model.gpt import GPT, GPTConfig, lm_loss, split_gpt
from rrfp.model.names import full_names, tp_runs
from rrfp.runtime.engine.stage import PipelineStage
from rrfp.train.dcp import LoadPlanner, NameKeyed, Pieces, SavePlanner, tp_pieces

CFG = GPTConfig(n_layer=4, n_head=4, d_model=32, max_len=16)


def _tokens(seed: int, b: int = 3, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def _train_step(stages, opt, seed: int) -> None:
    x, y = _tokens(seed)
    for st in stages:
        x = st(x)
    opt.zero_grad()
    lm_loss(x, y).backward()
    opt.step()


def test_gpt_stage_names_are_the_unsplit_models():
    model = GPT(CFG, seed=1)
    want = model.state_dict()
    for n_stages in (1, 3):
        seen = {}
        for st in split_gpt(model, n_stages):
            for local, t in st.state_dict().items():
                seen[full_names(st)[local]] = t
        assert seen.keys() == want.keys()
        assert all(torch.equal(seen[k], want[k]) for k in want)
    assert full_names(split_gpt(model, 3)[1])["blocks.0.mlp.fc.weight"] == "blocks.2.mlp.fc.weight"
    with pytest.raises(ValueError, match="Linear has no map from its parameter names to the unsplit model's"):
        full_names(torch.nn.Linear(2, 2))


def test_hugging_face_stage_names_cover_a_tied_head_on_every_split():
    pytest.importorskip("transformers")
    from rrfp.hf import hf_model, split_hf

    model = hf_model("gpt2", seed=2, max_len=16)
    want = model.state_dict()  # both names of the tied weight
    for n_stages in (1, 2):
        seen = {}
        for st in split_hf(model, n_stages):
            for local, t in st.state_dict().items():
                seen[full_names(st)[local]] = t
        assert seen.keys() == want.keys()
        assert all(torch.equal(seen[k], want[k]) for k in want)


def test_multimodal_stage_names_are_the_one_stage_models():
    from rrfp.model.multimodal import MULTIMODAL, build_multimodal_stage

    want = build_multimodal_stage(MULTIMODAL, 1, 0, seed=3).state_dict()
    seen = {}
    for s in range(3):
        st = build_multimodal_stage(MULTIMODAL, 3, s, seed=3)
        seen.update({full_names(st)[k]: t for k, t in st.state_dict().items()})
    assert seen.keys() == want.keys()
    assert all(torch.equal(seen[k], want[k]) for k in want)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_are_pieces_of_the_unsplit_tensors(tp):
    """Every TP rank's shards, placed where tp_runs says, rebuild each unsplit tensor exactly
    once (qkv: three runs per rank, the rank's heads of q, k and v)."""
    from rrfp.model.tp import shard_gpt_stage

    stage = split_gpt(GPT(CFG, seed=4), 1)[0]
    want = dict(stage.named_parameters())
    rebuilt = {n: torch.full_like(p, float("nan")) for n, p in want.items()}
    sharded = set()
    for rank in range(tp):
        shard = shard_gpt_stage(copy.deepcopy(stage), rank, tp)
        runs = tp_runs(shard, rank, tp)
        sharded |= set(runs)
        for name, p in shard.named_parameters():
            if name not in runs:
                assert torch.equal(p, want[name])  # replicated: whole on every rank
                continue
            dim, r = runs[name]
            for t, at in tp_pieces(p.detach(), dim, r, tp).pieces:
                region = rebuilt[name]
                for d, (o, n) in enumerate(zip(at, t.shape)):
                    region = region.narrow(d, o, n)
                assert region.isnan().all()  # no two pieces overlap
                region.copy_(t)
    assert all(torch.equal(rebuilt[n], want[n]) for n in sharded)
    assert len(tp_runs(shard_gpt_stage(copy.deepcopy(stage), 0, tp), 0, tp)["blocks.0.attn.qkv.weight"][1]) == 3
    assert {n.split(".", 2)[2] for n in sharded} == {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                                                     "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight"}


def test_pieces_load_into_another_split_of_the_tensor(tmp_path):
    full = torch.arange(12 * 5, dtype=torch.float32).view(12, 5)
    rows = [(0, 2), (4, 2), (8, 2), (2, 2), (6, 2), (10, 2)]  # as two TP ranks' qkv: q, k, v each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP notes it runs in one process: the intent
        dcp.save({"w": Pieces(full.shape, [(full[a:a + n], (a, 0)) for a, n in rows])}, checkpoint_id=tmp_path,
                 no_dist=True, planner=SavePlanner())
        top, bottom = torch.zeros(7, 5), torch.zeros(5, 5)
        dcp.load({"w": Pieces(full.shape, [(top, (0, 0)), (bottom, (7, 0))])}, checkpoint_id=tmp_path,
                 no_dist=True, planner=LoadPlanner())
    assert torch.equal(torch.cat([top, bottom]), full)


def _keyed(stages, opt):
    return NameKeyed([PipelineStage(st, i, len(stages)) for i, st in enumerate(stages)], opt)


@pytest.mark.slow
def test_a_state_saved_at_two_stages_loads_at_four_and_trains_on_bit_for_bit(tmp_path):
    """Weights and AdamW state written by a 2-stage split load into a 4-stage split of another
    initialisation; one more step on both gives equal weights, bit for bit."""
    a = split_gpt(GPT(CFG, seed=5), 2)
    opt_a = torch.optim.AdamW([p for st in a for p in st.parameters()], lr=1e-2)
    _train_step(a, opt_a, 0)
    _train_step(a, opt_a, 1)
    keyed = _keyed(a, opt_a)
    state = keyed.state()
    assert "model.blocks.3.mlp.proj.weight" in state and "optim.state.blocks.3.mlp.proj.weight.exp_avg" in state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True, planner=SavePlanner())
        b = split_gpt(GPT(CFG, seed=6), 4)
        opt_b = torch.optim.AdamW([p for st in b for p in st.parameters()], lr=1e-2)
        keyed_b = _keyed(b, opt_b)
        loaded = keyed_b.state()
        dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True, planner=LoadPlanner())
    keyed_b.apply(loaded)
    _train_step(a, opt_a, 2)
    _train_step(b, opt_b, 2)
    got = {full_names(st)[n]: p for st in b for n, p in st.named_parameters()}
    want = {full_names(st)[n]: p for st in a for n, p in st.named_parameters()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_tied_weight_is_written_under_both_names_optimizer_state_included():
    pytest.importorskip("transformers")
    from rrfp.hf import hf_model, split_hf

    (only,) = split_hf(hf_model("gpt2", seed=2, max_len=16), 1)
    opt = torch.optim.AdamW(only.parameters())
    state = _keyed([only], opt).state()
    for name in ("transformer.wte.weight", "lm_head.weight"):
        assert state[f"model.{name}"].data_ptr() == only.lm_head.weight.data_ptr()
        assert f"optim.state.{name}.exp_avg" in state and f"optim.param_groups.{name}.lr" in state


def test_rrfps_gpt_computes_what_its_gpt2_export_computes():
    transformers = pytest.importorskip("transformers")
    from rrfp.model.names import gpt2_config, gpt_to_gpt2

    model = GPT(CFG, seed=7).eval()
    settings = gpt2_config(CFG)
    settings.pop("model_type")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).eval()
    hf.load_state_dict(dict(gpt_to_gpt2(n, t) for n, t in model.state_dict().items()))  # strict: every name
    x, _ = _tokens(8)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model(x))
    with pytest.raises(ValueError, match="'wte.weight' is not a parameter of rrfp's GPT"):
        gpt_to_gpt2("wte.weight", torch.zeros(1))


@pytest.mark.parametrize("schedule,warmup", [("cosine", 2), ("constant", 3), ("cosine", 0)])
def test_the_learning_rate_schedule_resumes_from_its_recorded_state(schedule, warmup):
    """The schedule's state goes through rrfp.json (JSON) and continues the learning rates of a
    schedule that never stopped."""
    from rrfp.train.optim import lr_scheduler

    def new():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return opt, lr_scheduler(opt, 10, warmup, schedule, 0.01)

    ref_opt, ref = new()
    lrs = []
    for _ in range(10):
        ref_opt.step()
        ref.step()
        lrs.append(ref_opt.param_groups[0]["lr"])
    opt, sched = new()
    for _ in range(4):
        opt.step()
        sched.step()
    saved = json.loads(json.dumps(sched.state_dict()))
    opt2, sched2 = new()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(saved)
    got = []
    for _ in range(6):
        opt2.step()
        sched2.step()
        got.append(opt2.param_groups[0]["lr"])
    assert got == lrs[4:]


def test_tp_layers_that_regroup_qkv_are_refused_in_one_line():
    """impl 'dtensor' holds qkv regrouped rank-major (its DTensor's rows are not the model's):
    writing it under the model's name would mislabel rows, so it is refused."""
    from rrfp.model.tp import TPAttention

    stage = split_gpt(GPT(CFG, seed=9), 1)[0]
    stage.blocks[1].attn = TPAttention(stage.blocks[1].attn, 0, 2, None, "dtensor", CFG.d_model, CFG.n_head)
    with pytest.raises(ValueError, match="blocks.1.attn: tensor-parallel layers of impl 'dtensor' hold qkv "
                                         "regrouped rank-major"):
        tp_runs(stage, 0, 2)
