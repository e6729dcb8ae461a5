"""A PyTorch schedule used as a hint holds at most that schedule's own activation bytes on every
rank, against PyTorch's own run: every schedule ``torch.distributed.pipelining`` has (GPipe,
1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), run by torch
and by rrfp (``hint=`` the torch class) in the same 2 processes, live activation bytes counted
the same way in both (the benchmarks' ``ActivationMeter``: storages autograd saves for backward,
counted while autograd holds them; the loss's too). rrfp runs with the last rank's backwards
slowed, so every forward the hint may run ahead of its order does; a field trial measured rank 0
of ``Interleaved1F1B`` at 4.04 MB against torch's 3.51 MB. The virtual stages differ in width,
so holding another mix of them than the schedule does costs bytes. The same bound over many
shapes, sizes and delays, in simulation: ``tests/test_scheduler_memory.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handover import rank_env, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

pytestmark = pytest.mark.slow
WORLD, M, D, ROWS = 2, 4, 16, 8
SCHEDULES = {  # torch class -> (virtual stages per rank, placement)
    "ScheduleGPipe": (1, "loop"), "Schedule1F1B": (1, "loop"), "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleLoopedBFS": (2, "loop"), "ScheduleInterleavedZeroBubble": (1, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"), "ScheduleDualPipeV": (2, "v"),
}
SLOW_BACKWARD_S = 0.05  # the last rank's backwards: the other rank's forwards are all ready first


class Block(nn.Module):
    """``tanh(x W1^T) W2^T``, hidden width ``h``: saves ``x`` and the ``[rows, h]`` activation.
    Plain ``F.linear`` on its own parameters, so rrfp's split backward defers nothing to W
    (a deferred layer's inputs would live outside autograd, where the meter does not look)."""

    def __init__(self, h: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(h, D, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(D, h, generator=g) * 0.2)

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.w1)), self.w2)


class Metered(nn.Module):
    def __init__(self, inner: nn.Module, meter) -> None:
        super().__init__()
        self.inner, self.meter = inner, meter

    def forward(self, x):
        if not self.meter.active:
            return self.inner(x)
        with self.meter.hooks():
            return self.inner(x)


def _stage_ids(rank: int, V: int, placement: str) -> list[int]:
    if V == 1:
        return [rank]
    return [rank, 2 * WORLD - 1 - rank] if placement == "v" else [rank, rank + WORLD]


def _modules(ids: list[int], meter) -> list[nn.Module]:
    # Later stages wider: stage s holds 32 (1 + 2s) activation columns per row.
    return [Metered(Block(32 * (1 + 2 * s), seed=s), meter) for s in ids]


def _measure(run_step, meter) -> int:
    run_step()  # warm-up: torch infers shapes, rrfp measures sizes
    meter.active, meter.current, meter.peak = True, 0, 0
    run_step()
    meter.active = False
    return meter.peak


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage, schedules

    from benchmarks.harness import ActivationMeter
    import rrfp

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)
    peaks = {}
    for name, (V, placement) in SCHEDULES.items():
        n_stages = WORLD * V
        ids = _stage_ids(rank, V, placement)
        first, last = 0 in ids, n_stages - 1 in ids
        meter = ActivationMeter()
        loss_fn = meter.metered(F.mse_loss)
        mods = _modules(ids, meter)
        stages = [TorchStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(mods, ids)]
        cls = getattr(schedules, name)
        sched = cls(stages if V > 1 or name == "ScheduleInterleavedZeroBubble" else stages[0], n_microbatches=M,
                    loss_fn=loss_fn)
        torch_peak = _measure(lambda: sched.step(*((x,) if first else ()), **({"target": y} if last else {})), meter)
        dist.barrier()
        meter = ActivationMeter()
        loss_fn = meter.metered(F.mse_loss)
        mods = _modules(ids, meter)
        slow = (lambda step, r, task: SLOW_BACKWARD_S if r == WORLD - 1 and task.kind != "F" else 0.0)
        with rrfp.Pipeline([rrfp.PipelineStage(m, s, n_stages) for m, s in zip(mods, ids)], M, loss_fn,
                           hint=cls, placement=placement, task_delay=slow, watchdog=120, job=f"mem-{name}") as pipe:
            rrfp_peak = _measure(lambda: pipe.step(*((x,) if first else ()), **({"target": y} if last else {})),
                                 meter)
        peaks[name] = (torch_peak, rrfp_peak)
        dist.barrier()
    torch.save(peaks, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hintmem")
    assert run_ranks(_rank_main, WORLD, str(out), timeout_s=600) == [0] * WORLD
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_torch_schedule_as_hint_holds_at_most_its_own_activation_bytes_on_every_rank(peaks, name):
    for rank, by_name in enumerate(peaks):
        torch_peak, rrfp_peak = by_name[name]
        assert torch_peak > 0
        assert rrfp_peak <= torch_peak, f"rank {rank}: rrfp {rrfp_peak} B > torch {torch_peak} B"
