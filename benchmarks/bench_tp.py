"""Tensor parallelism: per-task cost of the two TP implementations, and the cost of TP agreement.

1. Per task: one GPT stage (``--model``, ``--layers`` blocks, a microbatch of ``--batch`` x
   ``--seq`` tokens) run forward (F) and backward (B) on 2 gloo processes at TP2, with
   ``rrfp.model.tp``'s hand-written column/row layers (``manual``) and with torch's
   ``parallelize_module`` + ``ColwiseParallel``/``RowwiseParallel`` (``dtensor``); TP1 (one
   process, the whole stage) as the reference. The two TP implementations alternate round by
   round so drift cancels; medians.
2. Agreement: PP2 x TP2 (4 processes, gloo exchange), ``--steps`` steps of the tiny GPT through
   ``Pipeline``: seconds spent in proposal exchanges per step against the step's wall time,
   and the exchanges and mismatches per step.

    python benchmarks/bench_tp.py [--rounds 30] [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage(args, tp_rank: int, tp: int, impl: str, group=None, mesh=None):
    from rrfp.model.gpt import GPT_PRESETS, build_stage
    from rrfp.model.tp import shard_gpt_stage

    cfg = dataclasses.replace(GPT_PRESETS[args.model], n_layer=3 * args.layers, max_len=args.seq)
    st = build_stage(cfg, 3, 1, 0)  # a middle stage: blocks only
    if tp > 1:
        shard_gpt_stage(st, tp_rank, tp, group, impl, mesh)
    return st, cfg


def _time_tasks(st, cfg, args) -> tuple[float, float]:
    x = torch.randn(args.batch, args.seq, cfg.d_model, generator=torch.Generator().manual_seed(0))
    fs, bs = [], []
    for _ in range(args.rounds):
        xi = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        y = st(xi)
        t1 = time.perf_counter()
        torch.autograd.backward(y, torch.ones_like(y))
        t2 = time.perf_counter()
        fs.append(t1 - t0)
        bs.append(t2 - t1)
    return statistics.median(fs[2:]), statistics.median(bs[2:])


def _task_worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    manual, _ = _stage(args, r, 2, "manual", mesh.get_group())
    dt, cfg = _stage(args, r, 2, "dtensor", mesh.get_group(), mesh)
    res = {"manual": [], "dtensor": []}
    for _ in range(3):  # alternate: drift cancels
        for name, st in (("manual", manual), ("dtensor", dt)):
            dist.barrier()
            res[name].append(_time_tasks(st, cfg, args))
    # One proposal exchange with both ranks ready (the protocol's own cost, without waiting
    # for a partner that is still computing): the gloo group of rrfp.parallel.exchange.
    from rrfp.parallel.exchange import GlooExchange

    ex = GlooExchange(dist.new_group([0, 1], backend="gloo"), 2)

    from rrfp.parallel.exchange import ControlExchange
    from rrfp.parallel.bootstrap import default_store
    from rrfp.runtime.doors.pipeline import new_event_loop
    from rrfp.transport.zmq import ZmqTransport

    async def both() -> tuple[float, float]:
        ctl = ControlExchange(ZmqTransport(r, 2, default_store(), "bench-tp-agree"), 2)
        await ctl.start()
        res = {}
        for _ in range(2):  # alternate: drift cancels
            for name, fn in (("gloo", ex), ("control", ctl)):
                times = []
                for i in range(100):
                    t0 = time.perf_counter()
                    await fn((0, 0, i))
                    times.append(time.perf_counter() - t0)
                res.setdefault(name, []).extend(times[10:])
        await ctl.aclose()
        return statistics.median(res["gloo"]), statistics.median(res["control"])

    dist.barrier()
    loop = new_event_loop()
    per_exchange, per_control = loop.run_until_complete(both())
    loop.close()
    ex.close()
    if r == 0:
        out = {k: {"F": statistics.median(v[i][0] for i in range(3)), "B": statistics.median(v[i][1] for i in range(3))}
               for k, v in res.items()}
        out["exchange_s"] = per_exchange
        out["control_s"] = per_control
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def _agree_worker(args) -> None:
    from rrfp.data.batches import make_microbatches
    from rrfp.data.text import load_samples
    from rrfp.model.gpt import GPT_PRESETS, build_stage, count_tokens, lm_loss
    from rrfp.model.tp import shard_gpt_stage
    from rrfp.parallel import ParallelLayout
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    torch.set_num_threads(1)
    layout = ParallelLayout.build(2, 1, 2)
    cfg = dataclasses.replace(GPT_PRESETS["tiny"], max_len=128)
    mod = shard_gpt_stage(build_stage(cfg, 2, layout.pp_rank, 0), layout.tp_rank, 2, layout.tp_group, "manual")
    pipe = Pipeline(PipelineStage(mod, layout.pp_rank, 2), 8, lm_loss, loss_weight_fn=count_tokens, layout=layout,
                    job="bench-tp")
    samples = load_samples(None, 128, 0, limit=32 * (args.steps + 1))
    ex = pipe.tp_agreement.exchange
    rows = []
    for k in range(args.steps):
        mbs = make_microbatches(samples[32 * k:32 * (k + 1)], 8)
        s0, r0 = ex.seconds, ex.rounds
        t0 = time.perf_counter()
        pipe.step(microbatches=[(m.tokens,) for m in mbs], targets=[m.targets for m in mbs])
        wall = time.perf_counter() - t0
        ag = pipe.tp_agreement.agreement
        rows.append({"wall": wall, "agree_s": ex.seconds - s0, "rounds": ex.rounds - r0,
                     "mismatches": ag.mismatches})
    pipe.close()
    with open(f"{args.out}.rank{layout.rank}", "w") as f:
        json.dump(rows[1:], f)  # the first step warms up


def _launch(mode: str, n: int, args, out: str) -> None:
    port = _free_port()
    procs = []
    for r in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", mode, "--out", out, "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
               "--layers", str(args.layers), "--model", args.model]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"bench_tp: a {mode} worker failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="F+B rounds per timing")
    ap.add_argument("--steps", type=int, default=12, help="training steps for the agreement cost")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "tasks":
        return _task_worker(args)
    if args.worker == "agree":
        return _agree_worker(args)
    torch.set_num_threads(1)
    st, cfg = _stage(args, 0, 1, "manual")
    f1, b1 = _time_tasks(st, cfg, args)
    with tempfile.TemporaryDirectory() as d:
        _launch("tasks", 2, args, f"{d}/tasks.json")
        with open(f"{d}/tasks.json") as f:
            tasks = json.load(f)
        _launch("agree", 4, args, f"{d}/agree.json")
        agree = []
        for r in range(4):
            with open(f"{d}/agree.json.rank{r}") as f:
                agree += json.load(f)
    print(f"### Tensor parallelism\n\nOne stage of `{args.model}` with {args.layers} blocks, a microbatch of "
          f"{args.batch} x {args.seq} tokens, median ms per task (`python benchmarks/bench_tp.py`):\n")
    print("| implementation | F ms | B ms | F+B vs manual |\n|---|---|---|---|")
    base = tasks["manual"]["F"] + tasks["manual"]["B"]
    print(f"| TP1 (whole stage, 1 process) | {f1 * 1e3:.2f} | {b1 * 1e3:.2f} | - |")
    for k in ("manual", "dtensor"):  # noqa: B007
        t = tasks[k]
        print(f"| TP2 {k} | {t['F'] * 1e3:.2f} | {t['B'] * 1e3:.2f} | {(t['F'] + t['B']) / base:.2f}x |")
    share = [r["agree_s"] / r["wall"] for r in agree]
    rounds = statistics.median(r["rounds"] for r in agree)
    step = statistics.median(r["wall"] for r in agree)
    print(f"\nTP agreement in training (control-plane exchange, the default; PP2 x TP2, tiny GPT, 8 microbatches of "
          f"4 x <=128 tokens, {len(agree) // 4} steps x 4 ranks): {rounds:.0f} exchanges and "
          f"{statistics.median(r['mismatches'] for r in agree):.0f} mismatches per step; wall time inside exchanges "
          f"{statistics.median(r['agree_s'] for r in agree) * 1e3:.1f} ms per step per rank = "
          f"{statistics.median(share) * 100:.1f}% of the median {step * 1e3:.0f} ms step (max {max(share) * 100:.1f}%), "
          f"waiting for the TP partner to finish its previous task included.")
    for name, key in (("control plane (ZeroMQ)", "control_s"), ("gloo all-gather", "exchange_s")):
        c = tasks[key]
        print(f"- one exchange over the {name}, both ranks ready (2 processes, 180 rounds alternating): "
              f"{c * 1e6:.0f} us; x {rounds:.0f} per step = {rounds * c * 1e3:.1f} ms = {rounds * c / step * 100:.1f}% "
              f"of the median step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp1": {"F": f1, "B": b1}, "tasks": tasks, "agree": agree}, f)


if __name__ == "__main__":
    main()
