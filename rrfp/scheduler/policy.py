"""Policies: which ready task a rank runs next, by name (RRFP §4, App. A).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations


def placement_schedule(n_virtual: int, kind: str = "loop") -> str | None:
    """The fixed order a placement has (:data:`~rrfp.scheduler.schedules.SCHEDULES` name):
    ``1f1b`` with one stage per rank, ``interleaved-1f1b`` for the ``loop`` placement with
    virtual stages, ``zb-v`` for the ``v`` placement with two; None otherwise."""
    if n_virtual == 1:
        return "1f1b"
    if kind == "loop":
        return "interleaved-1f1b"
    return "zb-v" if n_virtual == 2 else None
