"""One rank of tests/test_parallel_layouts.py (4 processes, gloo): every scenario in one launch,
so the processes start once. Each scenario saves this rank's loss, gradients and task records."""

from __future__ import annotations

import os
import sys

import torch

from rrfp.data.batches import make_microbatches
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, max_len=64)
# Replica 0 gets the 4 short samples, replica 1 the 4 long ones: unequal token counts.
SAMPLES = [b"def f(x):\n    return x + 1\n"[: 5 + 2 * i] for i in range(4)] + \
          [b"class A:\n    def g(self, y):\n        return [y] * 3\n"[: 30 + 4 * i] for i in range(4)]
M = 2
SEED = 7


@torch.no_grad()
def sgd(params, lr: float = 0.5) -> None:
    """Plain SGD, ``p -= lr * grad`` (torch.optim's import pulls in torch._dynamo: seconds a process)."""
    for p in params:
        p.add_(p.grad, alpha=-lr)
        p.grad = None


def stage_modules(tied: bool):
    stages = split_gpt(GPT(CFG, seed=SEED), 2)
    if tied:
        with torch.no_grad():
            stages[1].head.weight.copy_(stages[0].tok_emb.weight)
    return stages


def run(scenario: str, out: str, dp: int, tp: int, steps: int = 1, tied: bool = False, clip: float | None = None,
        jitter: bool = False, tp_exchange: str = "control", weighted: bool = True) -> None:
    from rrfp.parallel import ParallelLayout
    from rrfp.parallel.clip import clip_grad_norm_
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    layout = ParallelLayout.build(2, dp, tp)
    p = layout.pp_rank
    mod = stage_modules(tied)[p]
    if tp > 1:
        from rrfp.model.tp import shard_gpt_stage

        shard_gpt_stage(mod, layout.tp_rank, tp, layout.tp_group, "manual")
    delay = None
    if jitter and layout.tp_rank == 1:
        import random

        rng = random.Random(1000 + layout.rank)
        delay = lambda step, rank, task: rng.choice([0.0, 0.0, 0.002, 0.005])  # noqa: E731
    pipe = Pipeline(PipelineStage(mod, p, 2), M, lm_loss, loss_weight_fn=count_tokens if weighted else None,
                    layout=layout, watchdog=60,
                    job=scenario, tied={"wte": {0: "tok_emb.weight", 1: "head.weight"}} if tied else None,
                    record=True, task_delay=delay, tp_exchange=tp_exchange)
    per = len(SAMPLES) // dp
    mine = SAMPLES[layout.dp_rank * per:(layout.dp_rank + 1) * per]
    mbs = make_microbatches(mine, M)
    losses, norms = [], []
    for k in range(steps):
        pipe.step(microbatches=[(m.tokens,) for m in mbs] if p == 0 else None,
                  targets=[m.targets for m in mbs] if p == 1 else None)
        losses.append(None if pipe.last_loss is None else torch.tensor(pipe.last_loss))
        if clip is not None:
            norms.append(clip_grad_norm_(mod.parameters(), clip, layout))
        if k < steps - 1:
            sgd(mod.parameters())
    records = [str(r.task) for r in pipe.last_stats.records]
    pipe.close()
    torch.save({"losses": losses, "norms": norms, "records": records, "coords": (p, layout.dp_rank, layout.tp_rank),
                "grads": {mod.stage_param_names[n]: prm.grad for n, prm in mod.named_parameters()}},
               f"{out}/{scenario}.rank{layout.rank}.pt")


def accumulation(out: str, case: str, pp: int, dp: int) -> None:
    """Two steps of ``case`` (tests/tie_cases.py) without ``zero_grad`` between them, on PP
    ``pp`` x DP ``dp``: each replica its rows of each step's batch."""
    import tie_cases as C

    from rrfp.parallel import ParallelLayout
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    layout = ParallelLayout.build(pp, dp, 1)
    p = layout.pp_rank
    _, modules, tied = C.build(case, pp)
    mod = modules[p]
    pipe = Pipeline(PipelineStage(mod, p, pp), M, lm_loss, loss_weight_fn=count_tokens, layout=layout, watchdog=60,
                    job=f"accum-{case}-{pp}", tied=tied, hint="1f1b")
    rows = slice(layout.dp_rank * C.ROWS // dp, (layout.dp_rank + 1) * C.ROWS // dp)
    for k in range(2):
        ids, mask, targets = C.batch(case, k)
        kwargs = {"attention_mask": mask[rows]} if mask is not None and p == 0 else {}
        pipe.step(ids[rows] if p == 0 else None, target=targets[rows] if p == pp - 1 else None, **kwargs)
    pipe.close()
    torch.save({"coords": (p, layout.dp_rank), "grads": C.stage_grads([mod])[p]},
               f"{out}/accum-{case}-pp{pp}.rank{layout.rank}.pt")


def ddp_refused(out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from rrfp.runtime.engine.stage import PipelineStage

    try:
        PipelineStage(DistributedDataParallel(stage_modules(False)[0]), 0, 2)
        msg = None
    except ValueError as e:
        msg = str(e)
    with open(f"{out}/ddp.rank{os.environ['RANK']}.txt", "w") as f:
        f.write(msg or "accepted")
    import argparse

    from rrfp.parallel.train import train_layout

    try:  # rrfp train under torchrun with a world that is not stages x dp x tp
        train_layout(argparse.Namespace(stages=2, dp=1, tp=1))
        msg = None
    except ValueError as e:
        msg = str(e)
    with open(f"{out}/world.rank{os.environ['RANK']}.txt", "w") as f:
        f.write(msg or "accepted")


def main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    run("dp", out, dp=2, tp=1)
    run("tied", out, dp=2, tp=1, tied=True)
    run("dp_mean", out, dp=2, tp=1, weighted=False)
    run("clip", out, dp=2, tp=1, steps=3, clip=0.05)
    run("tp", out, dp=1, tp=2, jitter=True, clip=0.05)
    run("tied_tp", out, dp=1, tp=2, tied=True, jitter=True, tp_exchange="gloo")
    ddp_refused(out)
    import tie_cases

    for case in tie_cases.CASES:
        accumulation(out, case, pp=4, dp=1)
        accumulation(out, case, pp=2, dp=2)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
