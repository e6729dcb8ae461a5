"""Plain tables of the models (no torch, no transformers), for checking ``rrfp train``'s flags
before any rank starts: what ``--model hf:<name>`` may name (built in :mod:`rrfp.model.hf`) and
the activation-checkpointing modes (:mod:`rrfp.model.checkpointing`), and the byte-level GPT's
configurations and the multimodal preset (built in :mod:`rrfp.model.gpt` and
:mod:`rrfp.model.multimodal`)."""

from dataclasses import dataclass, field

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


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`.

    Attributes:
        vocab_size: number of token ids; 256 for byte-level text.
        max_len: longest sequence (tokens per sample) the position embedding covers.
        n_layer: number of transformer blocks; also the most pipeline stages
            the model can be split into.
        n_head: attention heads; must divide ``d_model``.
        d_model: width of the residual stream (hidden size D).
        d_ff: width of the MLP; ``None`` means ``4 * d_model``.
        dropout: dropout probability on attention weights, attention output and
            MLP output; only active in ``train()`` mode.

    Raises:
        ValueError: if a size is not positive, ``n_head`` does not divide
            ``d_model`` or ``dropout`` is outside ``[0, 1)``.
    """

    vocab_size: int = 256
    max_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"GPTConfig.{name}={value} must be >= 1")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff={self.d_ff} must be >= 1 or None")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.n_head={self.n_head} must divide d_model={self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")

    @property
    def ff_width(self) -> int:
        """Width of the MLP hidden layer (``d_ff`` or ``4 * d_model``)."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model


GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=2, d_model=64),
    "small": GPTConfig(n_layer=8, n_head=4, d_model=128),
    "medium": GPTConfig(n_layer=12, n_head=8, d_model=256),
}
"""Named configurations (byte vocabulary, ``max_len`` 256); copy with
``dataclasses.replace`` before changing a field."""


@dataclass
class MultimodalConfig:
    """Hyper-parameters.

    Attributes:
        decoder: the GPT decoder's configuration (byte vocabulary).
        enc_layers: bidirectional encoder blocks over one image's patches.
        enc_heads, enc_width: the encoder's heads and width.
        max_images: most images per sample (image slots at most).
    """

    decoder: GPTConfig = field(default_factory=lambda: GPTConfig(n_layer=3, n_head=2, d_model=64, max_len=32))
    enc_layers: int = 1
    enc_heads: int = 2
    enc_width: int = 32
    max_images: int = 6

    @property
    def n_units(self) -> int:
        """Split units: the encoder plus each decoder block (the most stages)."""
        return 1 + self.decoder.n_layer


MULTIMODAL = MultimodalConfig()
"""The ``rrfp train --model multimodal`` preset: one encoder block of width 32, 3 decoder blocks
of width 64 (4 units). Its stage 0 costs about 1.5-2.5x a decoder stage, following the image
count."""
