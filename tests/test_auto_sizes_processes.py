"""``auto``'s measured microbatch sizes through rrfp's own control plane, two real processes
(:class:`~rrfp.runtime.features.share.ControlShare`, the items msgpack-packed in control messages):
with a memory budget on both ranks, both rank on the same measured sizes, equal to what autograd
saves by hand; with a budget on one rank only, neither ranks on sizes (the other measured none)
and both keep that one rank's budget. Either way both processes reach the same ranking and trial,
and neither waits for the other beyond the bound."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp
from handover import rank_env, run_ranks

M = 4
ROWS = [2 * (m + 1) for m in range(M)]  # microbatch m: 2 (m + 1) rows


def _rank_main(rank: int, world: int, port: int, out: str, budgets: tuple) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    from torch.distributed import TCPStore

    from rrfp.transport.zmq import ZmqTransport

    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(world)]
    store = TCPStore("127.0.0.1", port, world, is_master=False)
    transport = ZmqTransport(rank, world, store, "auto-sizes")
    stage = rrfp.PipelineStage(mods[rank], rank, world)
    options = {"memory_budget": budgets[rank]} if budgets[rank] else {}
    with rrfp.Pipeline(stage, M, F.mse_loss, watchdog=300, rank=rank, n_ranks=world, transport=transport,
                       job="auto-sizes", **options) as pipe:
        for k in range(3):  # warm-up, the strict schedule's measuring step, the split candidate's
            g = torch.Generator().manual_seed(k)
            xs = [(torch.randn(n, 6, generator=g),) for n in ROWS]
            ys = [torch.randn(n, 6, generator=g) for n in ROWS]
            pipe.step(microbatches=xs if rank == 0 else None, targets=ys if rank == world - 1 else None)
        a = pipe.auto
        found = {"sizes": a.profile.sizes, "memory": a.memory(), "order": [h for h, _ in a.ranking.order],
                 "trial": a.trial}
    torch.save(found, f"{out}/rank{rank}.pt")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("budgets", [("1MiB", "1MiB"), ("1MiB", None)])
def test_both_processes_rank_on_the_same_measured_sizes(tmp_path, budgets):
    codes = run_ranks(_rank_main, 2, str(tmp_path), budgets, timeout_s=540)
    assert codes == [0, 0], codes
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert a == b
    if budgets[1]:
        # Per row, 6 float32: stage 0 saves Linear's input and Tanh's output (48 bytes), the last
        # stage those and the loss's target (72): test_auto_sizes' local pipeline, by hand.
        want = (tuple(48 * n for n in ROWS), tuple(72 * n for n in ROWS))
        assert a["sizes"] == (want, want)
        assert a["memory"][1] == [2 ** 20, 2 ** 20]
    else:
        assert a["sizes"] == ()  # rank 1 measured none: no sizes, the stage means only
        assert a["memory"][1] == [2 ** 20, None]
    assert a["trial"] and set(a["trial"]) <= set(a["order"])
