"""Several stages per rank in the library, as torch's multi-stage schedules take them: a
``Pipeline`` given this rank's list of ``PipelineStage`` objects, in the ``loop`` (interleaved)
and ``v`` placements, two processes of two stages each; and ``LocalPipeline`` with
``n_virtual=2``. Loss, outputs and every gradient equal the unpipelined model's in one process
(tests/reference.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handover import rank_env, run_ranks
from reference import ATOL, RTOL, sequential_reference
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.scheduler.tasks import Placement

N_STAGES, M = 4, 4
# (placement, hint): the default auto, and torch's own schedule for the placement named as a hint.
CASES = [("loop", "auto"), ("loop", "Interleaved1F1B"), ("v", "auto"), ("v", "ZBVZeroBubble")]


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block() for _ in range(N_STAGES)]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, generator=g), torch.randn(8, 3, 8, generator=g)


@pytest.mark.parametrize("placement, hint", CASES)
def test_local_pipeline_with_two_stages_per_rank_equals_the_reference(placement, hint) -> None:
    mods = _modules()
    x, y = _batch()
    ref_out, ref_loss, ref_grads = sequential_reference(mods, x, y)
    with LocalPipeline(mods, M, F.mse_loss, n_virtual=2, placement=placement, hint=hint) as pipe:
        loss = pipe.step(x, target=y)
        assert [list(rt.stages) for rt in pipe.runtimes] == [Placement(2, 2, placement).stages_of(r) for r in (0, 1)]
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for m, grads in zip(mods, ref_grads):
        for p, g in zip(m.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One pipeline per case, one after the other in the same two processes (one launch):
    this rank's stages of the placement, given to ``Pipeline`` as a list."""
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    from rrfp import Pipeline, PipelineStage

    for placement, hint in CASES:
        mods = _modules()
        ids = Placement(world, 2, placement).stages_of(rank)
        stages = [PipelineStage(mods[s], s, N_STAGES) for s in ids]
        x, y = _batch()
        pipe = Pipeline(stages, M, F.mse_loss, placement=placement, hint=hint, watchdog=600)
        got = pipe.step(x if 0 in ids else None, target=y if N_STAGES - 1 in ids else None)
        loss = pipe.last_loss
        pipe.close()
        torch.save({"ids": ids, "out": got, "loss": loss,
                    "grads": {s: [p.grad for p in mods[s].parameters()] for s in ids}},
                   f"{out}/{placement}-{hint}.rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("multistage")
    assert run_ranks(_rank_main, 2, str(out), timeout_s=600) == [0, 0]  # a hang bound only
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("placement, hint", CASES)
def test_two_processes_of_two_stages_each_equal_the_reference(two_ranks, placement, hint) -> None:
    ref_out, ref_loss, ref_grads = sequential_reference(_modules(), *_batch())
    parts = [torch.load(two_ranks / f"{placement}-{hint}.rank{r}.pt") for r in (0, 1)]
    # Rank 0 holds stages 0 and 2 (loop) or 0 and 3 (v); the last stage's rank returns the outputs.
    assert [p["ids"] for p in parts] == ([[0, 2], [1, 3]] if placement == "loop" else [[0, 3], [1, 2]])
    last = next(p for p in parts if N_STAGES - 1 in p["ids"])
    torch.testing.assert_close(last["out"], ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(last["loss"]), ref_loss, rtol=RTOL, atol=ATOL)
    assert all(p["out"] is None for p in parts if p is not last)
    for p in parts:
        for s, grads in p["grads"].items():
            for g, want in zip(grads, ref_grads[s]):
                torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL)
