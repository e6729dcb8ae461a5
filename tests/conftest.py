"""Shared pytest setup: asyncio tests run under uvloop, as the runtime does, except those marked
``virtual_time``, which run on simulated time (tests/virtual_time.py): their timeouts expire
only when nothing is left to do before them, never because the machine is loaded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


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
