"""Memory per rank by layout: rrfp beside torch's pipelining, and the same memory model on paper
for Llama-3 8B and 70B (issue 31).

Measured: 4 gloo processes (1 torch thread each), the same GPT (``--model``, fixed-length
random tokens, the same batches), per layout: ``pp4``; ``pp2xdp2`` (PP2 x DP2, replicated:
rrfp's all-reduce; torch: ``DistributedDataParallel`` inside the stage, which torch's stage
drives with ``no_sync`` until the last backward); ``pp2xdp2-sharded`` (FSDP2 ``fully_shard`` of
each block and the stage over the DP mesh, ``reshard_after_forward=False``, as torchtitan and
``rrfp train --dp-shard full`` wrap them). rrfp runs its ``1f1b`` hint, torch
``torch.distributed.pipelining.Schedule1F1B`` over ``PipelineStage``. All six are built in the
same processes and stepped in a rotating order, one step each per round, by
``bench_dp_shard``'s harness (:func:`benchmarks.bench_dp_shard.alternate`: a barrier before
each, the slowest rank's time), so load and drift fall on all.

Measured the same way for both runtimes, per rank, after the last step:

* parameters, gradients, optimizer states: :func:`rrfp.parallel.footprint.footprint` of the
  rank's stage module and AdamW;
* gathered: FSDP2's unsharded parameters and gradients held within the step
  (:func:`rrfp.parallel.footprint.gathered_bytes`: rrfp's taken just before its reduction,
  torch's at each microbatch's backward, the largest);
* activations: the most bytes autograd held saved for backward at once in a step
  (``benchmarks.harness.ActivationMeter`` around the stage module's forward and the loss; rrfp's
  own measurement, ``StepStats.peak_bytes``, beside it).

The process's RSS is not split by layout: all six live in each process.

On paper: :mod:`benchmarks.memory_model` (the section's second half).

    python -m benchmarks.bench_memory [--model medium] [--steps 6] [--out BENCHMARKS.md] [--json raw.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_dp_shard import _loadavg, alternate  # noqa: E402

RUNTIMES = ("rrfp", "torch")
LAYOUTS = {"pp4": (4, 1, False), "pp2xdp2": (2, 2, False), "pp2xdp2-sharded": (2, 2, True)}
"""Layout name -> (PP, DP, sharded)."""
KINDS = ("params", "grads", "optimizer", "gathered", "activations")
TITLE = "Memory per rank by layout, beside torch's pipelining (issue 31)"


class _Metered:
    """Counts what the module's forward saves for backward with ``meter`` (a forward pre-hook
    enters its saved-tensor hooks, the forward hook leaves them): the stage stays the module
    each runtime drives (an FSDP2 or DDP module is recognised by its type)."""

    def __init__(self, module, meter) -> None:
        self.meter, self.ctx = meter, []
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, mod, args) -> None:
        cm = self.meter.hooks()
        cm.__enter__()
        self.ctx.append(cm)

    def _leave(self, mod, args, out) -> None:
        self.ctx.pop().__exit__(None, None, None)


def _runner(runtime: str, name: str, cfg: dict, layouts: dict, model_cfg):
    """One (runtime, layout): its module, optimizer, meter and step function on this rank."""
    import torch
    from torch import nn

    from benchmarks.harness import ActivationMeter
    from rrfp.model.gpt import build_stage, count_tokens, lm_loss
    from rrfp.parallel.footprint import gathered_bytes
    from rrfp.parallel.sharded import fsdp_modules
    from rrfp.parallel.train import shard_stage

    pp, dp, sharded = LAYOUTS[name]
    layout = layouts[(pp, dp)]
    p = layout.pp_rank
    module = build_stage(model_cfg, pp, p, 0)
    if sharded:
        shard_stage(module, layout)  # each block, then the stage (rrfp train --dp-shard full)
    meter = ActivationMeter()
    meter.exclude([getattr(q, "_local_tensor", q) for q in module.parameters()])  # a shard: its local part
    meter.active = True
    loss_fn = meter.metered(lm_loss)
    r = {"module": module, "meter": meter, "p": p, "pp": pp, "layout": layout, "gathered": [0, 0]}
    if runtime == "rrfp":
        from rrfp.runtime.doors.pipeline import Pipeline
        from rrfp.runtime.engine.stage import PipelineStage

        _Metered(module, meter)
        pipe = Pipeline(PipelineStage(module, p, pp), cfg["microbatches"], loss_fn, loss_weight_fn=count_tokens,
                        layout=layout if dp > 1 else None, job=f"mem-{name}", hint="1f1b", watchdog=900)
        for rt in pipe.runtimes:
            rt.measure_activations()
        r["pipe"] = pipe
    else:
        from torch.distributed.pipelining import PipelineStage as TorchStage, Schedule1F1B

        wrapped = module
        if dp > 1 and not sharded:
            wrapped = nn.parallel.DistributedDataParallel(module, process_group=layout.mesh["dp"].get_group(),
                                                          gradient_as_bucket_view=True)
        _Metered(module, meter)
        if sharded:  # the gathered state, at each microbatch's backward of the stage
            mods = fsdp_modules(module)

            def seen(grad, r=r, mods=mods):
                got = gathered_bytes(mods)
                r["gathered"] = [max(a, b) for a, b in zip(r["gathered"], got)]

            def watch(mod, args, out, seen=seen) -> None:
                if out.requires_grad:
                    out.register_hook(seen)

            module.register_forward_hook(watch)
        group = layout.mesh["pp"].get_group() if dp > 1 else None
        stage = TorchStage(wrapped, p, pp, torch.device("cpu"), group=group)
        r["sched"] = Schedule1F1B(stage, cfg["microbatches"], loss_fn=loss_fn)
    r["opt"] = torch.optim.AdamW(list(module.parameters()), lr=1e-3)
    return r


def rank_main(cfg: dict) -> dict | None:
    """One rank: every (runtime, layout) built, stepped in turn; the figures gathered to rank 0."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from rrfp.model.gpt import GPT_PRESETS
    from rrfp.parallel import ParallelLayout
    from rrfp.parallel.footprint import footprint

    model_cfg = dataclasses.replace(GPT_PRESETS[cfg["model"]], max_len=cfg["seq"])
    layouts = {(pp, dp): ParallelLayout.build(pp, dp, 1) for pp, dp, _ in LAYOUTS.values()}
    names = [f"{rt}/{lay}" for lay in LAYOUTS for rt in RUNTIMES]
    runners = {n: _runner(*n.split("/"), cfg, layouts, model_cfg) for n in names}
    g = torch.Generator().manual_seed(0)
    B, T, V = cfg["batch"], cfg["seq"], model_cfg.vocab_size
    data = [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
            for _ in range(cfg["steps"])]
    act = {n: [] for n in names}
    own = {n: [] for n in names}

    def pipeline_step(n: str, step: int) -> None:
        r = runners[n]
        layout, p, pp = r["layout"], r["p"], r["pp"]
        x, y = data[step]
        part = B // layout.dp  # this replica's share of the batch
        x, y = x[layout.dp_rank * part:(layout.dp_rank + 1) * part], y[layout.dp_rank * part:(layout.dp_rank + 1) * part]
        r["opt"].zero_grad(set_to_none=True)
        r["meter"].reset_peak()
        if "pipe" in r:
            M = cfg["microbatches"]
            r["pipe"].step(microbatches=[(c,) for c in x.chunk(M)] if p == 0 else None,
                           targets=list(y.chunk(M)) if p == pp - 1 else None)
        elif p == 0:
            r["sched"].step(x)
        elif p == pp - 1:
            r["sched"].step(target=y)
        else:
            r["sched"].step()

    def between(n: str, step: int, t_end: float) -> None:
        r = runners[n]
        act[n].append(r["meter"].peak)
        if "pipe" in r:
            own[n].append(r["pipe"].last_stats.peak_bytes)

    times, opt_times = alternate(names, cfg["steps"], pipeline_step, lambda n, step: runners[n]["opt"].step(), between)
    mine = {"rank": dist.get_rank(), "by": {}}
    for n, r in runners.items():
        sharded = r["pipe"].sharded if "pipe" in r else None
        fp = footprint([r["module"]], r["opt"], sharded)
        gathered = fp.gathered_params + fp.gathered_grads if sharded is not None else sum(r["gathered"])
        mine["by"][n] = {"params": fp.params, "grads": fp.grads, "optimizer": fp.optimizer, "gathered": gathered,
                         "activations": max(act[n][1:] or act[n]), "own_activations": max(own[n][1:] or own[n] or [0]),
                         "pp_rank": r["p"], "dp_rank": r["layout"].dp_rank,
                         "numel": sum(q.numel() for q in r["module"].parameters())}  # a DTensor's: the whole
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for r in runners.values():
        if "pipe" in r:
            r["pipe"].close()
    if dist.get_rank() != 0:
        return None
    return {"times": times, "opt_times": opt_times, "ranks": everyone}


def measure(model: str = "medium", steps: int = 6, batch: int = 16, microbatches: int = 4, seq: int = 128,
            timeout: float = 3000) -> dict:
    """Launch the 4 rank processes once and measure every (runtime, layout) (module doc).

    Returns:
        ``{"times": {name: [s per step]}, "opt_times": ..., "ranks": [per rank: {"by": {name:
        bytes by kind, pp_rank, dp_rank}}], "load": [before, after], "config": ...}``.
    """
    from benchmarks.launcher import launch

    before = _loadavg()
    cfg = {"model": model, "steps": steps, "batch": batch, "microbatches": microbatches, "seq": seq}
    res = launch("benchmarks.bench_memory:rank_main", 4, cfg, timeout=timeout).result
    res["load"] = [before, _loadavg()]
    res["config"] = cfg
    return res


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _state(f: dict) -> int:
    return f["params"] + f["grads"] + f["optimizer"]


def measured_tables(res: dict) -> list[str]:
    """The measured tables (markdown lines): per layout and rank, bytes by kind, rrfp beside
    torch; per layout, the largest rank and the step time."""
    cfg, ranks = res["config"], sorted(res["ranks"], key=lambda r: r["rank"])
    lines = [f"### Measured: 4 processes, `{cfg['model']}` GPT, batch {cfg['batch']} x {cfg['seq']} tokens, "
             f"{cfg['microbatches']} microbatches per pipeline, {cfg['steps']} rounds "
             f"(load before/after {res['load'][0]} / {res['load'][1]})", "",
             "MiB per rank; `state` = params + grads + AdamW; `gathered` = FSDP2's unsharded parameters and gradients "
             "within the step; `act` = the most activation bytes held at once (ActivationMeter; rrfp's own "
             "measurement, `StepStats.peak_bytes`, in brackets).", "",
             "| layout | rank (pp, dp) | runtime | params | grads | AdamW | state | gathered | act |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lay in LAYOUTS:
        for r in ranks:
            for rt in RUNTIMES:
                f = r["by"][f"{rt}/{lay}"]
                own = f" [{_mib(f['own_activations'])}]" if rt == "rrfp" else ""
                lines.append(f"| {lay} | {r['rank']} ({f['pp_rank']}, {f['dp_rank']}) | {rt} | {_mib(f['params'])} | "
                             f"{_mib(f['grads'])} | {_mib(f['optimizer'])} | {_mib(_state(f))} | {_mib(f['gathered'])} | "
                             f"{_mib(f['activations'])}{own} |")
    lines += ["", "Per layout, the rank holding the most (MiB) and the step time (the slowest rank's, pipeline step + "
              "AdamW; medians over the rounds after the first):", "",
              "| layout | runtime | state | state + gathered + act | step s | of which AdamW s |", "|---|---|---|---|---|---|"]
    for lay in LAYOUTS:
        for rt in RUNTIMES:
            n = f"{rt}/{lay}"
            by = [r["by"][n] for r in ranks]
            total = max(_state(f) + f["gathered"] + f["activations"] for f in by)
            lines.append(f"| {lay} | {rt} | {_mib(max(_state(f) for f in by))} | {_mib(total)} | "
                         f"{statistics.median(res['times'][n][1:] or res['times'][n]):.3f} | "
                         f"{statistics.median(res['opt_times'][n][1:] or res['opt_times'][n]):.3f} |")
    return lines


def modelled(res: dict) -> tuple[float, float]:
    """The memory model's (:func:`benchmarks.memory_model.kind_bytes_per_param`: fp32
    replicated, or FSDP fp32 over DP 2) state and gathered bytes against the measured, per
    (runtime, layout, rank): the smallest and largest ratio measured / modelled."""
    from benchmarks.memory_model import kind_bytes_per_param

    ratios = []
    for r in res["ranks"]:
        for n, f in r["by"].items():
            pp, dp, sharded = LAYOUTS[n.split("/")[1]]
            k = kind_bytes_per_param("FSDP fp32" if sharded else "replicated fp32", dp if sharded else 1)
            ratios.append(_state(f) / (f["numel"] * (k["params"] + k["grads"] + k["optimizer"])))
            if sharded:
                ratios.append(f["gathered"] / (f["numel"] * (k["gathered_params"] + k["gathered_grads"])))
    return min(ratios), max(ratios)


def findings(res: dict) -> list[str]:
    """The measured run's ratios, as bullet lines."""
    ranks = res["ranks"]
    model = ""
    if all("numel" in f for r in ranks for f in r["by"].values()):  # raw figures from before it was recorded
        lo, hi = modelled(res)
        model = (" The memory model below (16 bytes per parameter replicated; 16/2 sharded, 4 + 4 gathered) gives "
                 f"every measured state and gathered figure within measured / modelled {lo:.5f}-{hi:.5f} (AdamW's "
                 "4-byte step counters, which the model leaves out).")

    def ratio(a: str, b: str, key) -> list[float]:
        return [key(r["by"][a]) / key(r["by"][b]) for r in ranks]

    def paired(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(res["times"][a][1:], res["times"][b][1:])] or [float("nan")]

    state = {rt: ratio(f"{rt}/pp2xdp2-sharded", f"{rt}/pp2xdp2", _state) for rt in RUNTIMES}
    own = [abs(r["by"][n]["own_activations"] - r["by"][n]["activations"]) / r["by"][n]["activations"]
           for r in ranks for n in r["by"] if n.startswith("rrfp/")]
    act = {lay: ratio(f"torch/{lay}", f"rrfp/{lay}", lambda f: f["activations"]) for lay in LAYOUTS}
    sh = paired("rrfp/pp2xdp2-sharded", "rrfp/pp2xdp2")
    vs = {lay: paired(f"rrfp/{lay}", f"torch/{lay}") for lay in LAYOUTS}
    return [
        f"- State (parameters + gradients + AdamW) per rank, sharded / replicated: rrfp {max(state['rrfp']):.3f}, "
        f"torch {max(state['torch']):.3f} at most (target at most 0.55); both hold the same bytes by kind on every "
        "rank and layout, and a step of either gathers the whole stage on top (column `gathered`)." + model,
        f"- Activations: rrfp's own measurement is within {100 * max(own):.2f}% of the meter's on every rank. torch / "
        "rrfp, per rank: " + "; ".join(f"{lay} [{' '.join(f'{x:.2f}' for x in v)}]" for lay, v in act.items()) +
        ". Both keep 1F1B's p - rank microbatches in flight; torch's first stage also still holds part of its "
        "step's saved tensors when the step returns (the meter's live count stays above 0 there, 0 on the other "
        "stages; freed as its next step runs), so its peak carries them on top.",
        f"- Step time, rrfp sharded / rrfp replicated, paired by round: median {statistics.median(sh):.3f} (target at "
        "most 1.15). rrfp / torch at the same layout, paired: " +
        "; ".join(f"{lay} {statistics.median(v):.3f}" for lay, v in vs.items()) + ".",
    ]


def section(res: dict) -> str:
    """The whole BENCHMARKS.md section: how it is measured, the measured tables and ratios, and
    the projection (:mod:`benchmarks.memory_model`)."""
    from benchmarks import memory_model

    intro = [f"## {TITLE}", "",
             "Written by `python -m benchmarks.bench_memory --out BENCHMARKS.md` (this section only; the others stay). "
             "Four gloo processes build the same GPT under three layouts, `pp4`, `pp2xdp2` (replicated: rrfp's "
             "all-reduce; torch: `DistributedDataParallel` in the stage) and `pp2xdp2-sharded` (FSDP2 `fully_shard` of "
             "each block and the stage, `reshard_after_forward=False`), each run by rrfp (hint `1f1b`) and by torch's "
             "pipelining (`PipelineStage` + `Schedule1F1B`), all six in the same processes, stepped in a rotating "
             "order (`benchmarks/bench_dp_shard.py`'s harness). Both are measured the same way: "
             "`rrfp.parallel.footprint` of the stage module and its AdamW, FSDP2's gathered bytes "
             "(`gathered_bytes`), and the benchmarks' `ActivationMeter` (saved-tensor hooks around the stage's "
             "forward and the loss).", ""]
    def largest(pp: int, tp: int, dp: int) -> tuple[float, ...]:  # GiB: distributed optimizer; FSDP mixed
        m = memory_model.LLAMA3_70B
        n = max(m.stage_params(pp, r, tp) for r in range(pp)) / memory_model.GIB
        return (n * memory_model.state_bytes_per_param("distributed optimizer", dp)[0],
                *(n * b for b in memory_model.state_bytes_per_param("FSDP mixed", dp)))

    tp8, pp8 = largest(4, 8, 4), largest(8, 1, 16)
    proj = ["### Projected: Llama-3 8B and 70B on 8-128 ranks", "", (memory_model.__doc__ or "").split("\n\n", 1)[1].strip(),
            "", memory_model.report(),
            "Reading the projection: with PP the stage stays gathered through the step (no per-microbatch "
            "all-gathers), so PP x FSDP in mixed precision holds 16/d bytes per parameter between steps but 6 + 16/d "
            "at a step's peak: 4/d more than Megatron's distributed optimizer (6 + 12/d), far less than replicated "
            "DP (16 or 18). Its advantage is the state between steps (checkpoints, the optimizer step); the peak "
            "only falls below the distributed optimizer's if the stage is gathered per microbatch again "
            "(`reshard_after_forward=True`, a gather per microbatch and block, which rrfp refuses, "
            "`rrfp/parallel/sharded.py`). Activations at 1F1B's in-flight limit do not depend on the layout: rank 0 holds "
            "L layers' worth of one microbatch whatever PP is, so at sequence 8192 they need full recomputation "
            "(`--activation-checkpointing`) or a smaller in-flight limit (`--inflight-limit`, `--memory-budget`) on "
            "an 80 GiB device, or tensor parallelism with sequence parallelism (34sbh/t; without it the 10sbh of "
            "norms, residuals and dropout stay whole on every TP rank). TP divides the state as DP sharding does but "
            f"without the gathered transient: the 70B at PP 4 x TP 8 x DP 4 holds {tp8[0]:.1f} GiB with the "
            f"distributed optimizer and {tp8[1]:.1f} + {tp8[2]:.1f} with FSDP mixed, where PP 8 x DP 16 needs "
            f"{pp8[0]:.1f} and {pp8[1]:.1f} + {pp8[2]:.1f}. rrfp's TP "
            "(`--tp`, its GPT) keeps the embedding and head whole and has no sequence parallelism, so the TP rows are "
            "Megatron's and torchtitan's layout, not rrfp's. `tests/test_memory_model.py` checks the arithmetic "
            "against Meta's parameter counts, transformers' own Llama, Megatron's table, the ZeRO paper's example, "
            "Korthikanti's formulas, and rrfp's own footprint of a small Llama's stages (replicated; FSDP2-sharded in "
            "fp32 and bf16, with the gathered bytes a step holds)."]
    return "\n".join(intro + measured_tables(res) + [""] + findings(res) + [""] + proj) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this section of ``path`` (from its ``## `` title to the next ``## ``) with
    ``text``, or append it; written atomically."""
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines(keepends=True)
    title = f"## {TITLE}"
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == title), None)
    if start is None:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + rest if rest else "")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", help="GPT preset (tiny, small, medium)")
    ap.add_argument("--steps", type=int, default=8, help="rounds (every one of the six steps once per round; the first warms up)")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (over the DP replicas)")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per pipeline and step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample")
    ap.add_argument("--out", default=None, help="write the section into this markdown file (BENCHMARKS.md)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--from-json", default=None, help="render the section from raw figures written by --json")
    args = ap.parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        res = measure(args.model, args.steps, args.batch, args.microbatches, args.seq)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    text = section(res)
    if args.out:
        write_section(Path(args.out), text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
