"""The memory model on paper: bytes per rank of a Llama config under pipeline x data
parallelism, replicated or sharded, projected to Llama-3 8B and 70B on 8-128 ranks.

Pure arithmetic (no torch): the same kinds the runtime measures (``rrfp.parallel.footprint``:
parameters, gradients, optimizer states, FSDP2's gathered transient; activations), counted by
the formulas the large-model frameworks publish:

* **Parameters** of a Llama decoder: per layer ``2 d^2 (1 + kv/heads)`` (q, o; k, v with
  grouped-query attention) ``+ 3 d f`` (SwiGLU) ``+ 2 d`` (two RMSNorms); embedding and output
  head ``V d`` each (Llama-3 does not tie them) and a final norm ``d``. The pipeline splits the
  layers evenly; the first stage adds the embedding, the last the head and final norm.
* **Bytes per parameter** (AdamW: two fp32 moments), Megatron-LM's table
  (``docs/source/api-guide/dist_optimizer.md``, "the theoretical number of bytes per
  parameter ... where d is the data parallel size"): bf16 parameters with fp32 gradients,
  18 replicated and ``6 + 12/d`` with the distributed optimizer; fp32 parameters and gradients,
  16 and ``8 + 8/d``. FSDP2 ``fully_shard`` (torchtitan's PP x FSDP; ``rrfp train --dp-shard
  full``) shards all of it: ``16/d`` (fp32 parameters, gradients and moments, sharded), plus,
  within a step, the stage's gathered parameters and its unsharded gradients: torchtitan keeps
  them gathered through a pipeline step ("For PP, by default do not reshard after forward to
  avoid per-microbatch all-gathers", ``get_fsdp_reshard_after_forward_policy``), so a rank
  holds ``2 + 4`` bytes per stage parameter more under ``MixedPrecisionPolicy(bf16, fp32)``
  (bf16 copies, gradients accumulated in fp32) and ``4 + 4`` in fp32.
* **Activations** per layer and microbatch of ``s`` tokens x ``b`` samples, width ``h``, ``a``
  heads, 16-bit: ``s b h (34 + 5 a s / h)`` bytes (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198, §4.1); ``34 s b h`` when the
  attention scores are not stored (their §5 selective recomputation; what a fused
  flash-attention kernel also keeps). Under 1F1B pipeline rank ``r`` of ``p`` holds ``p - r``
  microbatches in flight (rrfp's in-flight limit of the ``1f1b`` hint), so the first stage holds
  ``p`` microbatches of ``L/p`` layers: ``L`` layers' worth, ``s b h L (34 + 5 a s / h)``
  (their §4.2.3). The formula is GPT-3's layer (4h GeLU MLP, dropout masks); a Llama layer
  (SwiGLU, no dropout) differs in the constant, so these rows are the published yardstick,
  not a Llama measurement. The last stage also holds its microbatch's logits for the loss:
  ``4 s b V`` bytes in fp32.
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

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        kv = self.d * self.d * self.kv_heads // self.heads
        return 2 * self.d * self.d + 2 * kv + 3 * self.d * self.ffn + 2 * self.d

    def params(self) -> int:
        """Parameters of the whole model (untied embedding and head)."""
        return self.n_layers * self.layer_params() + 2 * self.vocab * self.d + self.d

    def stage_params(self, pp: int, stage: int) -> int:
        """Parameters of pipeline stage ``stage`` of ``pp`` (layers split evenly, the extra
        ones to the first stages)."""
        layers = self.n_layers // pp + (1 if stage < self.n_layers % pp else 0)
        extra = (self.vocab * self.d if stage == 0 else 0) + (self.vocab * self.d + self.d if stage == pp - 1 else 0)
        return layers * self.layer_params() + extra


LLAMA3_8B = Llama("Llama-3 8B", 32, 4096, 14336, 32, 8, 128256)
LLAMA3_70B = Llama("Llama-3 70B", 80, 8192, 28672, 64, 8, 128256)

LAYOUTS = ("replicated fp32", "replicated mixed", "distributed optimizer", "FSDP mixed", "FSDP fp32")
"""The options a rank's state is projected for: PP x DP replicated in fp32 (rrfp's
``--dp-shard none``), replicated with bf16 parameters and fp32 main gradients (Megatron without
the distributed optimizer), Megatron's distributed optimizer, PP x FSDP2 with
``MixedPrecisionPolicy(bf16, fp32)`` (torchtitan's default) and in fp32 (``--dp-shard full``)."""


def state_bytes_per_param(layout: str, dp: int) -> tuple[float, float]:
    """``(bytes held between steps, bytes more within a step)`` per parameter of a stage on one
    rank, for ``layout`` (:data:`LAYOUTS`) over ``dp`` data-parallel ranks.

    Raises:
        ValueError: an unknown layout or ``dp < 1``.
    """
    if dp < 1:
        raise ValueError(f"dp={dp}: expected a data-parallel degree >= 1")
    table = {
        "replicated fp32": (16.0, 0.0),
        "replicated mixed": (18.0, 0.0),
        "distributed optimizer": (6 + 12 / dp, 0.0),
        "FSDP mixed": (16 / dp, 2.0 + 4.0),
        "FSDP fp32": (16 / dp, 4.0 + 4.0),
    }
    if layout not in table:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return table[layout]


def layer_activation_bytes(m: Llama, seq: int, micro: int, store_scores: bool) -> int:
    """Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` bytes per layer and microbatch (16-bit),
    or ``34 s b h`` without the attention scores (``store_scores=False``)."""
    sbh = seq * micro * m.d
    return 34 * sbh + (5 * m.heads * seq * seq * micro if store_scores else 0)


def rank_bytes(m: Llama, layout: str, pp: int, dp: int, rank: int, seq: int, micro: int, store_scores: bool = False,
               inflight: int | None = None) -> dict[str, float]:
    """Bytes pipeline rank ``rank`` of ``pp`` holds under ``layout`` over ``dp`` replicas.

    Args:
        inflight: microbatches in flight on the rank (default 1F1B's ``pp - rank``).

    Returns:
        ``{"state", "transient", "activations", "logits"}`` in bytes: the state between steps,
        FSDP's gathered transient within a step, the activations of the microbatches in
        flight, and (last rank) one microbatch's fp32 logits.
    """
    n = m.stage_params(pp, rank)
    keep, more = state_bytes_per_param(layout, dp)
    layers = m.n_layers // pp + (1 if rank < m.n_layers % pp else 0)
    k = pp - rank if inflight is None else inflight
    return {"state": n * keep, "transient": n * more,
            "activations": k * layers * layer_activation_bytes(m, seq, micro, store_scores),
            "logits": 4 * seq * micro * m.vocab if rank == pp - 1 else 0}


def state_table(m: Llama, pp: int, ranks=(8, 16, 32, 64, 128)) -> str:
    """Markdown: GiB per rank of parameters, gradients and optimizer states (the stage with the
    embedding or the head: the largest), by layout, at pipeline degree ``pp`` and data-parallel
    degree ``N / pp`` for each ``N`` in ``ranks``; FSDP's ``+`` is what a step gathers on top."""
    rows = ["| ranks | PP x DP | " + " | ".join(LAYOUTS) + " |", "|---|---|" + "---|" * len(LAYOUTS)]
    n_max = max(m.stage_params(pp, r) for r in range(pp))
    for n in ranks:
        if n % pp:
            continue
        dp = n // pp
        cells = []
        for lay in LAYOUTS:
            keep, more = state_bytes_per_param(lay, dp)
            if more and dp == 1:
                cells.append("-")  # nothing to shard over
                continue
            cells.append(f"{n_max * keep / GIB:.1f}" + (f" + {n_max * more / GIB:.1f}" if more else ""))
        rows.append(f"| {n} | {pp} x {dp} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def activation_table(m: Llama, pps=(4, 8, 16), seq: int = 8192, micro: int = 1) -> str:
    """Markdown: GiB of activations at 1F1B's in-flight limit (rank ``r`` holds ``p - r``
    microbatches), by pipeline degree: one microbatch on one stage, rank 0 (``p`` of them:
    ``L`` layers' worth) without the attention scores (``34 sbh`` per layer), storing them
    (``sbh(34 + 5as/h)``), under full recomputation (each layer's input only, ``2 sbh``), and
    the last rank's fp32 logits."""
    rows = ["| PP | per microbatch per stage | rank 0, 34sbh | rank 0, sbh(34 + 5as/h) | rank 0, full recompute 2sbh "
            "| last rank's logits |", "|---|---|---|---|---|---|"]
    for pp in pps:
        per = m.n_layers // pp * layer_activation_bytes(m, seq, micro, False)
        r0 = rank_bytes(m, LAYOUTS[0], pp, 1, 0, seq, micro)["activations"]
        full = rank_bytes(m, LAYOUTS[0], pp, 1, 0, seq, micro, store_scores=True)["activations"]
        recompute = pp * (m.n_layers // pp) * 2 * seq * micro * m.d
        logits = rank_bytes(m, LAYOUTS[0], pp, 1, pp - 1, seq, micro)["logits"]
        rows.append(f"| {pp} | {per / GIB:.1f} | {r0 / GIB:.1f} | {full / GIB:.0f} | {recompute / GIB:.1f} | "
                    f"{logits / GIB:.1f} |")
    return "\n".join(rows)


def report(seq: int = 8192, micro: int = 1) -> str:
    """The projection's tables: both models' state per rank by layout, and their activations."""
    out = []
    for m, pp in ((LLAMA3_8B, 4), (LLAMA3_70B, 8)):
        first, last = m.stage_params(pp, 0), m.stage_params(pp, pp - 1)
        out += [f"**{m.name}** ({m.n_layers} layers, d {m.d}, ffn {m.ffn}, {m.heads}/{m.kv_heads} heads, vocab "
                f"{m.vocab}: {m.params():,} parameters; at PP {pp} the first stage has {first:,}, the last {last:,}). "
                "State per rank, GiB (FSDP: sharded state + what a step gathers):", "", state_table(m, pp), "",
                f"Activations, GiB (sequence {seq}, microbatch {micro}, 16-bit):", "",
                activation_table(m, seq=seq, micro=micro), ""]
    return "\n".join(out)
