"""Must-show of issue 14: four real processes with the ``torch`` data plane (gloo) equal the
single-process reference, loss and every gradient (fp32, rtol 1e-5, atol 1e-6).

One launch of 4 processes serves every configuration in turn: ``bf``, ``bfw`` and
``strict-interleaved-1f1b`` (PyTorch's 1F1B for virtual stages; plain ``1f1b`` takes one
virtual stage) with 2 virtual stages per rank, plus ``strict-1f1b`` with one. Each microbatch
has its own sequence length, and every stage boundary carries mixed dtypes: the float
activation ``x [B, T, d]`` with ``ids`` int64 ``[B, T]``, ``mask`` bool ``[B, T]`` and
``scale`` float32 ``[B, T]`` (rrfp.model.toy's layers, applied per position).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handover import process
from reference import reference_run
from rrfp.model.toy import ToyConfig, ToyModel

pytestmark = pytest.mark.slow

WORLD = 4
CFG = ToyConfig(d=8, vocab_size=16, n_layer=8, n_out=5)
M = 4
B = 2
CONFIGS = [("bf", 2), ("bfw", 2), ("strict-interleaved-1f1b", 2), ("strict-1f1b", 1)]


class SeqStage(nn.Module):
    """Layers ``layers`` of a ToyModel (plus its head on the last stage) over ``[B, T]``
    positions: ``(x, ids, mask, scale) -> (x, ids, mask, scale)`` or scores ``[B, T, n_out]``."""

    def __init__(self, model: ToyModel, layers: range, last: bool) -> None:
        super().__init__()
        import copy

        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in layers)
        self.head = copy.deepcopy(model.head) if last else None
        self.names = {n: _full(n, layers.start) for n, _ in self.named_parameters()}

    def forward(self, x, ids, mask, scale):
        io = (x, ids, mask, scale)
        for layer in self.layers:
            io = layer(io)
        return self.head(io[0]) if self.head is not None else io


def _full(name: str, first: int) -> str:
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"layers.{first + int(i)}.{rest}"
    return name


def seq_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def microbatches() -> tuple[list[tuple], list[torch.Tensor]]:
    """M microbatches of B samples, microbatch m of length 3 + 2m."""
    g = torch.Generator().manual_seed(11)
    mbs, tgts = [], []
    for m in range(M):
        t = 3 + 2 * m
        mbs.append((
            torch.randn(B, t, CFG.d, generator=g),
            torch.randint(0, CFG.vocab_size, (B, t), generator=g),
            torch.rand(B, t, generator=g) < 0.5,
            torch.rand(B, t, generator=g) + 0.5,
        ))
        tgts.append(torch.randint(0, CFG.n_out, (B, t), generator=g))
    return mbs, tgts


def stages_of(model: ToyModel, n_stages: int) -> list[SeqStage]:
    per = CFG.n_layer // n_stages
    return [SeqStage(model, range(s * per, (s + 1) * per), s == n_stages - 1) for s in range(n_stages)]


def _rank_main(rank: int, port: int, out: str) -> None:
    # The test process hosts the store (bound to port 0: no race for a free port), as torchrun's
    # agent does; every rank connects to it as a client.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    mbs, tgts = microbatches()
    results = {}
    for hint, n_virtual in CONFIGS:
        n_stages = WORLD * n_virtual
        mods = stages_of(ToyModel(CFG, seed=5), n_stages)
        mine = [s for s in range(n_stages) if s % WORLD == rank]  # loop placement
        pipe = Pipeline([PipelineStage(mods[s], s, n_stages) for s in mine], M, seq_loss, hint=hint,
                        transport="torch", job=f"must-{hint}", loss_weight_fn=lambda t: float(t.numel()),
                        watchdog=60)
        assert pipe.transport.data_plane == "torch"
        pipe.step(microbatches=mbs if 0 in mine else None, targets=tgts if n_stages - 1 in mine else None)
        loss = None if pipe.last_loss is None else torch.tensor(pipe.last_loss)
        pipe.close()
        grads = {mods[s].names[n]: p.grad for s in mine for n, p in mods[s].named_parameters()}
        results[hint] = {"loss": loss, "grads": grads}
    torch.save(results, f"{out}/rank{rank}.pt")


def _reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mbs, tgts = microbatches()
    total = sum(t.numel() for t in tgts)

    def loss_of(model):
        loss = torch.zeros(())
        for io, t in zip(mbs, tgts):
            x = io
            for layer in model.layers:
                x = layer(x)
            loss = loss + seq_loss(model.head(x[0]), t) * (t.numel() / total)
        return loss

    return reference_run(ToyModel(CFG, seed=5), loss_of)


@pytest.mark.timeout(120)
def test_torch_data_plane_4_processes_match_single_process_reference(tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [process(_rank_main, r, port, str(tmp_path)) for r in range(WORLD)]  # forks of the zygote (tests/handover.py)
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(100)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0] * WORLD
    ref_loss, ref_grads = _reference()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for hint, _ in CONFIGS:
        got = {}
        for part in parts:
            got.update(part[hint]["grads"])
        torch.testing.assert_close(parts[WORLD - 1][hint]["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        assert set(got) == set(ref_grads), hint
        for name, g in got.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{hint} {name}: {m}")
