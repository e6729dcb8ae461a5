"""Plain tables of the models (no torch, no transformers), for checking ``rrfp train``'s flags
before any rank starts: what ``--model hf:<name>`` may name (built in :mod:`rrfp.model.hf`) and
the activation-checkpointing modes (:mod:`rrfp.model.checkpointing`)."""

AC_MODES = ("none", "full", "selective")
"""Activation checkpointing per stage: none, full (keep each layer's inputs), selective (also
its matmul and attention outputs)."""

FAMILY_NAMES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
"""Supported ``config.model_type`` values (their layouts: :data:`rrfp.model.hf.FAMILIES`)."""

HF_PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=None, eos_token_id=None)),
    "llama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32)),
}
"""``rrfp train --model hf:<name>``: the package's config class and CPU-sized settings (4
layers, hidden size 128, byte vocabulary of 256, no dropout; random initialisation)."""


def preset_layers(name: str) -> int:
    """Decoder layers of preset ``name``."""
    settings = HF_PRESETS[name][1]
    return int(settings.get("num_hidden_layers", settings.get("n_layer")))
