"""Split backward cost, per stage: the routed forward F (every affine layer through the split's
deferring function) against the layers' own forward, and I (input gradients) + W (weight
gradients) against one full backward B.

Each stage is built twice from one seed: one with its own layers (F, then B), one routed
(:func:`~rrfp.runtime.engine.split.enable_split_backward`: F, then I and W as the runtime runs
them). The two run alternately on the same microbatch so machine drift cancels out, and the
medians of the per-repeat ratios are printed:

- ``F ratio``: routed F / own F (goal: at most 1.05, the layers' own speed; every split hint
  pays it on every forward);
- ``(I+W)/B``: the goal "W must not redo the whole backward" is at most 1.15;
- ``step``: (routed F + I + W) / (own F + B), what a stage's compute costs per microbatch.

    python benchmarks/bench_split_backward.py [--setting jitter4] [--repeats 30]
    python benchmarks/bench_split_backward.py --model tiny --stages 4 --batch 4 --seq 128

``--setting`` takes a comparison setting's model, ranks (one stage each), samples per
microbatch and threads (``benchmarks/settings.py``); without it the default GPT of
``rrfp train`` (tiny preset, max-len 128).

Figures (issue 33, 2026-12-05, 2-core shared machine, ``--setting jitter4 --repeats 40``, two
runs per version alternated, load 3.7-3.9): F ratio per stage 1.045-1.083 with the routed
forward as F.linear through Function's C apply, against 1.106-1.191 with main's matmul then
bias add through ``Function.apply``; (I+W)/B 1.14-1.20 both. Load-independent: jitter4's
stage 1 forward costs 2.700 M instructions with its own layers, 2.778 M routed (1.029x),
3.065 M routed as on main (1.135x) (callgrind, 200 forwards less 10, difference of two runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from rrfp.model.gpt import GPT_PRESETS, GPTConfig, build_stage
from rrfp.runtime.engine.split import WeightGradStore, deferring, enable_split_backward

if __package__ in (None, ""):  # run as a script: the repository root on the path (--setting)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _stage_io(stage, cfg, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if stage.is_first:
        return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),)
    return (torch.randn(batch, seq, cfg.d_model, generator=g).requires_grad_(True),)


def _forward(stage, inputs):
    """F as the runtime runs it: fresh leaves (a received activation needs its gradient)."""
    x = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    t0 = time.perf_counter()
    out = stage(*x)
    return time.perf_counter() - t0, x, out


def _time_full(stage, inputs, grad_out) -> tuple[float, float]:
    f, _, out = _forward(stage, inputs)
    t0 = time.perf_counter()
    torch.autograd.backward([out], [grad_out])
    return f, time.perf_counter() - t0


def _time_split(stage, inputs, grad_out) -> tuple[float, float, float]:
    """The runtime's F, I and W (rrfp.runtime.engine.compute: _backward(split=True), _weight)."""
    f, x, out = _forward(stage, inputs)
    need = [t for t in x if t.requires_grad]
    store = WeightGradStore()
    t0 = time.perf_counter()
    if need:
        with deferring(store, stage):
            torch.autograd.backward([out], [grad_out])
        t1 = time.perf_counter()
        store.flush()
    else:  # stage 0: the runtime runs the whole backward as W
        t1 = time.perf_counter()
        torch.autograd.backward([out], [grad_out])
    t2 = time.perf_counter()
    return f, t1 - t0, t2 - t1


def measure_stage(cfg: GPTConfig, n_stages: int, s: int, batch: int, seq: int, repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` alternating runs of stage ``s``: seconds of ``F_own``, ``B``,
    ``F_routed``, ``I``, ``W``, and the medians of the per-repeat ratios ``F_ratio``,
    ``IW_B`` and ``step`` (the module docstring says which)."""
    own = build_stage(cfg, n_stages, s, seed=0)
    routed = build_stage(cfg, n_stages, s, seed=0)
    enable_split_backward(routed)
    inputs = _stage_io(routed, cfg, batch, seq, seed=s)
    with torch.no_grad():
        out = routed(*inputs)
    grad_out = torch.randn_like(out) if not routed.is_last else torch.randn_like(out) / out.numel()
    for _ in range(5):  # warm-up
        _time_full(own, inputs, grad_out), _time_split(routed, inputs, grad_out)
    rows = []
    for _ in range(repeats):
        rows.append((*_time_full(own, inputs, grad_out), *_time_split(routed, inputs, grad_out)))
    med = {k: statistics.median(r[i] for r in rows) for i, k in enumerate(("F_own", "B", "F_routed", "I", "W"))}
    med["F_ratio"] = statistics.median(fr / fo for fo, _, fr, _, _ in rows)
    med["IW_B"] = statistics.median((i + w) / b for _, b, _, i, w in rows)
    med["step"] = statistics.median((fr + i + w) / (fo + b) for fo, b, fr, i, w in rows)
    return med


def _shape(args) -> tuple[GPTConfig, int, int, int, int, str]:
    """(model config, stages, samples per microbatch, sequence length, threads, description)."""
    if args.setting is None:
        cfg = dataclasses.replace(GPT_PRESETS[args.model], max_len=args.seq)
        return cfg, args.stages, args.batch, args.seq, args.threads, f"model {args.model}"
    from benchmarks.settings import SETTINGS

    if args.setting not in SETTINGS:
        raise SystemExit(f"--setting {args.setting!r}: expected one of {', '.join(SETTINGS)}")
    st = SETTINGS[args.setting]
    if "model" not in st or st.get("workload", "text") != "text":
        raise SystemExit(f"--setting {args.setting!r}: expected a setting of the text GPT")
    seq = st["seq_len"]
    cfg = GPTConfig(**st["model"], max_len=seq)
    return cfg, st["n_ranks"], st["batch_size"] // st["n_microbatches"], seq, st.get("threads", 1), \
        f"setting {args.setting} ({st['model']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default=None, help="a text setting of benchmarks/settings.py (jitter4...)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--model", default="tiny", choices=list(GPT_PRESETS))
    ap.add_argument("--batch", type=int, default=4, help="samples per microbatch (rrfp train: 32 / 8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: expected an integer >= 1")
    cfg, n_stages, batch, seq, threads, what = _shape(args)
    torch.set_num_threads(threads)
    print(f"{what}, {n_stages} stages, microbatch {batch}x{seq}, {threads} thread(s), "
          f"torch {torch.__version__}, median of {args.repeats} alternating runs")
    print(f"{'stage':>5} {'F own':>8} {'F rout':>8} {'F ratio':>8} {'B ms':>8} {'I ms':>8} {'W ms':>8} "
          f"{'(I+W)/B':>8} {'step':>6}")
    worst_f = worst_b = 0.0
    for s in range(n_stages):
        m = measure_stage(cfg, n_stages, s, batch, seq, args.repeats)
        worst_f, worst_b = max(worst_f, m["F_ratio"]), max(worst_b, m["IW_B"])
        print(f"{s:>5} {m['F_own'] * 1e3:8.3f} {m['F_routed'] * 1e3:8.3f} {m['F_ratio']:8.3f} {m['B'] * 1e3:8.3f} "
              f"{m['I'] * 1e3:8.3f} {m['W'] * 1e3:8.3f} {m['IW_B']:8.3f} {m['step']:6.3f}")
    print(f"worst stage F ratio = {worst_f:.3f} (goal <= 1.05: {'met' if worst_f <= 1.05 else 'MISSED'})")
    print(f"worst stage (I+W)/B = {worst_b:.3f} (goal <= 1.15: {'met' if worst_b <= 1.15 else 'MISSED'})")


if __name__ == "__main__":
    main()
