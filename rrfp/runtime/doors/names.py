"""Hint text from what a front door is given: an rrfp hint, or PyTorch's schedule names and
classes (aliases in the hint table, :data:`rrfp.scheduler.registry.ALIASES`). Torch-free, so
that ``rrfp train`` checks a hint's name before it imports torch."""

from __future__ import annotations

from typing import Any

from ...scheduler.registry import canonical


def hint_text(hint: Any) -> str:
    """rrfp hint text for ``hint``: an rrfp hint, a PyTorch schedule name (``Interleaved1F1B``,
    ``ScheduleZBVZeroBubble``, any case) or class (``Schedule1F1B``); ``strict-`` works with
    each (:func:`rrfp.scheduler.registry.canonical`).

    Raises:
        TypeError: ``hint`` is neither text nor a class.
    """
    if isinstance(hint, type):
        hint = hint.__name__
    if not isinstance(hint, str):
        raise TypeError(f"hint {hint!r}: expected a hint name or a PyTorch schedule class")
    return canonical(hint)
