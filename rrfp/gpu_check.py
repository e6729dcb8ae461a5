"""``python -m rrfp.gpu_check``: what one machine with one NVIDIA GPU can check, in minutes.

1. the CUDA tests (``tests/test_executors.py -k cuda``, from a source checkout);
2. a 4-stage :class:`~rrfp.runtime.doors.local.LocalPipeline` on the GPU, one compute stream per
   rank, launch-ahead windows 1 and 2: loss and every gradient against the single-process model
   on the same GPU, and the time per step;
3. ``rrfp train --device cuda --steps 5`` as 4 processes sharing the GPU over the ``zmq`` data
   plane, with ``--trace`` (its timeline PNG);
4. each executor's overhead per task (``benchmarks/bench_executor.py``, from a source checkout).

It prints one line per check with its figures, then PASS or FAIL. Exit status: 0 when every
check passed, 1 when one failed, and 77 (the "skipped" status of automake and meson test
harnesses) when there is no CUDA device: one line says so and nothing runs.

What it cannot cover: NCCL refuses two ranks on one GPU, so the ``torch`` data plane over NCCL
(and anything multi-GPU) needs a machine with one GPU per rank.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

EXIT_NO_CUDA = 77
REPO = Path(__file__).resolve().parent.parent


def _line(name: str, ok: bool, detail: str) -> bool:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def check_tests(timeout: float) -> bool:
    tests = REPO / "tests" / "test_executors.py"
    if not tests.exists():
        return _line("CUDA tests", True, "skipped: no tests/ folder (installed package, not a source checkout)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-k", "cuda"],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    if r.returncode != 0:
        print(r.stdout[-4000:], r.stderr[-2000:], sep="\n")
    return _line("CUDA tests", r.returncode == 0, f"{last} ({time.perf_counter() - t0:.0f} s)")


def check_local_pipeline(steps: int = 5, device: str = "cuda") -> bool:
    """4 ranks on the GPU, one stream each, against the single-process model on the GPU
    (``device="cpu"`` runs the same comparison with the inline executor, to try the check)."""
    from .data.batches import pad_batch
    from .model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
    from .runtime.local import LocalPipeline

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = GPTConfig(n_layer=8, n_head=4, d_model=128, max_len=256)
    text = (Path(__file__).read_bytes() * 2)[:4096]
    M = 8
    samples = [text[97 * m: 97 * m + 40 + 13 * m] for m in range(M)]  # a length per microbatch
    mbs = [pad_batch([s]) for s in samples]
    model = GPT(cfg, seed=0)
    ref = copy.deepcopy(model).to(dev)
    tokens, targets = pad_batch(samples)
    ref_loss = lm_loss(ref(tokens.to(dev)), targets.to(dev))
    ref_loss.backward()
    ref_value = float(ref_loss.detach())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    all_ok = True
    for window in (1, 2):
        ok = True
        stages = split_gpt(copy.deepcopy(model), 4)
        # A named hint: under the default ``auto`` the timed steps would run several candidates.
        with LocalPipeline(stages, M, lm_loss, loss_weight_fn=count_tokens, device=dev, launch_ahead=window,
                           watchdog=120, hint="bf") as pipe:
            n_streams = len({id(rt.executor.stream) for rt in pipe.runtimes}) if cuda else 0
            times = []
            for k in range(steps):
                for st in stages:
                    st.zero_grad(set_to_none=True)
                sync()
                t0 = time.perf_counter()
                loss = pipe.step(microbatches=[(t,) for t, _ in mbs], targets=[y for _, y in mbs])
                sync()
                times.append(time.perf_counter() - t0)
        worst = 0.0
        for st in stages:
            for name, p in st.named_parameters():
                g, r = p.grad, ref_grads[st.stage_param_names[name]]
                worst = max(worst, float((g - r).abs().max()))
                ok &= bool(torch.allclose(g, r, rtol=1e-4, atol=1e-5))
        dl = abs(float(loss) - ref_value)
        ok &= dl <= 1e-4 * abs(ref_value) + 1e-5 and n_streams == (4 if cuda else 0)
        all_ok &= _line(f"LocalPipeline, 4 ranks on 1 {'GPU' if cuda else 'CPU'}, window {window}", ok,
              f"{n_streams} streams; |loss - reference| {dl:.2e}, max |grad - reference| {worst:.2e}; "
              f"step {statistics.median(times[1:]) * 1e3:.1f} ms (median of {steps - 1} after the first)")
    return all_ok


def check_train(out: Path, timeout: float) -> bool:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rrfp", "train", "--device", "cuda", "--steps", "5", "--trace", str(out), "--quiet"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    png = out / "timeline.png"
    ok = r.returncode == 0 and png.exists()
    summary = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
    return _line("rrfp train --device cuda --steps 5 (4 processes, zmq data plane)", ok,
                 f"exit {r.returncode} in {time.perf_counter() - t0:.0f} s; {summary}; timeline {png}")


def check_overhead(timeout: float) -> bool:
    import os

    from .resources import bench_root

    root = bench_root()
    if root is None:
        return _line("executor overhead", True, "skipped: no benchmarks/ folder (not a source checkout)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    # The benchmark program prints its table; it measures the GPU rows whenever CUDA is there.
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_executor", "--microbatches", "32", "--steps", "5"],
                       env=env, timeout=timeout)
    return _line("executor overhead per task", r.returncode == 0,
                 f"table above (wall time; see BENCHMARKS.md for how to read it); exit {r.returncode}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rrfp.gpu_check", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/gpu-check", help="folder for the training run's trace and timeline")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rrfp gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing checked (exit 77)")
        return EXIT_NO_CUDA
    t0 = time.perf_counter()
    print(f"rrfp gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})",
          flush=True)
    results = [check_tests(timeout=150), check_local_pipeline(), check_train(Path(args.out), timeout=180),
               check_overhead(timeout=300)]
    ok = all(results)
    print(f"rrfp gpu-check: {sum(results)}/{len(results)} checks passed in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
