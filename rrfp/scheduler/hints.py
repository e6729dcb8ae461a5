"""Hints: a rank's ordered preference over its ready tasks (RRFP §4, App. A).

A hint is either a *policy* (``bf``, ``bfw``, ``fb``, ``b-priority``, ``f-priority``), which
ranks whatever is ready by kind, or a *total order* per rank compiled from a named schedule
(``gpipe``, ``1f1b``) or given by the user. Any hint runs in readiness mode (dispatch the
best-ranked ready task, skip unready ones) or, prefixed ``strict-``, in strict mode (the
fixed-order baseline: run only the order's next task, waiting for it).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import SCHEDULES, Order
from .tasks import PipelineSpec, Placement

POLICIES = {
    # name: (first preferred kind when both are ready, alternate?, split backward?)
    "bf": ("B", True, False),
    "fb": ("F", True, False),
    "bfw": ("B", False, True),
    "b-priority": ("B", False, False),
    "f-priority": ("F", False, False),
}
HINT_NAMES = tuple(POLICIES) + tuple(SCHEDULES)


@dataclass(frozen=True)
class Hint:
    """A resolved hint.

    Attributes:
        name: the hint's name as the user gave it, without ``strict-``.
        first: for a policy, the kind preferred when both ``F`` and ``B`` are ready first.
        alternate: for a policy, whether it alternates (BF/FB rounds) or is a fixed priority.
        order: for a total-order hint, the per-rank order; None for a policy.
    """

    name: str
    first: str = "B"
    alternate: bool = True
    order: Order | None = field(default=None, compare=False)

    @property
    def is_policy(self) -> bool:
        return self.order is None


def resolve_hint(
    text: str,
    placement: Placement,
    n_microbatches: int,
    split_backward: bool | None = None,
) -> tuple[PipelineSpec, Hint, bool]:
    """Turn a hint name (``"bf"``, ``"strict-1f1b"``, ...) into ``(spec, hint, strict)``.

    ``split_backward`` defaults to what the hint implies (``bfw`` splits, others do not).

    Raises:
        ValueError: one line naming an unknown hint and listing the known ones, or a policy
            hint asked for in strict mode.
    """
    strict = text.startswith("strict-")
    name = text[len("strict-"):] if strict else text
    if name in POLICIES:
        if strict:
            raise ValueError(
                f"hint {text!r}: strict mode needs a total order, not the policy {name!r}; "
                f"use one of {', '.join('strict-' + s for s in SCHEDULES)}"
            )
        first, alternate, split = POLICIES[name]
        spec = PipelineSpec(placement, n_microbatches, split if split_backward is None else split_backward)
        return spec, Hint(name, first, alternate), False
    if name in SCHEDULES:
        spec = PipelineSpec(placement, n_microbatches, bool(split_backward))
        return spec, Hint(name, order=SCHEDULES[name](spec)), strict
    known = ", ".join(list(POLICIES) + [f"{s}, strict-{s}" for s in SCHEDULES])
    raise ValueError(f"unknown hint {text!r}: expected one of {known}")
