"""Model FLOPs of a training step, TFLOP/s per rank and MFU (model FLOPs utilisation).

Counted by formula, not measured: a forward and backward over ``P`` positions (``b`` samples
of ``T`` positions) of a stage with ``N`` matmul parameters and ``L`` attention layers of width
``d`` costs ``P * (6 N + 12 L d T)`` FLOPs (PaLM, Chowdhery et al. 2022, App. B; the convention
of Megatron-LM and torchtitan). ``6 N``: two FLOPs per multiply-add, once in the forward and
twice in the backward (input and weight gradients); ``12 L d T``: the attention scores and
their weighted sum, forward and backward (the causal half is not discounted). Embedding
lookups are no FLOPs, so their tables are not in ``N``; recomputation under activation
checkpointing is not counted (that would be hardware FLOPs, not model FLOPs).

Why a formula: ``torch.utils.flop_counter.FlopCounterMode`` counts the same matmuls (the
tests check the formula against it within 2%), but it is a dispatch mode on the calling
thread that slows every op it sees, while the runtime runs a step's tasks in its own order,
on its executor's thread. The formula needs only each forward's input shape, taken by a
forward hook on each stage module (:class:`StepFlops`).

Positions are the padded ones each microbatch runs (``b x T_m``), what the hardware
computes; ``tok/s`` on the step line counts real target tokens.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "peak_tflops", "stage_flop_rates", "StepFlops"]

PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "A100": 312.0,
    "L40S": 362.05,
    "V100": 125.0,
}
"""Dense BF16 (V100: FP16) tensor-core peak TFLOP/s by GPU name, from NVIDIA's datasheets
(without sparsity). Matched against ``torch.cuda.get_device_name()`` by substring, longest name
first (``NVIDIA H100 PCIe`` -> ``H100 PCIe``)."""


def peak_tflops(given: float | None, device: torch.device | None) -> float | None:
    """The peak MFU is measured against: ``--peak-tflops`` when given, else the table's
    entry for this CUDA device's name, else None (no MFU: a CPU has no table entry)."""
    if given is not None:
        return given
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return None


def _attention_shape(module: nn.Module) -> tuple[int, int]:
    """(attention layers, width) of a stage module: rrfp's GPT stages and Hugging Face stages
    say; other modules count as no attention (their ``6 N`` only)."""
    layers = getattr(module, "layer_modules", None)
    if layers is None:
        layers = getattr(module, "blocks", None)
    cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    width = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if layers is None or width is None:
        return 0, 0
    return len(layers), int(width)


def stage_flop_rates(module: nn.Module, tp: int = 1) -> tuple[float, float]:
    """``(6 N, 12 L d / tp)`` of one stage module: the FLOPs per position are
    ``a + c * T`` for a sequence of ``T`` positions. ``N`` counts this module's parameters
    but embedding tables (already this rank's TP shard); ``tp`` divides the attention, whose
    heads the TP ranks split."""
    embeddings = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    n = sum(p.numel() for p in module.parameters() if id(p) not in embeddings)
    layers, width = _attention_shape(module)
    return 6.0 * n, 12.0 * layers * width / tp


class StepFlops:
    """Counts the model FLOPs of the training forwards (and so their backwards) that this
    rank's stage modules run: a forward hook reads each input's leading ``[b, T]`` and adds
    ``b T (a + c T)`` (:func:`stage_flop_rates`). Forwards under ``torch.no_grad`` (evaluation)
    are not counted.

    Args:
        modules: this rank's stage modules.
        tp: the tensor-parallel degree (:func:`stage_flop_rates`).
    """

    def __init__(self, modules: list[nn.Module], tp: int = 1) -> None:
        self.total = 0.0
        self._handles = []
        for m in modules:
            a, c = stage_flop_rates(m, tp)

            def hook(_mod, inputs, a=a, c=c) -> None:
                x = inputs[0] if inputs else None
                if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.dim() >= 2:
                    b, t = x.shape[0], x.shape[1]
                    self.total += b * t * (a + c * t)

            self._handles.append(m.register_forward_pre_hook(hook))

    def take(self) -> float:
        """The FLOPs counted since the last call, and start again from zero."""
        total, self.total = self.total, 0.0
        return total
