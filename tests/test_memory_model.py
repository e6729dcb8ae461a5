"""The memory model's projection (benchmarks/memory_model.py) against the numbers and formulas
published for it: Llama-3's parameter counts (Meta's checkpoints; transformers' own model),
Megatron-LM's bytes-per-parameter table, the ZeRO paper's worked example, Korthikanti et al.'s
activation formulas (with tensor and sequence parallelism); and against the runtime's own
footprint (``rrfp.parallel.footprint``) of a small Llama's stages, replicated and sharded by
FSDP2 in fp32 and bf16."""

from __future__ import annotations

import pytest

from benchmarks.memory_model import (GIB, LAYOUTS, LLAMA3_70B, LLAMA3_8B, Llama, kind_bytes_per_param,
                                     layer_activation_bytes, rank_bytes, state_bytes_per_param, state_table)


def test_llama3_parameter_counts_are_metas():
    # The checkpoints' safetensors indexes say total_size 16,060,522,496 and 141,107,412,992
    # bytes in bf16: 2 bytes per parameter.
    assert LLAMA3_8B.params() == 16_060_522_496 // 2 == 8_030_261_248
    assert LLAMA3_70B.params() == 141_107_412_992 // 2 == 70_553_706_496


def test_a_small_llamas_count_and_split_match_transformers():
    transformers = pytest.importorskip("transformers")
    import torch

    m = Llama("small", 6, 64, 176, 8, 2, 1000)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert m.params() == sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert m.layer_params() == layer
    # 6 layers over 4 stages: 2, 2, 1, 1; the embedding on the first, head and final norm on the last.
    assert [m.stage_params(4, s) for s in range(4)] == [2 * layer + 64000, 2 * layer, layer, layer + 64000 + 64]
    assert sum(m.stage_params(4, s) for s in range(4)) == m.params()


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_bytes_per_parameter_are_megatrons_table(d):
    # Megatron-LM docs/source/api-guide/dist_optimizer.md: bf16 params + fp32 grads 18 | 6 + 12/d;
    # fp32 params + fp32 grads 16 | 8 + 8/d (the last is Megatron's, not a layout here).
    assert state_bytes_per_param("replicated mixed", d) == (18, 0)
    assert state_bytes_per_param("distributed optimizer", d) == (6 + 12 / d, 0)
    assert state_bytes_per_param("replicated fp32", d) == (16, 0)
    # FSDP2 shards all 16 bytes; a pipeline step keeps the stage gathered (bf16 copy + fp32
    # gradients under MixedPrecisionPolicy(bf16, fp32); fp32 both otherwise).
    assert state_bytes_per_param("FSDP mixed", d) == (16 / d, 6)
    assert state_bytes_per_param("FSDP fp32", d) == (16 / d, 8)
    with pytest.raises(ValueError, match="expected one of"):
        state_bytes_per_param("zero-4", d)
    with pytest.raises(ValueError, match="dp=0: expected"):
        state_bytes_per_param("FSDP fp32", 0)


def test_zero_stages_reproduce_the_papers_example():
    # Rajbhandari et al. 2020 (arXiv 1910.02054), Figure 1: a 7.5B-parameter model on Nd = 64
    # GPUs holds 120 GB (baseline), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p) per GPU.
    psi, nd = 7.5e9, 64
    got = [psi * state_bytes_per_param(z, nd)[0] / 1e9 for z in ("ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert [round(g, 1) for g in got] == [31.4, 16.6, 1.9]
    assert psi * state_bytes_per_param("ZeRO-1", 1)[0] / 1e9 == 120  # no sharding: the baseline
    # FSDP2 shards the same 16 bytes as ZeRO-3 between steps (fp32 parameters and gradients
    # instead of fp16 ones and fp32 master weights), kind by kind as Footprint names them.
    assert state_bytes_per_param("FSDP fp32", nd)[0] == state_bytes_per_param("ZeRO-3", nd)[0] == 16 / nd
    assert kind_bytes_per_param("ZeRO-2", 4) == {"params": 2, "grads": 0.5, "optimizer": 3, "gathered_params": 0,
                                                 "gathered_grads": 0}


def test_activations_are_korthikantis_formula_on_the_first_stage_of_1f1b():
    # sbh(34 + 5as/h) bytes per layer (arXiv 2205.05198 §4.1); under 1F1B the first stage holds
    # p microbatches of L/p layers: sbhL(34 + 5as/h) (§4.2.3). Llama-3 8B, s 4096, b 1:
    # 4096 * 4096 * 32 * (34 + 5 * 32 * 4096 / 4096) = 4096 * 4096 * 32 * 194.
    want = 4096 * 4096 * 32 * 194
    for pp in (2, 4, 8):
        assert rank_bytes(LLAMA3_8B, "FSDP mixed", pp, 4, 0, 4096, 1, store_scores=True)["activations"] == want
    assert layer_activation_bytes(LLAMA3_8B, 4096, 1, store_scores=False) == 34 * 4096 * 4096
    # The last rank holds one microbatch of its layers and its logits, 4 bytes each.
    last = rank_bytes(LLAMA3_8B, "replicated fp32", 4, 1, 3, 4096, 2)
    assert last["activations"] == 8 * 34 * 4096 * 2 * 4096 and last["logits"] == 4 * 4096 * 2 * 128256


def test_tensor_parallel_split_and_activations_by_hand():
    # Llama-3 70B at TP 8: q, o 8192^2 each, k, v 8192 x 1024 each, SwiGLU 3 x 8192 x 28672,
    # split 8 ways; two RMSNorms of 8192 whole.
    mats = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert LLAMA3_70B.layer_params(8) == mats // 8 + 2 * 8192 == 106_971_136
    # PP 4: 20 layers a stage; the last adds its vocabulary-parallel head and the final norm.
    assert LLAMA3_70B.stage_params(4, 3, tp=8) == 20 * 106_971_136 + 128256 * 8192 // 8 + 8192
    # Every TP rank's share of the matrices sums to the unsplit layer.
    assert 8 * (LLAMA3_70B.layer_params(8) - 2 * 8192) + 2 * 8192 == LLAMA3_70B.layer_params(1)
    with pytest.raises(ValueError, match="tp=3: expected a divisor"):
        LLAMA3_70B.layer_params(3)
    # Korthikanti et al. Table 2, per layer: TP sbh(10 + 24/t + 5as/(ht)), TP + SP
    # sbh(34/t + 5as/(ht)); both are sbh(34 + 5as/h) at t = 1.
    s, b, h, a = 2048, 1, 8192, 64
    sbh = s * b * h
    assert layer_activation_bytes(LLAMA3_70B, s, b, True, tp=8) == sbh * (10 + 3 + 5 * a * s / (h * 8))
    assert layer_activation_bytes(LLAMA3_70B, s, b, True, tp=8, sequence_parallel=True) == \
        sbh * (34 / 8 + 5 * a * s / (h * 8))
    assert layer_activation_bytes(LLAMA3_70B, s, b, True, tp=1, sequence_parallel=True) == \
        layer_activation_bytes(LLAMA3_70B, s, b, True) == sbh * (34 + 5 * a * s / h)
    # The last rank's logits split by vocabulary.
    assert rank_bytes(LLAMA3_70B, "FSDP mixed", 4, 2, 3, s, b, tp=8)["logits"] == 4 * s * b * 128256 / 8


def test_state_table_cells_by_hand():
    # 8B at PP 4: the last stage (8 layers + head + final norm) is the largest.
    n = 8 * LLAMA3_8B.layer_params() + 128256 * 4096 + 4096
    assert n == max(LLAMA3_8B.stage_params(4, s) for s in range(4))
    row = next(r for r in state_table(LLAMA3_8B, 4).splitlines() if r.startswith("| 32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "4 x 8"
    assert cells[2:] == [f"{n * 16 / GIB:.1f}", f"{n * 18 / GIB:.1f}", f"{n * 7.5 / GIB:.1f}",
                         f"{n * 2 / GIB:.1f} + {n * 6 / GIB:.1f}", f"{n * 2 / GIB:.1f} + {n * 8 / GIB:.1f}"]
    assert len(LAYOUTS) == 5
    # Nothing to shard over at DP 1: FSDP's cells are empty.
    row = next(r for r in state_table(LLAMA3_70B, 8).splitlines() if r.startswith("| 8 |"))
    assert row.rstrip(" |").endswith("| - | -")
    # PP 4 x TP 8 on 128 ranks: DP 4; 40 and 48 ranks are not multiples of 32 and have no row.
    rows = state_table(LLAMA3_70B, 4, tp=8, ranks=(32, 40, 48, 128)).splitlines()
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["32", "128"]
    n = max(LLAMA3_70B.stage_params(4, s, 8) for s in range(4))
    assert rows[-1].split("|")[2].strip() == "4 x 8 x 4"
    assert rows[-1].split("|")[5].strip() == f"{n * (6 + 12 / 4) / GIB:.1f}"


def test_the_section_is_replaced_in_place_and_the_others_kept(tmp_path):
    from benchmarks.bench_memory import TITLE, write_section

    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n\n## Before\n\nkept 1\n")
    write_section(out, f"## {TITLE}\n\nfirst\n")
    assert out.read_text() == f"# Benchmarks\n\n## Before\n\nkept 1\n\n## {TITLE}\n\nfirst\n"
    out.write_text(out.read_text() + "\n## After\n\nkept 2\n")
    write_section(out, f"## {TITLE}\n\nsecond\n")
    assert out.read_text() == f"# Benchmarks\n\n## Before\n\nkept 1\n\n## {TITLE}\n\nsecond\n\n## After\n\nkept 2\n"


# ---------------------------------------------------------------- against the runtime's own footprint

# rrfp's ``hf:llama`` preset (rrfp/model/spec.py): 4 layers, hidden 128, SwiGLU 344, 4 heads, 2
# key/value heads, byte vocabulary 256, untied head.
PRESET = Llama("hf:llama", 4, 128, 344, 4, 2, 256)


def _stages_after_steps(precision: str | None, microbatches: int = 2):
    """rrfp's two stages of ``hf:llama`` (built per stage, as each rank builds its own), after
    one step: ``microbatches`` forward/backward passes, then AdamW. ``precision``: None keeps
    them replicated; ``"fp32"`` / ``"bf16"`` shards them over a DP mesh of 2 (FSDP2 through
    rrfp's ``shard_stage``, as ``--dp-shard full``), gradient sync held to the last backward as
    the pipeline holds it; then the gathered bytes seen before the reduction."""
    import torch

    from rrfp.model.hf import build_hf_stages
    from rrfp.parallel.footprint import gathered_bytes
    from rrfp.parallel.sharded import fsdp_modules
    from rrfp.parallel.train import shard_stage

    stages, _ = build_hf_stages("llama", 2, [0, 1])
    gathered = [(0, 0), (0, 0)]
    if precision is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for i, st in enumerate(stages):
            shard_stage(st, None, precision=precision, last=i == 1, mesh=mesh)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for mb in range(microbatches):
        last = mb == microbatches - 1
        if precision is not None:
            for st in stages:
                st.set_requires_gradient_sync(last)
                st.set_reshard_after_backward(last)
        stages[1](*stages[0](x)).float().square().mean().backward()
        if precision is not None and mb == microbatches - 2:  # held until the last backward
            gathered = [gathered_bytes(fsdp_modules(st)) for st in stages]
    opt = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=1e-3)
    opt.step()
    return stages, opt, gathered


def test_the_runtimes_replicated_footprint_is_the_models():
    from rrfp.parallel.footprint import footprint

    stages, opt, _ = _stages_after_steps(None)
    for s, st in enumerate(stages):
        n = PRESET.stage_params(2, s)
        assert sum(p.numel() for p in st.parameters()) == n
        fp = footprint([st])
        want = kind_bytes_per_param("replicated fp32", 1)
        assert (fp.params, fp.grads) == (n * want["params"], n * want["grads"])
    fp = footprint(stages, opt)
    # AdamW's two fp32 moments per element, and a 4-byte step counter per parameter tensor
    # (the model leaves the counters out: 0.02% here, nothing at scale).
    tensors = sum(1 for st in stages for _ in st.parameters())
    assert fp.optimizer == PRESET.params() * kind_bytes_per_param("replicated fp32", 1)["optimizer"] + 4 * tensors


@pytest.fixture
def fake_dp2():
    """A process group of 2 ranks in this process (torch's fake backend: collectives return
    at once, so shapes and bytes are real and values are not), as rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision,layout", [("fp32", "FSDP fp32"), ("bf16", "FSDP mixed")])
def test_the_runtimes_sharded_footprint_and_gathered_bytes_are_the_models(fake_dp2, precision, layout):
    from rrfp.parallel.footprint import footprint

    stages, opt, gathered = _stages_after_steps(precision)
    want = kind_bytes_per_param(layout, 2)
    tensors = 0
    for s, st in enumerate(stages):
        n = PRESET.stage_params(2, s)
        fp = footprint([st])
        assert (fp.params, fp.grads) == (n * want["params"], n * want["grads"])  # every dim-0 even: exact halves
        # Within the step, before the reduction: the whole stage gathered (bf16 under the
        # mixed policy) and its unsharded gradients (fp32: the reduce dtype).
        assert gathered[s] == (n * want["gathered_params"], n * want["gathered_grads"])
        tensors += sum(1 for _ in st.parameters())
    assert footprint(stages, opt).optimizer == PRESET.params() * want["optimizer"] + 4 * tensors
