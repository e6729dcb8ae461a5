"""What a hint is once resolved (:class:`Hint`) and which fixed order a placement has
(:func:`placement_schedule`), RRFP §4, App. A. The arbiter and the hint resolver
(:mod:`rrfp.scheduler.hints`) both read this module, so neither imports the other's user.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import Order


def placement_schedule(n_virtual: int, kind: str = "loop") -> str | None:
    """The fixed order a placement has (:data:`~rrfp.scheduler.schedules.SCHEDULES` name):
    ``1f1b`` with one stage per rank, ``interleaved-1f1b`` for the ``loop`` placement with
    virtual stages, ``zb-v`` for the ``v`` placement with two; None otherwise."""
    if n_virtual == 1:
        return "1f1b"
    if kind == "loop":
        return "interleaved-1f1b"
    return "zb-v" if n_virtual == 2 else None


@dataclass(frozen=True)
class Hint:
    """A resolved hint.

    Attributes:
        name: the hint's name as the user gave it, without ``strict-``.
        first: for a policy, the kind preferred when both ``F`` and ``B`` are ready first.
        alternate: for a policy, whether it alternates (BF/FB rounds) or is a fixed priority.
        order: for a total-order hint, the per-rank order; None for a policy.
        backpressure: what readiness mode does at the in-flight limit with virtual stages
            (:data:`BACKPRESSURE`); one stage per rank always disables forwards.
        depth_first: for a policy, prefer forwards on later virtual stages (:data:`DEPTH_FIRST`).
        free_first: for a policy under a memory budget, run a ready ``W`` first when the
            budget refuses a ready forward (:data:`FREE_FIRST`).
        backfill: strict order with conservative backfilling (:data:`BACKFILL`).
    """

    name: str
    first: str = "B"
    alternate: bool = True
    order: Order | None = field(default=None, compare=False)
    backpressure: str = "admission"
    depth_first: bool = False
    free_first: bool = False
    backfill: bool = False

    @property
    def is_policy(self) -> bool:
        return self.order is None
