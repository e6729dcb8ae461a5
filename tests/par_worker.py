"""One rank of tests/test_parallel_layouts.py (4 processes, gloo): every scenario in one launch,
so the processes start once. Each scenario saves this rank's loss, gradients and task records.
With a fifth argument ``tp-hints``: the split-backward hints under PP2 x TP2 only
(tests/test_parallel_tp_hints.py)."""

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
        jitter: bool = False, tp_exchange: str = "control", weighted: bool = True, hint: str = "auto",
        delay=None) -> None:
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
    delay = None if delay is None else delay(layout)
    if jitter and layout.tp_rank == 1:
        import random

        rng = random.Random(1000 + layout.rank)
        delay = lambda step, rank, task: rng.choice([0.0, 0.0, 0.002, 0.005])  # noqa: E731
    pipe = Pipeline(PipelineStage(mod, p, 2), M, lm_loss, loss_weight_fn=count_tokens if weighted else None,
                    layout=layout, watchdog=60,
                    job=scenario, tied={"wte": {0: "tok_emb.weight", 1: "head.weight"}} if tied else None,
                    record=True, task_delay=delay, tp_exchange=tp_exchange, hint=hint)
    per = len(SAMPLES) // dp
    mine = SAMPLES[layout.dp_rank * per:(layout.dp_rank + 1) * per]
    mbs = make_microbatches(mine, M)
    losses, norms, orders = [], [], []
    for k in range(steps):
        pipe.step(microbatches=[(m.tokens,) for m in mbs] if p == 0 else None,
                  targets=[m.targets for m in mbs] if p == 1 else None)
        losses.append(None if pipe.last_loss is None else torch.tensor(pipe.last_loss))
        orders.append([str(r.task) for r in pipe.last_stats.records])
        if clip is not None:
            norms.append(clip_grad_norm_(mod.parameters(), clip, layout))
        if k < steps - 1:
            sgd(mod.parameters())
    pipe.close()
    # records: the last step's task order; orders: every step's.
    torch.save({"losses": losses, "norms": norms, "records": orders[-1], "orders": orders,
                "coords": (p, layout.dp_rank, layout.tp_rank),
                "grads": {mod.stage_param_names[n]: prm.grad for n, prm in mod.named_parameters()}},
               f"{out}/{scenario}.rank{layout.rank}.pt")


TP_HINTS = ("bfw-mem", "bfw", "wfloat", "strict-split", "zb-h1")
"""The split-backward hint families tests/test_parallel_tp_hints.py runs under PP2 x TP2."""


def w_race(layout):
    """Injected delays (step 0 only) after which stage 0's TP ranks see the gradient of
    microbatch 1 at different times: TP rank 1 stays busy 0.5 s after I(0, 0), stage 1's TP
    rank 0 holds back its gradient of microbatch 1 for 1.5 s. So stage 0's TP rank 0 has only
    W(0, 0) to run while TP rank 1 has I(0, 1) too: the moment a collective inside W meets an
    agreement exchange (the bfw-mem deadlock)."""
    def after(kind: str, mb: int, seconds: float):
        return lambda step, rank, task: seconds if step == 0 and task.kind == kind and task.mb == mb else 0.0

    if (layout.pp_rank, layout.tp_rank) == (0, 1):
        return after("I", 0, 0.5)
    if (layout.pp_rank, layout.tp_rank) == (1, 0):
        return after("I", 1, 1.5)
    return None


def tp_hints(out: str) -> None:
    for hint in TP_HINTS:
        run(f"tp-{hint}", out, dp=1, tp=2, steps=2, hint=hint, delay=w_race)


def reference(tied: bool = False, steps: int = 1, clip: float | None = None):
    """The single-process GPT on the whole batch: ``(losses per step, clipped norms, the
    last step's gradients by name)``, SGD (:func:`sgd`) between steps."""
    from rrfp.data.batches import pad_batch

    model = GPT(CFG, seed=SEED)
    if tied:
        model.head.weight = model.tok_emb.weight
    tokens, targets = pad_batch(SAMPLES)
    losses, norms = [], []
    for k in range(steps):
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        losses.append(loss.detach())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if k < steps - 1:
            sgd(model.parameters())
    return losses, norms, {n: p.grad for n, p in model.named_parameters()}


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


def main(rank: int, world: int, port: int, out: str, only: str = "") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if only == "tp-hints":
        tp_hints(out)
        return
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
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
