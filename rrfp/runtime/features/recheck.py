"""How often ``auto`` re-checks its choice: the default, the check of a value and the reading of
``rrfp train --auto-recheck``. Torch-free, so ``rrfp train`` checks its flags before torch loads
(the controller is :mod:`rrfp.runtime.features.auto`)."""

from __future__ import annotations

from typing import Any

RECHECK_EVERY = 50
"""Steps between re-checks (the default of ``RuntimeConfig.auto_recheck`` and ``rrfp train
--auto-recheck``): one more trial round (three steps) per 50, about 6% of steps run a
candidate other than the kept one, most of them within a few percent of it."""


def check_recheck(every: Any) -> int:
    """``every`` as steps between ``auto``'s re-checks.

    Raises:
        ValueError: not an integer >= 0 (one line naming it; 0 turns re-checks off).
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"auto_recheck={every!r}: expected steps between auto's re-checks, an integer >= 0 "
                         "(0: never)")
    return every


def recheck_steps(text: Any) -> int:
    """``rrfp train --auto-recheck`` (or its TOML key) as steps between re-checks: ``off``
    or ``0`` turns them off; None (not given): :data:`RECHECK_EVERY`.

    Raises:
        ValueError: neither ``off`` nor an integer >= 0 (one line).
    """
    if text is None:
        return RECHECK_EVERY
    word = str(text).strip().lower()
    if word == "off":
        return 0
    if not (word.isascii() and word.isdigit()):
        raise ValueError("expected steps between re-checks (an integer >= 0) or off")
    return int(word)
