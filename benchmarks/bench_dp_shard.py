"""Sharded against replicated data parallelism beside the pipeline: PP2 x DP2 on 4 gloo
processes, the same GPT stage replicated (``--dp-shard none``: rrfp's all-reduce) and sharded
(``--dp-shard full``: FSDP2 ``fully_shard`` of each block and the stage,
:mod:`rrfp.parallel.sharded`), side by side in one launch.

Per rank and layout: the bytes of parameters, gradients and AdamW states
(:func:`rrfp.parallel.footprint.footprint`, the one source of these figures) and the step's
gathered transient; the step time (pipeline step + optimizer step, the slowest rank's),
the two layouts alternating step by step so that drift and load cancel; the gradients of the
first step against each other (fp32) and the loss curves.

    python benchmarks/bench_dp_shard.py [--model medium] [--steps 8] [--json out.json]

:func:`alternate` is the harness other benchmarks of layouts (``bench_memory.py``) reuse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = ("replicated", "sharded")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def rank_main(cfg: dict) -> dict | None:
    """One rank of PP2 x DP2: both layouts' pipelines, stepped alternately."""
    import torch
    import torch.distributed as dist

    from rrfp.data.batches import make_microbatches
    from rrfp.data.text import load_samples
    from rrfp.model.gpt import GPT_PRESETS, build_stage, count_tokens, lm_loss
    from rrfp.parallel import ParallelLayout
    from rrfp.parallel.footprint import footprint
    from rrfp.parallel.train import replica_samples, shard_stage
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    layout = ParallelLayout.build(2, 2, 1)
    p = layout.pp_rank
    model_cfg = dataclasses.replace(GPT_PRESETS[cfg["model"]], max_len=cfg["seq"])
    mods = {k: build_stage(model_cfg, 2, p, 0) for k in LAYOUTS}
    if cfg["wrap"] == "blocks":
        shard_stage(mods["sharded"], layout)  # rrfp train --dp-shard full: each block, then the stage
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(mods["sharded"], mesh=layout.mesh["dp"], reshard_after_forward=False)  # one group per stage
    pipes, opts = {}, {}
    for k in LAYOUTS:
        pipes[k] = Pipeline(PipelineStage(mods[k], p, 2), cfg["microbatches"], lm_loss, loss_weight_fn=count_tokens,
                            layout=layout, job=f"bench-dp-{k}", hint=cfg["hint"], watchdog=600, record=True)
        opts[k] = torch.optim.AdamW(list(mods[k].parameters()), lr=1e-3)
    samples = load_samples(None, cfg["seq"], 0, limit=cfg["batch"] * (cfg["steps"] + 1))
    parts = {k: [] for k in LAYOUTS}  # per step: (first F s, mean other F s, mean B s, tail after the last task s)
    losses = {k: [] for k in LAYOUTS}
    first_grads = {}
    batches = [make_microbatches(replica_samples(samples[cfg["batch"] * step:cfg["batch"] * (step + 1)], layout),
                                 cfg["microbatches"]) for step in range(cfg["steps"])]  # before the timed steps

    def pipeline_step(k: str, step: int) -> None:
        mbs = batches[step]
        opts[k].zero_grad(set_to_none=True)
        pipes[k].step(microbatches=[(m.tokens,) for m in mbs] if p == 0 else None,
                      targets=[m.targets for m in mbs] if p == 1 else None)

    def between(k: str, step: int, t_end: float) -> None:
        recs = pipes[k].last_stats.records
        fs = [r.end - r.start for r in sorted((r for r in recs if r.task.kind == "F"), key=lambda r: r.start)]
        bs = [r.end - r.start for r in recs if r.task.kind != "F"]
        parts[k].append((fs[0], statistics.mean(fs[1:] or fs), statistics.mean(bs), t_end - max(r.end for r in recs)))
        if step == 0:  # the comparison's own gather is not part of the step
            first_grads[k] = {n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).clone()
                              for n, q in mods[k].named_parameters()}
        losses[k].append(pipes[k].last_loss)

    times, opt_times = alternate(LAYOUTS, cfg["steps"], pipeline_step, lambda k, step: opts[k].step(), between)
    diff = max(float((first_grads["sharded"][n] - g).abs().max()) for n, g in first_grads["replicated"].items())
    scale = max(float(g.abs().max()) for g in first_grads["replicated"].values())
    fps = {k: dataclasses.asdict(footprint([mods[k]], opts[k], pipes[k].sharded)) for k in LAYOUTS}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": layout.rank, "pp": p, "dp": layout.dp_rank, "footprint": fps, "parts": parts,
                                      "grad_diff": diff, "grad_scale": scale, "losses": losses})
    for k in LAYOUTS:
        pipes[k].close()
    if layout.rank != 0:
        return None
    return {"times": times, "opt_times": opt_times, "ranks": everyone}


def alternate(names, steps: int, pipeline_step, optimizer_step, between=None) -> tuple[dict, dict]:
    """The harness both benchmarks of layouts share: every step, each of ``names`` runs once, in
    an order rotated by one each step (each goes first as often; two alternate), after a
    barrier of every rank; its time is the slowest rank's (the step ends when its last rank
    does).

    Args:
        names: the layouts (or runtimes) compared, built in every rank process.
        steps: rounds.
        pipeline_step: ``pipeline_step(name, step)``, timed: zero the gradients, run the step.
        optimizer_step: ``optimizer_step(name, step)``, timed apart too.
        between: ``between(name, step, t_end)``, untimed, after the pipeline step
            (``t_end``: its ``perf_counter``): records, a comparison's gathers.

    Returns:
        ``(times, opt_times)``: per name, seconds per step (pipeline + optimizer) and of the
        optimizer step alone, both the slowest rank's.
    """
    import torch
    import torch.distributed as dist

    names = list(names)
    times = {k: [] for k in names}
    opt_times = {k: [] for k in names}
    for step in range(steps):
        r = step % len(names)
        for k in names[r:] + names[:r]:
            dist.barrier()
            t0 = time.perf_counter()
            pipeline_step(k, step)
            t1 = time.perf_counter()
            if between is not None:
                between(k, step, t1)
            t2 = time.perf_counter()
            optimizer_step(k, step)
            t3 = time.perf_counter()
            dt = torch.tensor([t1 - t0 + t3 - t2, t3 - t2])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            times[k].append(float(dt[0]))
            opt_times[k].append(float(dt[1]))
    return times, opt_times


def measure_layouts(model: str = "medium", steps: int = 8, batch: int = 16, microbatches: int = 4, seq: int = 128,
                    hint: str = "1f1b", wrap: str = "blocks", timeout: float = 1800) -> dict:
    """Launch PP2 x DP2 (4 processes) once and measure both layouts (see the module doc).

    Returns:
        ``{"times": {layout: [s per step]}, "ranks": [per rank: footprint by layout, first-step
        gradient difference and scale, loss curves]}``, plus ``"load"``: ``/proc/loadavg``
        before and after.
    """
    from benchmarks.launcher import launch

    before = _loadavg()
    cfg = {"model": model, "steps": steps, "batch": batch, "microbatches": microbatches, "seq": seq, "hint": hint, "wrap": wrap}
    res = launch("benchmarks.bench_dp_shard:rank_main", 4, cfg, timeout=timeout).result
    res["load"] = [before, _loadavg()]
    res["config"] = cfg
    return res


def report(res: dict) -> str:
    """The measured figures as markdown (tables, ratios, the load)."""
    cfg, times, ranks = res["config"], res["times"], res["ranks"]
    warm = {k: v[1:] for k, v in times.items()}  # the first step gathers lazily and warms up
    lines = [f"### Sharded DP beside the pipeline (PP2 x DP2, `{cfg['model']}`, batch {cfg['batch']} x {cfg['seq']} tokens, "
             f"{cfg['microbatches']} microbatches, hint {cfg['hint']}, fully_shard of {cfg['wrap']}; load before/after {res['load'][0]} / {res['load'][1]})",
             "", "| rank | layout | params MB | grads MB | AdamW MB | state MB | gathered in step MB | state vs replicated |",
             "|---|---|---|---|---|---|---|---|"]
    mb = 1 / 2**20
    worst = 0.0
    for r in sorted(ranks, key=lambda r: r["rank"]):
        rep = r["footprint"]["replicated"]
        rep_state = rep["params"] + rep["grads"] + rep["optimizer"]
        for k in LAYOUTS:
            f = r["footprint"][k]
            state = f["params"] + f["grads"] + f["optimizer"]
            ratio = state / rep_state
            if k == "sharded":
                worst = max(worst, ratio)
            lines.append(f"| {r['rank']} (pp {r['pp']}, dp {r['dp']}) | {k} | {f['params'] * mb:.2f} | {f['grads'] * mb:.2f} | "
                         f"{f['optimizer'] * mb:.2f} | {state * mb:.2f} | {(f['gathered_params'] + f['gathered_grads']) * mb:.2f} "
                         f"| {ratio:.3f} |")
    ratios = [s / r for s, r in zip(warm["sharded"], warm["replicated"])]
    opt = {k: v[1:] for k, v in res["opt_times"].items()}
    pipe_ratios = [(s - so) / (r - ro) for s, so, r, ro in zip(warm["sharded"], opt["sharded"], warm["replicated"],
                                                               opt["replicated"])]
    med = {k: statistics.median(v) for k, v in warm.items()}
    lo = {k: min(v) for k, v in warm.items()}
    loss_gap = max(abs(a - b) for r in ranks for a, b in zip(r["losses"]["sharded"], r["losses"]["replicated"])
                   if a is not None and b is not None)
    grad_gap = max(r["grad_diff"] for r in ranks)
    grad_scale = max(r["grad_scale"] for r in ranks)
    lines += ["", f"Parameter + gradient + optimizer bytes per rank, sharded / replicated: at most **{worst:.3f}** "
              "(between steps; within a step the gathered parameters and unsharded gradients come on top, column 7).",
              "", "| layout | min s | median s | of which the optimizer step, median s |", "|---|---|---|---|"]
    for k in LAYOUTS:
        lines.append(f"| {k} | {lo[k]:.4f} | {med[k]:.4f} | {statistics.median(res['opt_times'][k][1:]):.4f} |")
    lines += ["", "Where a rank's step goes (medians over the steps after the first, ms): its first forward (the "
              "sharded layout gathers there), its other forwards, its backwards, and the tail from its last task "
              "to the step's end (the last stage's reduction and the loss):", "",
              "| rank | layout | first F | other F | B | tail |", "|---|---|---|---|---|---|"]
    for r in sorted(ranks, key=lambda r: r["rank"]):
        for k in LAYOUTS:
            cols = [statistics.median(x[i] for x in r["parts"][k][1:]) * 1e3 for i in range(4)]
            lines.append(f"| {r['rank']} | {k} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")
    lines += ["", f"Step time sharded / replicated, paired by step ({len(ratios)} pairs, alternated): median "
              f"**{statistics.median(ratios):.3f}**, min {min(ratios):.3f}; ratio of minima {lo['sharded'] / lo['replicated']:.3f}, "
              f"of medians {med['sharded'] / med['replicated']:.3f}. Without the optimizer step (AdamW over DTensor "
              f"shards pays DTensor's dispatch per operation): median {statistics.median(pipe_ratios):.3f}, "
              f"min {min(pipe_ratios):.3f}.",
              f"First-step gradients, sharded (gathered) against replicated: max |diff| {grad_gap:.3g} "
              f"(largest entry {grad_scale:.3g}); loss curves: max |diff| {loss_gap:.3g} over {len(times['sharded'])} steps."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", help="GPT preset (tiny, small, medium)")
    ap.add_argument("--steps", type=int, default=8, help="steps per layout (the first is a warm-up)")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (both replicas)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="longest sample, tokens")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument("--wrap", choices=("blocks", "stage"), default="blocks",
                    help="fully_shard each block and the stage (rrfp train's), or the stage alone (one group)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args()
    res = measure_layouts(args.model, args.steps, args.batch, args.microbatches, args.seq, args.hint, args.wrap)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
