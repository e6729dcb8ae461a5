"""One rank of tests/test_parallel_fsdp.py (4 processes, gloo, PP2 x DP2): stages wrapped in
FSDP2's ``fully_shard`` by the user, torchtitan's way (each block, then the stage), over the
layout's ``dp`` mesh. Every scenario in one launch; each saves this rank's losses and the
gradients gathered from their shards (``full_tensor``)."""

from __future__ import annotations

import os
import random
import sys

import torch

from rrfp.data.batches import make_microbatches
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)
# Replica 0 gets the 4 short samples, replica 1 the 4 long ones: unequal token counts.
SAMPLES = [b"def f(x):\n    return x + 1\n"[: 5 + 2 * i] for i in range(4)] + \
          [b"class A:\n    def g(self, y):\n        return [y] * 3\n"[: 30 + 4 * i] for i in range(4)]
M = 2
SEED = 7
LR = 0.5


@torch.no_grad()
def sgd(params, lr: float = LR) -> None:
    """``p -= lr * grad`` (DTensor shards and plain tensors alike)."""
    for p in params:
        p.add_(p.grad, alpha=-lr)
        p.grad = None


def shard(module, mesh, root_kw: dict | None = None, **kw) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(module, mesh=mesh, **{**kw, **(root_kw or {})})


def _jitter(layout):
    # One DP replica's tasks take random extra time: the replicas run their microbatches in
    # different orders, which the gathers and reductions must not depend on.
    if layout.dp_rank != 1:
        return None
    rng = random.Random(1000 + layout.rank)
    return lambda step, rank, task: rng.choice([0.0, 0.0, 0.002, 0.005])


def run(scenario: str, out: str, *, n_stages: int = 2, steps: int = 2, sharded: bool = True, clip: float | None = None,
        tied: bool = False, bf16: bool = False, zero_grad: bool = True, **options) -> None:
    from rrfp.parallel import ParallelLayout
    from rrfp.parallel.clip import clip_grad_norm_
    from rrfp.parallel.footprint import footprint
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    layout = ParallelLayout.build(2, 2, 1)
    V = n_stages // 2
    ids = [layout.pp_rank + v * 2 for v in range(V)]
    every = split_gpt(GPT(CFG, seed=SEED), n_stages)
    if tied:  # the head starts as a copy of the token embedding; their gradients are summed
        with torch.no_grad():
            every[-1].head.weight.copy_(every[0].tok_emb.weight)
        options["tied"] = {"wte": {0: "tok_emb.weight", n_stages - 1: "head.weight"}}
    mods = [every[s] for s in ids]
    names = [dict(m.stage_param_names) for m in mods]
    whole = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
    if sharded:
        kw, root_kw = {}, {}
        if bf16:  # bf16 compute, fp32 reduction; fp32 logits for the loss
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root_kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        output_dtype=torch.float32)
        for m, s in zip(mods, ids):
            shard(m, layout.mesh["dp"], root_kw if s == n_stages - 1 else None, **kw)
    pipe = Pipeline([PipelineStage(m, s, n_stages) for m, s in zip(mods, ids)], M, lm_loss,
                    loss_weight_fn=count_tokens, layout=layout, watchdog=60, job=scenario, task_delay=_jitter(layout),
                    **options)
    mine = SAMPLES[layout.dp_rank * 4:(layout.dp_rank + 1) * 4]
    mbs = make_microbatches(mine, M)
    params = [p for m in mods for p in m.parameters()]
    losses, norms = [], []
    for k in range(steps):
        pipe.step(microbatches=[(m.tokens,) for m in mbs] if 0 in ids else None,
                  targets=[m.targets for m in mbs] if n_stages - 1 in ids else None)
        losses.append(None if pipe.last_loss is None else torch.tensor(pipe.last_loss))
        if clip is not None:
            norms.append(clip_grad_norm_(params, clip, layout))
        if k < steps - 1 and zero_grad:
            sgd(params)
    grads = {}
    for m, nm in zip(mods, names):
        for n, p in m.named_parameters():
            grads[nm[n]] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    fp = footprint(mods, sharded=pipe.sharded)
    peak = pipe.last_stats.peak_bytes
    reduced = pipe.sharded.reduced if pipe.sharded is not None else 0
    pipe.close()
    torch.save({"losses": losses, "norms": norms, "grads": grads, "coords": (layout.pp_rank, layout.dp_rank),
                "params_bytes": fp.params, "grads_bytes": fp.grads, "gathered": fp.gathered_params, "whole": whole,
                "peak_bytes": peak, "reduced": reduced}, f"{out}/{scenario}.rank{layout.rank}.pt")


def refusals(out: str) -> None:
    """Each refused sharded stage: this rank's one-line message."""
    from torch.distributed.fsdp import fully_shard

    from rrfp.parallel import ParallelLayout
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    layout = ParallelLayout.build(2, 2, 1)
    p = layout.pp_rank
    cases = {
        "blocks_only": lambda m: [fully_shard(b, mesh=layout.mesh["dp"]) for b in m.blocks],
        "per_microbatch": lambda m: shard(m, layout.mesh["dp"], reshard_after_forward=True),
        "no_layout": lambda m: shard(m, layout.mesh["dp"]),
    }
    got = {}
    for name, wrap in cases.items():
        mod = split_gpt(GPT(CFG, seed=SEED), 2)[p]
        wrap(mod)
        try:
            Pipeline(PipelineStage(mod, p, 2), M, lm_loss, layout=None if name == "no_layout" else layout,
                     rank=p, n_ranks=2, job=f"refused-{name}-dp{layout.dp_rank}", watchdog=60)
            got[name] = "accepted"
        except ValueError as e:
            got[name] = str(e)
    torch.save(got, f"{out}/refused.rank{layout.rank}.pt")


def main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    run("full", out, hint="bf", clip=0.05)
    run("split_thread", out, hint="bfw", executor="thread")
    run("virtual", out, n_stages=4, hint="bfw", steps=1)
    run("budget_replicated", out, sharded=False, steps=1, hint="strict-1f1b", memory_budget="1GiB")
    run("budget_sharded", out, steps=1, hint="strict-1f1b", memory_budget="1GiB")
    run("deterministic", out, steps=1, hint="bfw", deterministic=True)
    run("tied", out, steps=1, hint="bf", tied=True)
    run("bf16_split", out, steps=1, hint="bfw", bf16=True)
    run("accumulate", out, steps=2, hint="bfw", tied=True, zero_grad=False)
    refusals(out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
