"""The benchmarks' activation meter and rrfp's memory budget count the same bytes: a budget set
from a PyTorch schedule's measured peak, or from ``saved_bytes`` for 1F1B's and GPipe's orders,
holds exactly the microbatches it should in rrfp's ledger."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import ActivationMeter, Injector, JitterStage  # noqa: E402
from benchmarks.settings import setting_config  # noqa: E402
from benchmarks.workloads import MessageDelays, MultimodalWorkload, TextWorkload, saved_bytes  # noqa: E402
from rrfp.model.gpt import lm_loss  # noqa: E402
from rrfp.runtime.engine.memory import ForwardSizer  # noqa: E402
from rrfp.sim.jitter import LEVELS  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["jitter4", "comm4", "multimodal4"])
def test_meter_counts_what_rrfps_budget_counts(setting):
    """Every rank's stage runs all its microbatches' forwards (and the last stage its loss) as
    rrfp's compute does, under the runtime's ForwardSizer with the meter active: the meter's
    peak (all microbatches held) equals the sum of what the ledger charges them, and
    ``saved_bytes`` (the 1F1B/GPipe budget conversion) equals each microbatch's charge."""
    cfg = setting_config(setting, quick=True)
    P = cfg["n_ranks"]
    work_cls = MultimodalWorkload if cfg.get("workload") == "multimodal" else TextWorkload
    for rank in (0, P - 1):  # the middle ranks' stages are like the first's but for the input
        work = work_cls(cfg, rank, P)
        base = work.stage(P, rank)
        plain = work.batch(2, False)
        batch = plain.with_stamps() if cfg.get("comm") else plain
        injector = Injector(LEVELS["J0"], 0, rank, {"F": 0.0, "B": 0.0})
        injector.enabled = False
        meter = ActivationMeter()
        meter.exclude(list(base.parameters()))
        meter.active = True
        last = rank == P - 1
        delays = MessageDelays(LEVELS[cfg["comm"]], injector) if cfg.get("comm") else None
        stage = JitterStage(base, injector, 1.0, meter, last=last, stage=rank, delays=delays)
        loss_fn = meter.metered(lm_loss)
        sizer = ForwardSizer({rank: stage}, rank)
        sizer.begin_step({})
        held, charged = [], []
        stage_inputs = work.stage_inputs(plain)
        for m, (mb, target) in enumerate(zip(batch.rrfp_mbs, batch.rrfp_targets)):
            # The rank's input as it arrives: stage 0 the microbatch itself, later stages a
            # received hidden state (and the microbatch id, and the stamp under message delays).
            inputs = tuple(mb) if rank == 0 else (stage_inputs[m][0], *mb[-2 if delays else -1:])
            with sizer.measure(rank, m, inputs), torch.enable_grad():
                out = stage(*inputs)
                if last:
                    out = loss_fn(out, target)
            held.append(out)
            charged.append(sizer(rank, m))
            x = stage_inputs[m]
            assert saved_bytes(base, x, target if last else None) == charged[-1], (setting, rank, m)
        assert meter.peak == sum(charged), (setting, rank, meter.peak, charged)
        assert meter.peak > 0
