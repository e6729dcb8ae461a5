"""Hint text from what a front door is given: an rrfp hint, or PyTorch's schedule names and
classes (aliases in the hint table, :data:`rrfp.scheduler.registry.ALIASES`). Torch-free, so
that ``rrfp train`` checks a hint's name before it imports torch."""

from __future__ import annotations

from typing import Any

from ...scheduler.hints import unknown_hint
from ...scheduler.registry import canonical
from ...sim.auto import AUTO


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


def unknown_door_hint(text: str) -> str:
    """The one-line error for hint text no front door takes (``rrfp train``'s ``--hint``,
    ``Pipeline``'s and ``LocalPipeline``'s ``hint``): the scheduler's forms
    (:func:`~rrfp.scheduler.hints.unknown_hint`), or ``auto``, the front doors' own default."""
    return f"{unknown_hint(text)}, or {AUTO} (the default)"
