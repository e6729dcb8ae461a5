"""Shared pytest setup: asyncio tests run under uvloop, as the runtime does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def pytest_asyncio_loop_factories(config, item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}
