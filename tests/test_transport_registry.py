"""The transport registry (rrfp/transport/registry.py): one table of names that ``rrfp train
--transport``, ``parallel/bootstrap.py``'s ``default_transport`` (``Pipeline(transport=)``) and
``LocalPipeline(transport=)`` read, names registered from outside (a call, or a package's entry
point) included. The conformance suite over every name is tests/test_transport_conformance.py."""

from __future__ import annotations

import argparse
import sys

import pytest

import memory_transport
from rrfp.transport import registry
from rrfp.transport.registry import LocalContext, LocalGroup, ProcessContext, TransportEntry


@pytest.fixture
def clean_registry():
    """Whatever a test registers is gone afterwards."""
    before = dict(registry._TABLE)
    yield
    registry._TABLE.clear()
    registry._TABLE.update(before)


def test_the_built_in_names_and_where_each_runs():
    assert registry.names() == ("zmq", "torch", "fake", "fake-plane", "fake-nccl")
    assert registry.names(registry.PROCESS) == ("zmq", "torch")
    assert registry.names(registry.LOCAL) == ("fake", "fake-plane", "fake-nccl")


def test_registering_checks_its_input_and_unregistering_restores_a_built_in(clean_registry):
    entry = memory_transport.ENTRY
    with pytest.raises(ValueError, match=r"^transport name 'Bad Name': expected lowercase"):
        registry.register("Bad Name", entry)
    with pytest.raises(TypeError, match="^transport 'x': expected a TransportEntry, got function$"):
        registry.register("x", memory_transport.build)
    with pytest.raises(ValueError, match="^transport 'x': the entry has no builder"):
        registry.register("x", TransportEntry("nothing"))
    with pytest.raises(ValueError, match=r"^transport 'fake' is already registered \(pass replace=True"):
        registry.register("fake", entry)
    registry.register("fake", entry, replace=True)
    assert registry.get("fake") is entry
    registry.unregister("fake")
    assert registry.get("fake") is registry.BUILTIN["fake"]
    registry.register("x", entry)
    assert registry.names(registry.LOCAL)[-1] == "x" and "x" not in registry.names(registry.PROCESS)
    registry.unregister("x")
    with pytest.raises(ValueError, match="^unknown transport 'x': expected one of zmq, torch, fake"):
        registry.get("x")
    with pytest.raises(ValueError, match="^transport 'x' is not registered$"):
        registry.unregister("x")


def test_a_builder_that_breaks_the_contract_is_named(clean_registry):
    def two_ranks(ctx: LocalContext) -> LocalGroup:
        return memory_transport.build(LocalContext(2))

    registry.register("short", TransportEntry("builds 2 whatever is asked", local=two_ranks))
    with pytest.raises(TypeError, match="^transport 'short': the local builder returned LocalGroup, expected a "
                                        "LocalGroup of 3 transports$"):
        registry.build_local("short", LocalContext(3))
    registry.register("wrong-rank", TransportEntry("always rank 0", rank=lambda ctx: two_ranks(ctx).transports[0]))
    with pytest.raises(TypeError, match="^transport 'wrong-rank': the builder returned .*, expected a Transport "
                                        "of rank 1 of 2$"):
        registry.build_rank("wrong-rank", ProcessContext(1, 2, "j", store=None))


def _one_rank_memory(ctx: ProcessContext):
    seen.append(ctx)
    return memory_transport.build(LocalContext(ctx.world_size, job=ctx.job)).transports[ctx.rank]


seen: list[ProcessContext] = []


def test_bootstrap_builds_a_registered_name_over_the_jobs_store(clean_registry, monkeypatch):
    """``default_transport`` (what ``Pipeline(transport=NAME)`` calls) builds any registered
    name that runs between processes, handing it the job's store and its process groups."""
    from rrfp.parallel import bootstrap

    store = object()
    joined = []
    monkeypatch.setattr(bootstrap, "init_distributed", lambda: joined.append(True))
    monkeypatch.setattr(bootstrap, "default_store", lambda: store)
    registry.register("mine", TransportEntry("one rank of memory", rank=_one_rank_memory))
    seen.clear()
    t = bootstrap.default_transport(0, 1, "job-a", "mine", device="cpu")
    assert isinstance(t, memory_transport.MemoryTransport) and t.job == "job-a" and joined == [True]
    (ctx,) = seen
    assert (ctx.rank, ctx.world_size, ctx.job, ctx.store, str(ctx.device)) == (0, 1, "job-a", store, "cpu")
    assert ctx.new_group is bootstrap._new_group


def _train_parser() -> argparse.ArgumentParser:
    from rrfp.train import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_a_packages_entry_point_is_listed_without_import_and_taken_by_rrfp_train(clean_registry, monkeypatch, tmp_path):
    """A package declaring ``[rrfp.transports] demo = module:ENTRY`` is seen by every process
    (``rrfp train``'s workers import nothing of the user's): its name is listed without
    importing it, ``rrfp train --transport demo`` parses, and the first use loads it."""
    (tmp_path / "rrfp_demo_transport.py").write_text(
        "import memory_transport\n"
        "from rrfp.transport.registry import TransportEntry\n"
        "ENTRY = TransportEntry('demo', rank=lambda ctx: None, local=memory_transport.build)\n")
    info = tmp_path / "rrfp_demo_transport-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rrfp-demo-transport\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rrfp.transports]\ndemo = rrfp_demo_transport:ENTRY\n")
    with pytest.raises(SystemExit):  # not declared yet: argparse refuses it
        _train_parser().parse_args(["train", "--transport", "demo"])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.names(registry.PROCESS)[-1] == "demo" and registry.names(registry.LOCAL)[-1] == "demo"
    assert "rrfp_demo_transport" not in sys.modules
    assert _train_parser().parse_args(["train", "--transport", "demo"]).transport == "demo"
    group = registry.build_local("demo", LocalContext(2, job="j"))
    assert "rrfp_demo_transport" in sys.modules
    assert [type(t).__name__ for t in group.transports] == ["MemoryTransport"] * 2
    assert registry.get("demo") is sys.modules["rrfp_demo_transport"].ENTRY
    monkeypatch.delitem(sys.modules, "rrfp_demo_transport")


def test_local_pipeline_takes_only_in_process_names():
    import torch.nn.functional as F
    from torch import nn

    import rrfp

    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="^transport 'zmq' does not run within one process: expected one of "
                                         "fake, fake-plane, fake-nccl$"):
        rrfp.LocalPipeline(mods, 2, F.mse_loss, transport="zmq")
    with pytest.raises(ValueError, match="^transport=<object .*>: LocalPipeline builds its ranks' transports by name"):
        rrfp.LocalPipeline(mods, 2, F.mse_loss, transport=object())
