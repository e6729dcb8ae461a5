"""What the comparison rows add to :mod:`benchmarks.compare`: keyed message delays, the
multimodal workload, and memory budgets in bytes matched to a schedule.

**Message delays** (the communication-variability setting). Every activation and gradient
message between two ranks (not a V placement's turn, which never leaves its rank; the simulator
does not delay it either) gets a delay ``d`` drawn by :func:`rrfp.sim.jitter.injected_delay` keyed by
``(seed, step, sending stage, microbatch, kind)`` on the simulator's message streams (exactly
what ``rrfp simulate --comm-jitter`` draws; ``e`` = 0, so a hit is ``a * b * (0.5 + U)`` with the
level's 10 ms floor ``b``). The message may not be consumed before ``t_sent + d``:

- ``t_sent`` travels with the data. A stage's output carries a float64 stamp tensor
  (:class:`EmitStamp`, the clock at the end of the forward; ``time.monotonic`` is one clock
  for every process of the machine); the next stage's input gradient for that stamp is the
  clock when its backward finished (:class:`ConsumeStamp`), which travels back with the
  gradient message.
- Both systems run the same stage wrapper (:class:`~benchmarks.harness.JitterStage`): at the
  start of a forward it sleeps until ``t_sent + d`` of its input activation, and the first
  thing of its backward (:class:`EmitStamp`'s backward runs before the stage's own nodes) sleeps
  until ``t_sent + d`` of its output gradient. PyTorch's schedules block on each receive right
  before the forward or backward it feeds, so for them this *is* the delayed delivery.
- rrfp additionally gets the same delay on its receive path: the rank's inbox holds each
  arrival until ``t_sent + d`` before the arbiter learns of it
  (``RankRuntime.inbox.hold``, :func:`rrfp_hold`), so a delayed input is not ready and the
  rank can run other ready tasks meanwhile; by the time the wrapper runs, its sleep is zero.

The wrapper counts every delay it draws (sum and number, per rank and round); the harness checks
the totals are the same for every system, so both got the same delays.

**Memory budgets by bytes.** :func:`schedule_budget`: the bytes a fixed schedule (1F1B or GPipe,
as ``rrfp.scheduler.schedules`` orders them, which is PyTorch's order) would hold on this rank
for the given per-microbatch activation sizes (:func:`rrfp.scheduler.memory.order_peak_bytes`);
the sizes are measured by running this rank's stage forward on each microbatch with the same
counting as the runtime's memory budget (storages saved for backward, parameters excluded).

**Multimodal** (``rrfp/model/multimodal.py``, ``rrfp/data/digits.py``): captions of 0-6 digit
images. PyTorch's ``PipelineStage`` needs the first step's shapes forever, so every microbatch
holds one sample with 6 images (its slots ``K = 6`` and caption length 12 fix the decoder's
shapes) and the other samples 0-6 images (uniform); images are passed padded per sample
``[b, 6, 8, 8]`` with their counts, and the first stage packs the real ones before the encoder,
so both systems encode exactly the microbatch's images (its cost follows the count).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import torch

import torch.distributed as dist

from rrfp.data.batches import BatchSampler, microbatch_sizes
from rrfp.data.text import load_samples
from rrfp.model.gpt import GPT, GPTConfig, build_stage, count_tokens, lm_loss
from rrfp.scheduler.tasks import B, F

from .batches import Batch, make_batch, own_storage

MAX_IMAGES = 6


# --------------------------------------------------------------------------- message delays


class MessageDelays:
    """One rank's keyed message delays (shares the :class:`~benchmarks.harness.Injector`'s
    step, seed, ``enabled`` and the per-step totals the harness compares across systems)."""

    def __init__(self, level, injector) -> None:
        self.level = level
        self.inj = injector

    def draw(self, send_stage: int, mb: int, kind: int) -> float:
        """Seconds of delay of the message ``kind`` (F: activation, B: gradient) that
        ``send_stage`` sends for microbatch ``mb`` in the current step."""
        from rrfp.sim.jitter import STREAM_COMM_HIT, STREAM_COMM_SIZE, injected_delay

        if not self.inj.enabled:
            return 0.0
        return injected_delay(self.level, self.inj.seed, self.inj.step, send_stage, mb, kind, 0.0,
                              streams=(STREAM_COMM_HIT, STREAM_COMM_SIZE))

    def wait(self, stamp: torch.Tensor, send_stage: int, mb: int, kind: int) -> None:
        """Sleep until ``stamp + d`` (the message's delivery time); counts ``d``."""
        d = self.draw(send_stage, mb, kind)
        if d > 0:
            self.inj.total += d
            self.inj.count += 1
            left = float(stamp.detach().reshape(-1)[0]) + d - time.monotonic()
            if left > 0:
                time.sleep(left)


def rrfp_hold(delays: MessageDelays) -> Callable[[Any], float]:
    """An rrfp inbox hold (``RankRuntime.inbox.hold``): seconds until an arriving activation
    or gradient's ``t_sent + d``, from the stamp it carries as its last tensor."""
    from rrfp.transport.keys import Direction

    def hold(msg) -> float:
        key, ts = msg.key, msg.tensors[-1] if msg.tensors else None
        if ts is None or ts.dtype != torch.float64:
            return 0.0
        if key.direction == Direction.ACT:
            d = delays.draw(key.stage - 1, key.microbatch, F)
        elif key.direction == Direction.GRAD:
            d = delays.draw(key.stage + 1, key.microbatch, B)
        else:
            return 0.0
        return float(ts.reshape(-1)[0]) + d - time.monotonic() if d > 0 else 0.0

    return hold


class EmitStamp(torch.autograd.Function):
    """``y -> stamp``: float64 ``[samples]`` holding the clock now (the activation's send
    time). Backward: waits for the gradient message's delivery (its stamp + delay; no wait where
    ``delays`` is None: the message does not leave the rank), before any other node of the
    stage's backward (it is the graph's newest node), and adds nothing to ``y``'s gradient."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, delays: MessageDelays | None, mb: int, stage: int) -> torch.Tensor:  # type: ignore[override]
        ctx.delays, ctx.mb, ctx.stage = delays, mb, stage
        return torch.full((y.shape[0],), time.monotonic(), dtype=torch.float64)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        if ctx.delays is not None:
            ctx.delays.wait(g, ctx.stage + 1, ctx.mb, B)
        return None, None, None, None


class ConsumeStamp(torch.autograd.Function):
    """``(x, stamp) -> x`` (a copy); backward sends the clock at the end of the stage's backward
    as the stamp's gradient (the gradient message's send time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stamp: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.n = stamp.shape
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, torch.full(ctx.n, time.monotonic(), dtype=torch.float64)


# --------------------------------------------------------------------------- memory budgets


def saved_bytes(module: torch.nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor | None = None) -> int:
    """Bytes of the storages autograd saves for backward in ``module(*inputs)`` (each once,
    parameters excluded), and, with ``target`` (the last stage's), in the loss
    ``lm_loss(output, target)`` after it: what rrfp's ``ForwardSizer`` counts for one forward
    and the benchmarks' meter counts for it (:meth:`benchmarks.harness.ActivationMeter.metered`)."""
    from rrfp.runtime.engine.memory import SavedBytes

    counter = SavedBytes({p.untyped_storage().data_ptr() for p in module.parameters()})
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = module(*inputs)
        if target is not None:
            out = lm_loss(out, target)
    del out
    return counter.total


def schedule_budget(schedule: str, n_ranks: int, rank: int, sizes: Sequence[Sequence[int]]) -> int:
    """The most activation bytes ``schedule`` (``1f1b`` or ``gpipe``) holds on ``rank`` over
    steps whose microbatches hold ``sizes[step][mb]`` bytes on this rank."""
    from rrfp.scheduler.hints import resolve_hint
    from rrfp.scheduler.memory import order_peak_bytes
    from rrfp.scheduler.schedules import gpipe, one_f_one_b
    from rrfp.scheduler.tasks import Placement

    M = len(sizes[0])
    spec, _, _ = resolve_hint("strict-1f1b", Placement(n_ranks), M)
    order = (one_f_one_b if schedule == "1f1b" else gpipe)(spec)[rank]
    return max(order_peak_bytes(order, lambda s, m, st=st: st[m]) for st in sizes)


def virtual_stage_bytes(work: "TextWorkload", modules: Sequence[torch.nn.Module], stage_ids: Sequence[int],
                        example: tuple, target: torch.Tensor) -> list[int]:
    """Saved bytes of one microbatch on each of this rank's virtual stages (``modules`` at global
    ``stage_ids``): stage 0 on ``example`` (this rank's first-stage input), the others on a
    hidden state of the example's batch and length; the last stage with its loss on ``target``
    (the example's targets, ``[samples, length]``)."""
    out = []
    last = 2 * work.P - 1
    for m, s in zip(modules, stage_ids):
        if s == 0:
            x = example
        else:
            b, T = target.shape
            x = (torch.randn(b, T, work.gcfg.d_model, requires_grad=True),)
        out.append(saved_bytes(m, x, target if s == last else None))
    return out


# --------------------------------------------------------------------------- multimodal


def multimodal_samples(labels: Sequence[int], n: int, per_mb: int, seed: int):
    """``n`` digit samples: in every run of ``per_mb`` samples, the first holds 6 images and the
    others 0-6 (uniform), so each microbatch's decoder shapes are the same (module docstring)."""
    from rrfp.data.digits import DigitSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = MAX_IMAGES if i % per_mb == 0 else rng.randint(0, MAX_IMAGES)
        idx = tuple(rng.randrange(len(labels)) for _ in range(k))
        out.append(DigitSample(idx, b">" + " ".join(str(labels[j]) for j in idx).encode() + b"."))
    return out


def multimodal_tensors(samples, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole batch as fixed-shape tensors: ``images [B, 6, 8, 8]`` (zero-padded per sample),
    ``counts [B]``, ``tokens [B, 12]``, ``targets [B, 18]`` (as :func:`rrfp.data.digits.collate`
    lays out a microbatch with ``K = 6``)."""
    from rrfp.data.digits import collate

    mb = collate(samples, images)
    b = len(samples)
    padded = torch.zeros(b, MAX_IMAGES, *images.shape[1:])
    mask = torch.arange(MAX_IMAGES).unsqueeze(0) < mb.counts.unsqueeze(1)
    padded[mask] = mb.images
    return {"images": padded, "counts": mb.counts, "tokens": mb.tokens, "targets": mb.targets}


def pack_images(images: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor) -> tuple:
    """Padded per-sample images -> the packed ``[N, 8, 8]`` the multimodal stage 0 takes."""
    mask = torch.arange(images.shape[1]).unsqueeze(0) < counts.unsqueeze(1)
    return images[mask], counts, tokens


# --------------------------------------------------------------------------- workloads


class TextWorkload:
    """The GPT on byte text (every setting but ``multimodal4``)."""

    def __init__(self, cfg: dict, rank: int, P: int) -> None:
        self.cfg, self.rank, self.P = cfg, rank, P
        self.gcfg = GPTConfig(**cfg["model"], max_len=cfg["seq_len"])
        B, seed = cfg["batch_size"], cfg["seed"]
        samples = load_samples(cfg.get("data"), cfg["seq_len"], seed, limit=max(4 * B, cfg.get("sample_limit", 4000)))
        self.sampler = BatchSampler(samples, B, seed)
        self.pack = None

    def stage(self, n_stages: int, s: int):
        return build_stage(self.gcfg, n_stages, s, self.cfg["seed"])

    def reference(self):
        return GPT(self.gcfg, self.cfg["seed"])

    def ref_loss(self, model, batch: Batch) -> torch.Tensor:
        return lm_loss(model(batch.tokens), batch.targets)

    def batch(self, step_id: int, varlen: bool) -> Batch:
        return make_batch(self.sampler.batch(step_id), self.cfg["n_microbatches"], self.cfg["seq_len"], varlen)

    def stage_inputs(self, batch: Batch) -> list[tuple]:
        """This rank's stage inputs per microbatch (the shapes its activations follow)."""
        if self.rank == 0:
            return [tuple(x[:-1]) for x in batch.rrfp_mbs]
        return [(torch.randn(x[0].shape[0], x[0].shape[1], self.gcfg.d_model, requires_grad=True),) for x in batch.rrfp_mbs]


class MultimodalWorkload(TextWorkload):
    """The multimodal model on digit captions (``benchmarks/workloads.py``)."""

    def __init__(self, cfg: dict, rank: int, P: int) -> None:
        from rrfp.data.digits import load_digit_images
        from rrfp.model.multimodal import GPTConfig as _G, MultimodalConfig

        from .workloads import pack_images

        self.cfg, self.rank, self.P = cfg, rank, P
        m = cfg["model"]
        self.mcfg = MultimodalConfig(decoder=_G(n_layer=m["n_layer"], n_head=m["n_head"], d_model=m["d_model"], max_len=32),
                                     enc_width=m.get("enc_width", 32), enc_layers=m.get("enc_layers", 1))
        self.gcfg = self.mcfg.decoder
        self.images, self.labels = load_digit_images()
        self.pack = pack_images if rank == 0 else None

    def stage(self, n_stages: int, s: int):
        from rrfp.model.multimodal import build_multimodal_stage

        return build_multimodal_stage(self.mcfg, n_stages, s, self.cfg["seed"])

    def reference(self):
        return self.stage(1, 0)

    def ref_loss(self, model, batch: Batch) -> torch.Tensor:
        from .workloads import pack_images

        return lm_loss(model(*pack_images(*batch.torch_args[:3])), batch.targets)

    def batch(self, step_id: int, varlen: bool) -> Batch:
        from .workloads import multimodal_samples, multimodal_tensors

        cfg = self.cfg
        M, B = cfg["n_microbatches"], cfg["batch_size"]
        t = multimodal_tensors(multimodal_samples(self.labels, B, B // M, cfg["seed"] * 100003 + step_id), self.images)
        mbid = torch.repeat_interleave(torch.arange(M), torch.tensor(microbatch_sizes(B, M)))
        split = [torch.tensor_split(t[k], M) for k in ("images", "counts", "tokens")] + [torch.tensor_split(mbid, M)]
        # rrfp takes each microbatch's images packed (its inputs may have any shape); PyTorch
        # the padded batch, packed inside its stage 0 (the same indexing).
        mbs = [(*own_storage(pack_images(*x[:3])), x[3]) for x in zip(*split)]
        return Batch(t["tokens"], t["targets"], mbid, mbs, own_storage(torch.tensor_split(t["targets"], M)),
                     count_tokens(t["targets"]), [int(c.sum()) for c in split[1]],
                     (t["images"], t["counts"], t["tokens"], mbid))

    def stage_inputs(self, batch: Batch) -> list[tuple]:
        if self.rank == 0:
            return [tuple(x[:3]) for x in batch.rrfp_mbs]
        L = batch.targets.shape[1]  # samples: the counts' length (x[0] holds the packed images)
        return [(torch.randn(x[1].shape[0], L, self.gcfg.d_model, requires_grad=True),) for x in batch.rrfp_mbs]


AUTO_STEP_OFFSET = 500
"""Step ids ``1000 * phase + 500 + j`` are ``auto``'s measuring and trial steps (never a round's,
so ``auto`` never sees the draws of the rounds it is timed on)."""
AUTO_MAX_STEPS = 16
"""Most steps ``auto`` may take after a phase's memory round before it must have kept a hint
(it needs 10: one measuring step of a split candidate and 3 rounds of 3 trial steps)."""


def auto_step_ids(phase_index: int) -> list[int]:
    """The step ids of ``auto``'s steps in phase ``phase_index`` (:data:`AUTO_STEP_OFFSET`)."""
    return [1000 * phase_index + AUTO_STEP_OFFSET + j for j in range(AUTO_MAX_STEPS)]


def budgets_for(work: TextWorkload, base, cfg: dict) -> dict[str, dict[int, int]]:
    """Per schedule (``1f1b``, ``gpipe``) and step id (the rounds' and ``auto``'s,
    :func:`auto_step_ids`), the bytes that schedule holds on this rank for that step's
    microbatches."""
    from .workloads import saved_bytes, schedule_budget

    out: dict[str, dict[int, int]] = {"1f1b": {}, "gpipe": {}}
    memo: dict = {}
    P, rank = dist.get_world_size(), dist.get_rank()
    for pi, ph in enumerate(cfg["phases"]):
        for step_id in [*(1000 * pi + k for k in range(2 + ph["rounds"])), *auto_step_ids(pi)]:
            row = []
            batch = work.batch(step_id, ph["varlen"])
            for x, y in zip(work.stage_inputs(batch), batch.rrfp_targets):
                y = y if rank == P - 1 else None  # the last stage's forward includes its loss
                shapes = tuple(tuple(t.shape) for t in (*x, *([y] if y is not None else [])))
                if shapes not in memo:  # bytes follow shapes
                    memo[shapes] = saved_bytes(base, x, y)
                row.append(memo[shapes])
            for n in out:
                out[n][step_id] = schedule_budget(n, P, rank, [row])
    return out
