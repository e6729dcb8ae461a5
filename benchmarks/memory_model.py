"""The memory model on paper: bytes per rank of a Llama config under pipeline x data
parallelism (replicated or sharded) x tensor parallelism, projected to Llama-3 8B and 70B on
8-128 ranks.

Pure arithmetic (no torch): the same kinds the runtime measures (``rrfp.parallel.footprint``:
parameters, gradients, optimizer states, FSDP2's gathered transient; activations), counted by
the formulas the large-model frameworks publish:

* **Parameters** of a Llama decoder: per layer ``2 d^2 (1 + kv/heads)`` (q, o; k, v with
  grouped-query attention) ``+ 3 d f`` (SwiGLU) ``+ 2 d`` (two RMSNorms); embedding and output
  head ``V d`` each (Llama-3 does not tie them) and a final norm ``d``. The pipeline splits the
  layers evenly; the first stage adds the embedding, the last the head and final norm. Tensor
  parallelism ``t`` splits the layer's matrices and (vocabulary-parallel, as Megatron and
  torchtitan do) the embedding and head ``t`` ways; the norms stay whole.
* **Bytes per parameter** (AdamW: two fp32 moments), Megatron-LM's table
  (``docs/source/api-guide/dist_optimizer.md``, "the theoretical number of bytes per
  parameter ... where d is the data parallel size"): bf16 parameters with fp32 gradients,
  18 replicated and ``6 + 12/d`` with the distributed optimizer; fp32 parameters and gradients,
  16 and ``8 + 8/d``. The ZeRO paper's stages (fp16 gradients): ``4 + 12/d``, ``2 + 14/d``,
  ``16/d``. FSDP2 ``fully_shard`` (torchtitan's PP x FSDP; ``rrfp train --dp-shard full``)
  shards all of it: ``16/d`` (fp32 parameters, gradients and moments, sharded), plus, within a
  step, the stage's gathered parameters and its unsharded gradients: torchtitan keeps them
  gathered through a pipeline step ("For PP, by default do not reshard after forward to avoid
  per-microbatch all-gathers", ``get_fsdp_reshard_after_forward_policy``), so a rank holds
  ``2 + 4`` bytes per stage parameter more under ``MixedPrecisionPolicy(bf16, fp32)`` (bf16
  copies; FSDP2 accumulates unsharded gradients in the fp32 reduce dtype) and ``4 + 4`` in
  fp32. ``tests/test_memory_model.py`` measures both transients and the sharded state on a
  Llama stage rrfp builds and shards (``rrfp.parallel.footprint``).
* **Activations** per layer and microbatch of ``s`` tokens x ``b`` samples, width ``h``, ``a``
  heads, 16-bit: ``s b h (34 + 5 a s / h)`` bytes (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198, §4.1, Table 2); ``34 s b h``
  when the attention scores are not stored (their §5 selective recomputation; what a fused
  flash-attention kernel also keeps); under TP ``t`` ``s b h (10 + 24/t)``, with sequence
  parallelism ``34 s b h / t``. Under 1F1B pipeline rank ``r`` of ``p`` holds ``p - r``
  microbatches in flight (rrfp's in-flight limit of the ``1f1b`` hint), so the first stage holds
  ``p`` microbatches of ``L/p`` layers: ``L`` layers' worth, ``s b h L (34 + 5 a s / h)``
  (their §4.2.3). The formula is GPT-3's layer (4h GeLU MLP, dropout masks); a Llama layer
  (SwiGLU, no dropout) differs in the constant, so these rows are the published yardstick,
  not a Llama measurement. The last stage also holds its microbatch's logits for the loss:
  ``4 s b V`` bytes in fp32 (``/ t`` vocabulary-parallel).
"""

from __future__ import annotations

import dataclasses

GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Llama:
    """A Llama decoder's shape.

    Attributes:
        name: shown in tables.
        n_layers, d, ffn, heads, kv_heads, vocab: layers, width, SwiGLU hidden size, attention
            and key/value heads, vocabulary.
    """

    name: str
    n_layers: int
    d: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one of ``tp`` tensor-parallel ranks: the
        attention and MLP matrices split ``tp`` ways (Megatron's column/row split, torchtitan's
        plan), the two RMSNorms whole.

        Raises:
            ValueError: ``tp`` does not divide the heads, key/value heads and MLP width.
        """
        if self.heads % tp or self.kv_heads % tp or self.ffn % tp:
            raise ValueError(f"tp={tp}: expected a divisor of {self.heads} heads, {self.kv_heads} key/value heads "
                             f"and MLP width {self.ffn}")
        kv = self.d * self.d * self.kv_heads // self.heads
        return (2 * self.d * self.d + 2 * kv + 3 * self.d * self.ffn) // tp + 2 * self.d

    def params(self) -> int:
        """Parameters of the whole model (untied embedding and head)."""
        return self.n_layers * self.layer_params() + 2 * self.vocab * self.d + self.d

    def stage_layers(self, pp: int, stage: int) -> int:
        """Decoder layers of pipeline stage ``stage`` of ``pp``: split evenly, the extra ones to
        the first stages (``torch.tensor_split``, as ``rrfp.model.gpt.stage_layer_ranges``)."""
        return self.n_layers // pp + (1 if stage < self.n_layers % pp else 0)

    def stage_params(self, pp: int, stage: int, tp: int = 1) -> int:
        """Parameters of pipeline stage ``stage`` of ``pp`` on one of ``tp`` tensor-parallel
        ranks: its layers, the embedding on the first stage, the head and final norm on the
        last; under TP the embedding and head split by vocabulary (Megatron's
        ``VocabParallelEmbedding``, torchtitan's plan; rrfp's GPT keeps them whole)."""
        extra = (self.vocab * self.d // tp if stage == 0 else 0) + \
            (self.vocab * self.d // tp + self.d if stage == pp - 1 else 0)
        return self.stage_layers(pp, stage) * self.layer_params(tp) + extra


LLAMA3_8B = Llama("Llama-3 8B", 32, 4096, 14336, 32, 8, 128256)
LLAMA3_70B = Llama("Llama-3 70B", 80, 8192, 28672, 64, 8, 128256)

LAYOUTS = ("replicated fp32", "replicated mixed", "distributed optimizer", "FSDP mixed", "FSDP fp32")
"""The options a rank's state is projected for: PP x DP replicated in fp32 (rrfp's
``--dp-shard none``), replicated with bf16 parameters and fp32 main gradients (Megatron without
the distributed optimizer), Megatron's distributed optimizer, PP x FSDP2 with
``MixedPrecisionPolicy(bf16, fp32)`` (torchtitan's default) and in fp32 (``--dp-shard full``)."""

ZERO_STAGES = ("ZeRO-1", "ZeRO-2", "ZeRO-3")
"""The ZeRO paper's stages (Rajbhandari et al. 2020, arXiv 1910.02054, §5, Figure 1: mixed
precision Adam, fp16 parameters and gradients, ``K = 12`` bytes of optimizer states):
``P_os`` ``4 + 12/d``, ``P_os+g`` ``2 + 14/d``, ``P_os+g+p`` ``16/d`` bytes per parameter."""

KINDS = ("params", "grads", "optimizer", "gathered_params", "gathered_grads")
"""The kinds, as :class:`rrfp.parallel.footprint.Footprint` names them."""


def kind_bytes_per_param(layout: str, dp: int) -> dict[str, float]:
    """Bytes per parameter of a stage on one rank, by kind (:data:`KINDS`), for ``layout``
    (:data:`LAYOUTS` or :data:`ZERO_STAGES`) over ``dp`` data-parallel ranks.

    The optimizer states include fp32 master weights where the parameters are 16-bit (Megatron
    and ZeRO count them there: ``K = 12``). ``gathered_*`` is what a pipeline step holds on top
    (FSDP2 with ``reshard_after_forward=False``: the stage's unsharded parameters, 2 bytes in
    bf16, and its unsharded gradients, accumulated in the fp32 reduce dtype).

    Raises:
        ValueError: an unknown layout or ``dp < 1``.
    """
    if dp < 1:
        raise ValueError(f"dp={dp}: expected a data-parallel degree >= 1")
    d = dp
    table = {
        "replicated fp32": (4, 4, 8, 0, 0),
        "replicated mixed": (2, 4, 12, 0, 0),
        "distributed optimizer": (2, 4, 12 / d, 0, 0),
        "FSDP mixed": (4 / d, 4 / d, 8 / d, 2, 4),
        "FSDP fp32": (4 / d, 4 / d, 8 / d, 4, 4),
        "ZeRO-1": (2, 2, 12 / d, 0, 0),
        "ZeRO-2": (2, 2 / d, 12 / d, 0, 0),
        "ZeRO-3": (2 / d, 2 / d, 12 / d, 0, 0),
    }
    if layout not in table:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS + ZERO_STAGES)}")
    return dict(zip(KINDS, table[layout]))


def state_bytes_per_param(layout: str, dp: int) -> tuple[float, float]:
    """``(bytes held between steps, bytes more within a step)`` per parameter of a stage on one
    rank: :func:`kind_bytes_per_param` summed.

    Raises:
        ValueError: as :func:`kind_bytes_per_param`.
    """
    k = kind_bytes_per_param(layout, dp)
    return k["params"] + k["grads"] + k["optimizer"], k["gathered_params"] + k["gathered_grads"]


def layer_activation_bytes(m: Llama, seq: int, micro: int, store_scores: bool, tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one layer holds for one microbatch (16-bit), Korthikanti et al.'s Table 2:
    ``s b h (34 + 5 a s / h)``; under tensor parallelism ``t`` ``s b h (10 + 24/t + 5 a s / (h t))``,
    with sequence parallelism ``s b h (34/t + 5 a s / (h t))``; without the attention scores
    (``store_scores=False``: selective recomputation, a flash-attention kernel) the ``5 a s``
    term goes."""
    sbh = seq * micro * m.d
    scores = 5 * m.heads * seq * seq * micro / tp if store_scores else 0
    return (34 * sbh / tp if sequence_parallel else 10 * sbh + 24 * sbh / tp) + scores


def rank_bytes(m: Llama, layout: str, pp: int, dp: int, rank: int, seq: int, micro: int, store_scores: bool = False,
               inflight: int | None = None, tp: int = 1, sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes pipeline rank ``rank`` of ``pp`` holds under ``layout`` over ``dp`` replicas and
    ``tp`` tensor-parallel ranks (:meth:`Llama.stage_params`).

    Args:
        inflight: microbatches in flight on the rank (default 1F1B's ``pp - rank``).

    Returns:
        ``{"state", "transient", "activations", "logits"}`` in bytes: the state between steps,
        FSDP's gathered transient within a step, the activations of the microbatches in
        flight, and (last rank) one microbatch's fp32 logits (vocabulary-parallel under TP).
    """
    n = m.stage_params(pp, rank, tp)
    keep, more = state_bytes_per_param(layout, dp)
    k = pp - rank if inflight is None else inflight
    act = layer_activation_bytes(m, seq, micro, store_scores, tp, sequence_parallel)
    return {"state": n * keep, "transient": n * more, "activations": k * m.stage_layers(pp, rank) * act,
            "logits": 4 * seq * micro * m.vocab / tp if rank == pp - 1 else 0}


def state_table(m: Llama, pp: int, tp: int = 1, ranks=(8, 16, 32, 64, 128)) -> str:
    """Markdown: GiB per rank of parameters, gradients and optimizer states (the stage with the
    embedding or the head: the largest), by layout, at pipeline degree ``pp``, tensor-parallel
    degree ``tp`` and data-parallel degree ``N / (pp tp)`` for each ``N`` in ``ranks`` (those it
    divides); FSDP's ``+`` is what a step gathers on top."""
    head = "PP x TP x DP" if tp > 1 else "PP x DP"
    rows = [f"| ranks | {head} | " + " | ".join(LAYOUTS) + " |", "|---|---|" + "---|" * len(LAYOUTS)]
    n_max = max(m.stage_params(pp, r, tp) for r in range(pp))
    for n in ranks:
        if n % (pp * tp):
            continue
        dp = n // (pp * tp)
        cells = []
        for lay in LAYOUTS:
            keep, more = state_bytes_per_param(lay, dp)
            if more and dp == 1:
                cells.append("-")  # nothing to shard over
                continue
            cells.append(f"{n_max * keep / GIB:.1f}" + (f" + {n_max * more / GIB:.1f}" if more else ""))
        shape = f"{pp} x {tp} x {dp}" if tp > 1 else f"{pp} x {dp}"
        rows.append(f"| {n} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def activation_table(m: Llama, pps=(4, 8, 16), seq: int = 8192, micro: int = 1, tp: int = 8) -> str:
    """Markdown: GiB of activations at 1F1B's in-flight limit (rank ``r`` holds ``p - r``
    microbatches), by pipeline degree: one microbatch on one stage, then rank 0 (``p`` of them:
    ``L`` layers' worth) without the attention scores (``34 sbh`` per layer), storing them
    (``sbh(34 + 5as/h)``), under tensor parallelism ``tp`` without and with sequence
    parallelism (``sbh(10 + 24/t)``, ``34 sbh / t``), under full recomputation (each layer's
    input only, ``2 sbh``), and the last rank's fp32 logits (whole, and split ``tp`` ways)."""
    rows = ["| PP | per microbatch per stage | rank 0, 34sbh | rank 0, sbh(34 + 5as/h) | "
            f"rank 0, TP {tp}: sbh(10 + 24/t) | rank 0, TP {tp} + SP: 34sbh/t | rank 0, full recompute 2sbh "
            f"| last rank's logits (TP {tp}) |", "|---|---|---|---|---|---|---|---|"]
    for pp in pps:
        per = m.stage_layers(pp, 0) * layer_activation_bytes(m, seq, micro, False)

        def r0(**kw) -> float:
            return rank_bytes(m, LAYOUTS[0], pp, 1, 0, seq, micro, **kw)["activations"]

        recompute = pp * m.stage_layers(pp, 0) * 2 * seq * micro * m.d
        logits = rank_bytes(m, LAYOUTS[0], pp, 1, pp - 1, seq, micro)["logits"]
        rows.append(f"| {pp} | {per / GIB:.1f} | {r0() / GIB:.1f} | {r0(store_scores=True) / GIB:.0f} | "
                    f"{r0(tp=tp) / GIB:.1f} | {r0(tp=tp, sequence_parallel=True) / GIB:.1f} | {recompute / GIB:.1f} | "
                    f"{logits / GIB:.1f} ({logits / tp / GIB:.2f}) |")
    return "\n".join(rows)


def report(seq: int = 8192, micro: int = 1) -> str:
    """The projection's tables: both models' state per rank by layout (the 70B also at TP 8),
    and their activations."""
    out = []
    for m, pp, tps in ((LLAMA3_8B, 4, (1,)), (LLAMA3_70B, 8, (1,))):
        first, last = m.stage_params(pp, 0), m.stage_params(pp, pp - 1)
        out += [f"**{m.name}** ({m.n_layers} layers, d {m.d}, ffn {m.ffn}, {m.heads}/{m.kv_heads} heads, vocab "
                f"{m.vocab}: {m.params():,} parameters; at PP {pp} the first stage has {first:,}, the last {last:,}). "
                "State per rank, GiB (FSDP: sharded state + what a step gathers):", "", state_table(m, pp), ""]
    m = LLAMA3_70B
    out += [f"**{m.name} at PP 4 x TP 8** (torchtitan's and Megatron's usual shape for it: TP within an 8-GPU node; "
            f"the largest stage holds {max(m.stage_params(4, r, 8) for r in range(4)):,} parameters per TP rank, "
            "embedding and head split by vocabulary):", "", state_table(m, 4, tp=8), ""]
    for m in (LLAMA3_8B, LLAMA3_70B):
        out += [f"{m.name} activations, GiB (sequence {seq}, microbatch {micro}, 16-bit):", "",
                activation_table(m, seq=seq, micro=micro), ""]
    return "\n".join(out)
