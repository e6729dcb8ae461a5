"""The front doors' silent cases and shared construction: gradient-reducing wrappers nested
inside a stage refused, a torch schedule used as a hint held to that schedule's memory, an
error one rank finds at construction reported by every rank, ``layout=`` as a DeviceMesh, and
``Pipeline``/``LocalPipeline`` built from one :class:`RuntimeConfig`."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, Schedule1F1B

import rrfp
from handover import rank_env, run_ranks
from rrfp.parallel.mesh import mesh_grid
from rrfp.runtime.doors.config import RuntimeConfig, plan
from reference import sequential_reference

RTOL, ATOL = 1e-5, 1e-6


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo world (DDP and FSDP refuse to wrap without one)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _wrapped(kind: str) -> nn.Module:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return Wrapper(Wrapper(DistributedDataParallel(layer)))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return Wrapper(FullyShardedDataParallel(layer, device_id=torch.device("cpu")))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(layer[0], mesh=init_device_mesh("cpu", (1,)))
    return Wrapper(layer)


@pytest.mark.parametrize("kind,label,path", [
    ("ddp", "DistributedDataParallel", "'inner.inner'"),
    ("fsdp1", "FullyShardedDataParallel", "'inner'"),
])
def test_a_reducing_wrapper_anywhere_inside_a_stage_is_refused_naming_its_path(one_rank_group, kind, label, path):
    module = _wrapped(kind)
    with pytest.raises(ValueError) as e:
        rrfp.PipelineStage(module, 1, 2)
    msg = str(e.value)
    assert "\n" not in msg and label in msg and path in msg and msg.startswith("stage 1's module"), msg
    with pytest.raises(ValueError, match=label):
        rrfp.LocalPipeline([nn.Linear(4, 4), module], 2, F.mse_loss)


def test_an_fsdp2_stage_is_accepted_by_pipeline_stage_and_refused_by_local_pipeline(one_rank_group):
    # Pipeline drives fully_shard stages over its DP layout (tests/test_parallel_fsdp.py); one
    # process has no DP peers to shard over.
    module = _wrapped("fsdp2")
    assert rrfp.PipelineStage(module, 1, 2).submod is module
    with pytest.raises(ValueError) as e:
        rrfp.LocalPipeline([nn.Linear(4, 4), module], 2, F.mse_loss)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("stage 1's module is sharded with fully_shard (FSDP2)"), msg


def test_moving_a_sharded_stage_where_it_is_keeps_its_tp_marks(one_rank_group):
    """``rrfp train --tp 2 --dp 2 --dp-shard full`` printed grad norm 3.0278 against 3.1498 for
    --dp-shard none (and clipped by it): the runtime's ``.to(device)`` gave every FSDP2
    parameter a new object without its ``_rrfp_tp_shard`` mark, so TP shards were counted on
    TP rank 0 only. A move to where the stage already is must leave its parameters alone."""
    from rrfp.parallel.clip import counted
    from rrfp.runtime.doors.front import move_module

    module = _wrapped("fsdp2")
    module.inner[0].weight._rrfp_tp_shard = True
    before = [id(p) for p in module.parameters()]
    move_module(module, torch.device("cpu"))
    assert [id(p) for p in module.parameters()] == before
    assert module.inner[0].weight._rrfp_tp_shard

    class TP1:  # a rank with TP rank 1, DP 1: counts only the TP shards
        dp_rank, dp, tp_rank = 0, 1, 1
    assert counted(module.inner[0].weight, TP1()) and not counted(module.inner[0].bias, TP1())


@pytest.mark.parametrize("hint", [Schedule1F1B, "1F1B", "Schedule1F1B", "1f1b"])
def test_a_torch_schedule_as_hint_keeps_its_peak_in_flight(hint):
    # 1F1B on 4 ranks holds p - r microbatches (hand-computed: rank r runs p - r warm-up
    # forwards before its first backward); GPipe's memory, [8, 7, 5, 2] here, is what a
    # schedule hint held before.
    torch.manual_seed(0)
    mods = [nn.Linear(8, 8) for _ in range(4)]
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    with rrfp.LocalPipeline(mods, 8, F.mse_loss, hint=hint) as pipe:
        pipe.step(x, target=y)
        assert [s.peak_inflight for s in pipe.last_stats] == [4, 3, 2, 1]


def test_the_schedules_limits_give_way_to_the_users_limit_or_budget():
    assert plan(RuntimeConfig(hint=Schedule1F1B), 4, 1, 8).limits == [4, 3, 2, 1]
    assert plan(RuntimeConfig(hint=ScheduleGPipe), 4, 1, 8).limits == [8] * 4
    assert plan(RuntimeConfig(hint="1F1B", inflight_limit=6), 4, 1, 8).limits == [6] * 4
    assert plan(RuntimeConfig(hint="1F1B", memory_budget="1MiB"), 4, 1, 8).limits == [32] * 4
    assert plan(RuntimeConfig(hint="bf"), 4, 1, 8).limits == [32] * 4  # a policy has no schedule to copy
    assert plan(RuntimeConfig(hint="strict-1f1b"), 4, 1, 8).limits == [32] * 4  # strict follows the order itself


def _reference(modules, x, y):
    _, loss, grads = sequential_reference(modules, x, y)
    return loss, grads


def test_local_pipeline_takes_a_runtime_config_and_returns_as_pipeline():
    torch.manual_seed(1)
    mods = [nn.Linear(6, 6) for _ in range(2)]
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    ref_loss, ref_grads = _reference(mods, x, y)
    config = rrfp.RuntimeConfig(hint="bfw", inflight_limit=2)
    with rrfp.LocalPipeline(mods, 4, F.mse_loss, config=config, watchdog=30) as pipe:
        assert pipe.config.watchdog == 30 and pipe.config.hint == "bfw"
        loss = pipe.step(x, target=y)
        assert isinstance(pipe.last_loss, float)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss, rtol=RTOL, atol=ATOL)
    for m, grads in zip(mods, ref_grads):
        for p, g in zip(m.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)
    assert rrfp.RuntimeConfig().watchdog == 300.0  # one default for both doors
    with pytest.raises(TypeError, match="unknown option 'inflight'"):
        rrfp.LocalPipeline(mods, 4, F.mse_loss, inflight=3)


def test_local_astep_and_abort():
    torch.manual_seed(2)
    mods = [nn.Linear(6, 6) for _ in range(2)]
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    ref_loss, _ = _reference(mods, x, y)
    pipe = rrfp.LocalPipeline(mods, 4, F.mse_loss)
    loss = pipe.run(pipe.astep(x, target=y))
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    pipe.abort()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(x, target=y)


def test_local_tied_copies_get_the_summed_gradient():
    # Stage 0 and stage 1 each hold a copy of one weight: with tied=, both copies end with
    # the gradient of the one shared weight (the reference: one module using it twice).
    torch.manual_seed(3)
    w = torch.randn(5, 5)
    a, b = nn.Linear(5, 5, bias=False), nn.Linear(5, 5, bias=False)
    with torch.no_grad():
        a.weight.copy_(w)
        b.weight.copy_(w)
    shared = nn.Parameter(w.clone())
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    F.mse_loss(F.linear(F.linear(x, shared), shared), y).backward()
    with rrfp.LocalPipeline([a, b], 2, F.mse_loss, tied={"w": {0: "weight", -1: "weight"}}) as pipe:
        pipe.step(x, target=y)
    torch.testing.assert_close(a.weight.grad, shared.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(b.weight.grad, shared.grad, rtol=RTOL, atol=ATOL)


def test_a_mesh_in_any_dimension_order_maps_coordinates_to_its_ranks():
    ranks = torch.arange(8).reshape(2, 2, 2)  # dims (dp, tp, pp)
    grid = mesh_grid(("dp", "tp", "pp"), ranks)
    for d in range(2):
        for t in range(2):
            for p in range(2):
                assert grid[p][d][t] == int(ranks[d, t, p])
    assert mesh_grid(("pp",), torch.arange(3)) == [[[0]], [[1]], [[2]]]
    with pytest.raises(ValueError, match="'cp'"):
        mesh_grid(("pp", "cp"), ranks[0])


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    from rrfp.parallel.bootstrap import init_distributed

    init_distributed()
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(4)]
    # V-style stages (rank 0: 0 and 3) without placement="v": every rank must say so.
    mine = [0, 3] if rank == 0 else [1, 2]
    try:
        rrfp.Pipeline([rrfp.PipelineStage(mods[s], s, 4) for s in mine], 2, F.mse_loss, watchdog=60)
        error = None
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        error = f"{type(e).__name__}: {e}"
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    two = [nn.Sequential(mods[0], mods[1]), nn.Sequential(mods[2], mods[3])]
    with rrfp.Pipeline(rrfp.PipelineStage(two[rank], rank, world), 2, F.mse_loss, layout=mesh, watchdog=60) as pipe:
        pipe.step(x if rank == 0 else None, target=y if rank == world - 1 else None)
        loss = pipe.last_loss
    torch.save({"error": error, "loss": loss, "grads": [p.grad for p in two[rank].parameters()]}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_rank_reports_the_construction_error_and_a_device_mesh_is_a_layout(tmp_path):
    world = 2
    assert run_ranks(_rank_main, world, str(tmp_path), timeout_s=880) == [0] * world
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    errors = [p["error"] for p in parts]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError: rank ") and "placement='v'" in errors[0], errors
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(4)]
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    ref_loss, ref_grads = _reference(mods, x, y)
    torch.testing.assert_close(torch.tensor(parts[1]["loss"]), ref_loss, rtol=RTOL, atol=ATOL)
    got = parts[0]["grads"] + parts[1]["grads"]
    for g, want in zip(got, [g for grads in ref_grads for g in grads]):
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL)


def test_the_package_exports_what_the_readme_uses():
    for name in ("Pipeline", "LocalPipeline", "PipelineStage", "ParallelLayout", "StepHooks", "RuntimeConfig",
                 "PipelineError", "WatchdogTimeout", "PeerLost"):
        assert name in rrfp.__all__ and getattr(rrfp, name).__name__ == name


class _Broken(nn.Module):
    def forward(self, x):
        raise ValueError("the user's own bug")


@pytest.mark.parametrize("transport", [None, "fake-plane"])
def test_a_users_error_in_local_pipeline_is_the_only_thing_said(caplog, transport):
    """A stage's own exception reaches the caller as it was raised, and the ranks of the one
    process, aborted together, log no "rank 0 lost" for each other before it."""
    caplog.set_level("WARNING", logger="rrfp")
    with pytest.raises(ValueError, match="^the user's own bug$"):
        with rrfp.LocalPipeline([nn.Linear(2, 2), _Broken()], 2, lambda y, t: F.mse_loss(y, t),
                                transport=transport) as pipe:
            pipe.step(torch.ones(4, 2), target=torch.ones(4, 2))
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []


class _Interrupted(nn.Module):
    """Ctrl-C arriving while this stage's forward runs."""

    def forward(self, x):
        raise KeyboardInterrupt


def test_ctrl_c_in_a_step_leaves_no_task_of_the_pipeline_pending():
    """A KeyboardInterrupt leaves the event loop at once, the other ranks' step tasks still
    pending; the ``with`` block's abort ends them before closing the loop, so none is
    destroyed pending (asyncio's "Task was destroyed but it is pending!") once collected."""
    said = []
    pipe = rrfp.LocalPipeline([nn.Linear(2, 2), _Interrupted()], 2, lambda y, t: F.mse_loss(y, t), hint="1f1b")
    loop = pipe._loop
    loop.set_exception_handler(lambda _loop, context: said.append(context["message"]))
    with pytest.raises(KeyboardInterrupt):
        with pipe:
            pipe.step(torch.ones(4, 2), target=torch.ones(4, 2))
    assert loop.is_closed()
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    del pipe
    gc.collect()
    assert said == []


def test_a_close_that_fails_part_way_leaves_no_task_pending():
    """One transport's close raises while another's is still waiting: the error reaches the
    caller, and the waiting close is ended before the loop closes, not destroyed pending."""
    said = []
    pipe = rrfp.LocalPipeline([nn.Linear(2, 2), nn.Linear(2, 2)], 2, lambda y, t: F.mse_loss(y, t), hint="1f1b")
    loop = pipe._loop
    loop.set_exception_handler(lambda _loop, context: said.append(context["message"]))
    pipe.step(torch.ones(4, 2), target=torch.ones(4, 2))

    async def fails():
        raise RuntimeError("close failed")

    async def waits():
        await asyncio.Event().wait()

    pipe._transports[0].close, pipe._transports[1].close = fails, waits
    with pytest.raises(RuntimeError, match="^close failed$"):
        pipe.close()
    assert loop.is_closed()
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    del pipe
    gc.collect()
    assert said == []


def _one_rank_pipeline(mod, m, **options):
    from rrfp.transport.fake import FakeNetwork

    return rrfp.Pipeline(rrfp.PipelineStage(mod, 0, 1), m, F.mse_loss, rank=0, n_ranks=1,
                         transport=FakeNetwork(1).transport(0), **options)


@pytest.mark.parametrize("door", ["local", "pipeline"])
def test_a_target_batch_of_4_rows_for_16_inputs_is_refused_in_one_line(door):
    """The field trial's case: 16 input rows and 4 target rows in 4 microbatches trained on
    main, the loss broadcasting one target row over each microbatch's 4 outputs. Refused
    before anything runs: no gradient appears."""
    torch.manual_seed(4)
    mods = [nn.Linear(3, 3), nn.Linear(3, 3)]
    x, y = torch.randn(16, 3), torch.randn(4, 3)
    pipe = rrfp.LocalPipeline(mods, 4, F.mse_loss) if door == "local" else \
        _one_rank_pipeline(nn.Sequential(*mods), 4)
    with pipe:
        with pytest.raises(ValueError) as e:
            pipe.step(x, target=y)
        with pytest.raises(ValueError) as pre:  # pre-split: one target per microbatch
            pipe.step(microbatches=[(a,) for a in x.split(4)], targets=list(y.split(1)))
        pipe.step(x, target=torch.randn(16, 3))  # the right target still trains
    assert str(e.value) == ("target batch of 4 rows != input batch of 16 rows (input 0): "
                            "expected one target row per input sample")
    assert str(pre.value) == ("microbatch 0: target batch of 1 rows != input batch of 4 rows (input 0): "
                              "expected one target row per input sample")


def test_a_target_matches_the_inputs_along_their_split_dimension():
    """A sequence-first input ``[T, B, H]`` split along dim 1 (``args_chunk_spec``) has B rows;
    the target, split along dim 0 as PyTorch's schedules do, has B too: accepted."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x).sum(0)  # [T, b, H] -> [b, H]

    x, y = torch.randn(5, 8, 3), torch.randn(8, 3)
    with rrfp.LocalPipeline([SeqFirst()], 2, F.mse_loss, args_chunk_spec=(TensorChunkSpec(1),)) as pipe:
        loss = pipe.step(x, target=y)
    torch.testing.assert_close(loss, F.mse_loss(pipe.modules[0](x), y).detach(), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match=r"^target batch of 5 rows != input batch of 8 rows"):
        with rrfp.LocalPipeline([SeqFirst()], 2, F.mse_loss, args_chunk_spec=(TensorChunkSpec(1),)) as pipe:
            pipe.step(x, target=torch.randn(5, 3))
