"""The memory model's projection (benchmarks/memory_model.py) against the numbers and formulas
published for it: Llama-3's parameter counts (Meta's checkpoints; transformers' own model),
Megatron-LM's bytes-per-parameter table, and Korthikanti et al.'s activation formula.
Pure arithmetic."""

from __future__ import annotations

import pytest

from benchmarks.memory_model import (GIB, LAYOUTS, LLAMA3_70B, LLAMA3_8B, Llama, layer_activation_bytes, rank_bytes,
                                     state_bytes_per_param, state_table)


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


def test_the_section_is_replaced_in_place_and_the_others_kept(tmp_path):
    from benchmarks.bench_memory import TITLE, write_section

    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n\n## Before\n\nkept 1\n")
    write_section(out, f"## {TITLE}\n\nfirst\n")
    assert out.read_text() == f"# Benchmarks\n\n## Before\n\nkept 1\n\n## {TITLE}\n\nfirst\n"
    out.write_text(out.read_text() + "\n## After\n\nkept 2\n")
    write_section(out, f"## {TITLE}\n\nsecond\n")
    assert out.read_text() == f"# Benchmarks\n\n## Before\n\nkept 1\n\n## {TITLE}\n\nsecond\n\n## After\n\nkept 2\n"
