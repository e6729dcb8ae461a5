"""PyTorch's schedule names and classes as rrfp hints. Torch-free, so that ``rrfp train``
checks a hint's name before it imports torch."""

from __future__ import annotations

from typing import Any

# torch.distributed.pipelining's schedule names (get_schedule_class is case-insensitive, and
# so is this) -> the rrfp hint that ranks ready work the same way.
TORCH_SCHEDULE_HINTS = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved-1f1b",
    "loopedbfs": "looped-bfs",
    "interleavedzerobubble": "zb-h1",
    "zbvzerobubble": "zb-v",
    "dualpipev": "dualpipev",
}


def hint_text(hint: Any) -> str:
    """rrfp hint text for ``hint``: an rrfp hint, a PyTorch schedule name (``Interleaved1F1B``,
    ``ScheduleZBVZeroBubble``, any case) or class (``Schedule1F1B``); ``strict-`` works with
    each.

    Raises:
        TypeError: ``hint`` is neither text nor a class.
    """
    if isinstance(hint, type):
        hint = hint.__name__
    if not isinstance(hint, str):
        raise TypeError(f"hint {hint!r}: expected a hint name or a PyTorch schedule class")
    prefix = "strict-" if hint.startswith("strict-") else ""
    base = hint[len(prefix):]
    key = base.lower()
    key = key[len("schedule"):] if key.startswith("schedule") else key
    return prefix + TORCH_SCHEDULE_HINTS.get(key, base)
