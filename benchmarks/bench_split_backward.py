"""Split backward cost: time of I (input gradients) + W (weight gradients) against one full
backward B, per stage of the default GPT (``rrfp train``'s: tiny preset, 4 stages, max-len 128).

Runs each variant alternately on the same microbatch so machine drift cancels out, and prints
the median ratio (I + W) / B per stage. The goal ("W must not redo the whole backward")
is a ratio of at most 1.15.

    python benchmarks/bench_split_backward.py [--stages 4] [--model tiny] [--repeats 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from rrfp.model.gpt import GPT_PRESETS, build_stage
from rrfp.runtime.engine.split import WeightGradStore, deferring, enable_split_backward


def _stage_io(stage, cfg, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if stage.is_first:
        return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),)
    return (torch.randn(batch, seq, cfg.d_model, generator=g).requires_grad_(True),)


def _time_full(stage, inputs, grad_out) -> float:
    x = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
    out = stage(*x)
    t0 = time.perf_counter()
    torch.autograd.backward([out], [grad_out])
    return time.perf_counter() - t0


def _time_split(stage, inputs, grad_out) -> tuple[float, float]:
    """The runtime's I and W (rrfp.runtime.engine.rank: _backward(split=True), _weight)."""
    x = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    out = stage(*x)
    need = [t for t in x if t.requires_grad]
    store = WeightGradStore()
    t0 = time.perf_counter()
    if need:
        with deferring(store):
            torch.autograd.backward([out], [grad_out])
        t1 = time.perf_counter()
        store.flush()
    else:  # stage 0: the runtime runs the whole backward as W
        t1 = time.perf_counter()
        torch.autograd.backward([out], [grad_out])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--model", default="tiny", choices=list(GPT_PRESETS))
    ap.add_argument("--batch", type=int, default=4, help="samples per microbatch (rrfp train: 32 / 8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(GPT_PRESETS[args.model], max_len=args.seq)
    print(f"model {args.model}, {args.stages} stages, microbatch {args.batch}x{args.seq}, {args.threads} thread(s), "
          f"torch {torch.__version__}, median of {args.repeats} alternating runs")
    print(f"{'stage':>5} {'B ms':>8} {'I ms':>8} {'W ms':>8} {'(I+W)/B':>8}")
    worst = 0.0
    for s in range(args.stages):
        stage = build_stage(cfg, args.stages, s, seed=0)
        full_stage = build_stage(cfg, args.stages, s, seed=0)
        enable_split_backward(stage)
        inputs = _stage_io(stage, cfg, args.batch, args.seq, seed=s)
        with torch.no_grad():
            out = stage(*inputs)
        grad_out = torch.randn_like(out) if not stage.is_last else torch.randn_like(out) / out.numel()
        full, i_t, w_t = [], [], []
        for _ in range(3):  # warm-up
            _time_full(full_stage, inputs, grad_out), _time_split(stage, inputs, grad_out)
        for _ in range(args.repeats):
            full.append(_time_full(full_stage, inputs, grad_out))
            a, b = _time_split(stage, inputs, grad_out)
            i_t.append(a), w_t.append(b)
        ratios = [(a + b) / f for a, b, f in zip(i_t, w_t, full)]
        r = statistics.median(ratios)
        worst = max(worst, r)
        print(f"{s:>5} {statistics.median(full) * 1e3:8.2f} {statistics.median(i_t) * 1e3:8.2f} "
              f"{statistics.median(w_t) * 1e3:8.2f} {r:8.3f}")
    print(f"worst stage (I+W)/B = {worst:.3f} (goal <= 1.15: {'met' if worst <= 1.15 else 'MISSED'})")


if __name__ == "__main__":
    main()
