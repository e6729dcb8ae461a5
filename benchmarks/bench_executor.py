"""Runtime overhead per task for each executor (inline, thread, and cuda where available).

Measured exactly as ``benchmarks/micro.py`` measures the runtime's overhead (its
:func:`~benchmarks.micro.local_overhead`: a 4-rank ``LocalPipeline`` of do-nothing stages in one
process, the same tasks run by hand after every step as the reference), once per executor.
Wall time is the figure to compare: the thread executor computes on its worker thread, which
the loop thread's CPU time does not count. On CUDA the stages and the reference run on the GPU
(kernel launches on one-element tensors: the executor's per-task cost, not the GPU's speed), for
launch-ahead windows 1 and 2.

    python benchmarks/bench_executor.py [--microbatches 64] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.micro import local_overhead  # noqa: E402


def measure(n_microbatches: int = 64, steps: int = 20, hints=("bf",), cuda: bool | None = None) -> dict:
    """``{row name: local_overhead's figures}`` for inline and thread on the CPU, and the cuda
    executor (windows 1 and 2) plus inline on the GPU when ``cuda`` (default: if available)."""
    rows = local_overhead(n_microbatches=n_microbatches, steps=steps, hints=hints, executors=("inline", "thread"),
                          encodes=(False,))
    # local_overhead names the inline rows as micro.py always has ("bf, no codec"): say it here
    out = {(k if k.count(",") >= 2 else f"{k}, inline"): v for k, v in rows.items()}
    if cuda if cuda is not None else torch.cuda.is_available():
        for window in (1, 2):
            rows = local_overhead(n_microbatches=n_microbatches, steps=steps, hints=hints, executors=("cuda",),
                                  device="cuda", encodes=(False,), launch_ahead=window)
            out.update({f"{k} (GPU)": v for k, v in rows.items()})
        rows = local_overhead(n_microbatches=n_microbatches, steps=steps, hints=hints, executors=("inline",),
                              device="cuda", encodes=(False,))
        out.update({f"{k}, inline (GPU)": v for k, v in rows.items()})
    return out


def table(rows: dict) -> str:
    lines = ["| pipeline (4 ranks, 1 process, no codec) | wall us/task (fastest step) | reference us/task (wall) | "
             "overhead us/task (wall) | loop-thread CPU us/task | process CPU us/task (all threads) |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ref = r["min_per_task_us"] - r["overhead_wall_us"]
        lines.append(f"| {name} | {r['min_per_task_us']:.1f} | {ref:.1f} | {r['overhead_wall_us']:.1f} | {r['cpu_per_task_us']:.1f} | "
                     f"{r['process_cpu_per_task_us']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=64, help="microbatches per step")
    ap.add_argument("--steps", type=int, default=20, help="steps per executor; the fastest counts")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the raw figures here")
    args = ap.parse_args(argv)
    if args.microbatches < 1 or args.steps < 1:
        ap.error(f"--microbatches={args.microbatches} --steps={args.steps}: expected positive integers")
    rows = measure(args.microbatches, args.steps)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
