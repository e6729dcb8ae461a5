"""What ``--deterministic`` costs: step time and extra gradient memory, against the default
accumulation, on the default GPT (tiny preset, 4 stages, 8 microbatches of 4 samples x 128
tokens) in one process over the fake transport with random message delays.

Alternates the two modes step by step so machine drift cancels out.

    python benchmarks/bench_deterministic.py [--steps 20] [--hint bf]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from rrfp.data.batches import make_microbatches
from rrfp.data.text import load_samples
from rrfp.model.gpt import GPT_PRESETS, GPT, count_tokens, lm_loss, split_gpt
from rrfp.runtime.doors.local import LocalPipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hint", default="bf")
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dataclasses.replace(GPT_PRESETS["tiny"], max_len=128)
    samples = load_samples(None, 128, 0, limit=args.steps * 32)
    pipes = {}
    for det in (False, True):
        stages = split_gpt(GPT(cfg, seed=0), 4)
        pipes[det] = (stages, LocalPipeline(stages, args.microbatches, lm_loss, hint=args.hint, loss_weight_fn=count_tokens,
                                            delay=(0.0, 0.002), seed=1, deterministic=det))
    times = {False: [], True: []}
    for k in range(args.steps):
        mbs = make_microbatches(samples[32 * k: 32 * (k + 1)], args.microbatches)
        for det in (False, True):
            stages, pipe = pipes[det]
            for st in stages:
                st.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            pipe.step(microbatches=[(m.tokens,) for m in mbs], targets=[m.targets for m in mbs])
            times[det].append(time.perf_counter() - t0)
    stages, pipe = pipes[True]
    print(f"hint {args.hint}, {args.microbatches} microbatches, {args.steps} alternating steps (first dropped)")
    print(f"{'mode':<14} {'median step ms':>15}")
    for det in (False, True):
        print(f"{'deterministic' if det else 'default':<14} {statistics.median(times[det][1:]) * 1e3:15.1f}")
    ratio = statistics.median([b / a for a, b in zip(times[False][1:], times[True][1:])])
    print(f"time ratio deterministic/default (median of paired steps): {ratio:.3f}")
    print(f"{'stage':>5} {'param MiB':>10} {'peak extra grad MiB':>20} {'ratio':>6}")
    for rt in pipe.runtimes:
        for s, acc in rt._ordered.items():
            pbytes = sum(p.numel() * p.element_size() for p in acc.params)
            print(f"{s:>5} {pbytes / 2**20:10.3f} {acc.peak_held_bytes / 2**20:20.3f} {acc.peak_held_bytes / pbytes:6.2f}")
    for _, p in pipes.values():
        p.close()


if __name__ == "__main__":
    main()
