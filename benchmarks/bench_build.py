"""Build memory: a rank's peak RSS while it builds its stage of ``--model hf:FOLDER``.

A GPT-2 folder of gpt2-medium's shape (``n_layer`` 24, ``n_embd`` 1024, ``n_head`` 16, vocabulary
50257: 355M parameters) is made here with ``transformers`` (random weights, ``save_pretrained``
with ``--shard-size``, so the checkpoint is sharded as downloaded ones are); nothing is
downloaded. Each stage of ``--stages`` is then built in a fresh process, as a rank builds it
(``rrfp.model.hf.build_hf_stages``: meta model, the stage's tensors read from the safetensors
files), and the process's peak RSS (``VmHWM`` in ``/proc/self/status``) is compared with the
stage's parameter bytes, above two baselines measured in the same process before the build:
torch imported, and torch + transformers + the GPT-2 modelling code imported.

Target (issue 31): peak RSS above the baseline at most the stage's parameter bytes plus 25%.
``--whole`` adds, for contrast, one process that builds a stage the way rrfp did before
(``from_pretrained`` of the whole model, then the stage split off it).

    python benchmarks/bench_build.py [--stages 8] [--shard-size 200MB] [--folder DIR] [--whole] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT2_MEDIUM = dict(n_layer=24, n_embd=1024, n_head=16)
"""gpt2-medium's shape (355M parameters with GPT-2's vocabulary of 50257)."""

TARGET = 1.25


def make_folder(folder: str | Path, shard_size: str, **shape) -> Path:
    """A GPT-2 model of ``shape`` (``GPT2_MEDIUM`` by default) with random weights, saved to
    ``folder`` in safetensors shards of at most ``shard_size``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(**(shape or GPT2_MEDIUM)))
    model.save_pretrained(folder, max_shard_size=shard_size)
    return Path(folder)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(folder: str, n_stages: int, stage: int, whole: bool) -> dict:
    """Run in a fresh process: baselines, the build, its peak (KiB) and the stage's bytes."""
    import torch

    base_torch = _status_kib("VmRSS")
    import transformers  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  the modelling code, as from_config imports it

    from rrfp.model.hf import HFStage, build_hf_stages, hf_model
    from rrfp.model.gpt import stage_layer_ranges

    torch.set_num_threads(1)
    base_libs = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if whole:
        model = hf_model(folder)
        ranges = stage_layer_ranges(model.config.n_layer, n_stages)
        mod = HFStage(model, stage, n_stages, ranges[stage])
        del model
    else:
        (mod,), _ = build_hf_stages(folder, n_stages, [stage])
    seconds = time.perf_counter() - t0
    built_kib = _status_kib("VmHWM")
    tensors = {id(t): t for t in (*mod.parameters(), *mod.buffers())}.values()
    # safetensors' tensors may be paged in lazily (memory-mapped): read every byte once, as the
    # first step would, so that the peak counts all of the stage's tensors.
    with torch.no_grad():
        touched = sum(float(t.sum()) for t in tensors)  # no temporary the size of a tensor
    return dict(stage=stage, whole=whole, seconds=seconds, base_torch_kib=base_torch, base_libs_kib=base_libs,
                built_kib=built_kib, hwm_kib=_status_kib("VmHWM"), rss_kib=_status_kib("VmRSS"), finite=touched < float("inf"),
                param_bytes=sum(t.numel() * t.element_size() for t in tensors))


def _run_child(folder: Path, n_stages: int, stage: int, whole: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(folder), str(n_stages), str(stage)] + (["--whole"] if whole else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratios(row: dict) -> tuple[float, float]:
    """(peak above the torch baseline, peak above the libraries' baseline) / parameter bytes."""
    b = row["param_bytes"]
    return ((row["hwm_kib"] - row["base_torch_kib"]) * 1024 / b, (row["hwm_kib"] - row["base_libs_kib"]) * 1024 / b)


def table(rows: list[dict]) -> str:
    """The measurement as a Markdown table (MiB)."""
    mib = 1024 * 1024
    lines = ["| stage | params MiB | torch base MiB | +transformers MiB | peak MiB | peak - torch base | ratio | "
             "peak - libs base | ratio | build s |", "|" + "---|" * 10]
    for r in rows:
        above_torch, above_libs = ratios(r)
        lines.append(
            f"| {r['stage']}{' (whole model, before)' if r['whole'] else ''} | {r['param_bytes'] / mib:.0f} | "
            f"{r['base_torch_kib'] / 1024:.0f} | {r['base_libs_kib'] / 1024:.0f} | {r['hwm_kib'] / 1024:.0f} | "
            f"{(r['hwm_kib'] - r['base_torch_kib']) / 1024:.0f} | {above_torch:.2f} | "
            f"{(r['hwm_kib'] - r['base_libs_kib']) / 1024:.0f} | {above_libs:.2f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--shard-size", default="200MB", help="save_pretrained's max_shard_size for the folder made here")
    p.add_argument("--folder", help="an existing GPT-2 folder to build from (default: make one in a temporary folder)")
    p.add_argument("--whole", action="store_true", help="also build stage 1 the old way (the whole model), for contrast")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", nargs=3, metavar=("FOLDER", "STAGES", "STAGE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        folder, n, s = args.child
        print(json.dumps(_child(folder, int(n), int(s), args.whole)))
        return 0
    with tempfile.TemporaryDirectory(prefix="rrfp-bench-build-") as tmp:
        folder = Path(args.folder) if args.folder else make_folder(Path(tmp) / "gpt2-medium", args.shard_size)
        files = sorted(f.name for f in folder.glob("*.safetensors"))
        print(f"folder {folder}: {len(files)} safetensors file(s); {args.stages} stages, one fresh process each")
        rows = [_run_child(folder, args.stages, s, False) for s in range(args.stages)]
        if args.whole:
            rows.append(_run_child(folder, args.stages, min(1, args.stages - 1), True))
    print(table(rows))
    worst = max(ratios(r)[0] for r in rows if not r["whole"])
    worst_libs = max(ratios(r)[1] for r in rows if not r["whole"])
    print(f"worst stage: peak above the torch baseline {worst:.2f}x its parameter bytes, above torch + transformers "
          f"{worst_libs:.2f}x (target <= {TARGET})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
