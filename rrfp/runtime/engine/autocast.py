"""The caller's ``torch.autocast``, carried to the thread a task runs on.

Autocast state is thread-local: an ``with torch.autocast(...)`` around ``Pipeline.step()`` holds
on the thread that called ``step()``, where the inline and CUDA executors run their tasks, but
not on :class:`~rrfp.runtime.engine.executor.ThreadExecutor`'s worker. That executor takes the
state at each launch, on the loop thread inside ``step()``, with :func:`capture`, and re-enters
it around the task on its worker, so every executor computes under the caller's autocast
(as torch's own autograd engine carries it to its worker threads).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DEVICE_TYPES = ("cpu", "cuda")
"""The device types whose autocast is carried (the ones rrfp's stages compute on)."""


@dataclass(frozen=True)
class AutocastState:
    """The autocast modes on at a point of one thread: ``(device type, dtype)`` per enabled
    device type, and whether autocast's weight cache is on."""

    modes: tuple[tuple[str, torch.dtype], ...]
    cache: bool


def capture() -> AutocastState | None:
    """This thread's autocast state, or None when autocast is off for every device type of
    :data:`DEVICE_TYPES` (the common case: nothing to re-enter)."""
    modes = tuple((d, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES if torch.is_autocast_enabled(d))
    return AutocastState(modes, torch.is_autocast_cache_enabled()) if modes else None


def entered(state: AutocastState | None) -> contextlib.AbstractContextManager:
    """A context that runs its body under ``state`` on this thread (``torch.autocast`` per
    mode; None: nothing changes); on exit the thread's own autocast state is back."""
    stack = contextlib.ExitStack()
    for device_type, dtype in state.modes if state is not None else ():
        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=state.cache))
    return stack
