"""Shared pytest setup: asyncio tests run under uvloop, as the runtime does, except those marked
``virtual_time``, which run on simulated time (tests/virtual_time.py): their timeouts expire
only when nothing is left to do before them, never because the machine is loaded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "virtual_time: run this asyncio test on simulated time (tests/virtual_time.py)")


def pytest_asyncio_loop_factories(config, item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("virtual_time") is not None:
        from virtual_time import VirtualTimeLoop

        return {"virtual-time": VirtualTimeLoop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def pp2_run(tmp_path_factory):
    """One uninterrupted ``rrfp train --stages 2 --steps 6`` (tests/runs.py's flags) with a
    checkpoint every 2 steps: ``(its per-step losses, its checkpoint folder)``. The reference
    of the resume tests (test_ckpt_layouts) and of the DP/TP loss curves (test_parallel_layouts),
    launched once for both."""
    from runs import losses, train

    d = tmp_path_factory.mktemp("pp2")
    train("--stages", "2", "--steps", "6", "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2",
          "--loss-file", str(d / "losses"))
    return losses(d / "losses"), d / "ck"


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a command would start a process (``rrfp train``'s launcher, or torch's
    elastic agent under ``rrfp node``)."""
    def refuse(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr("rrfp.train.cli.launch", refuse)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", refuse)
