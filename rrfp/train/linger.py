"""``rrfp train --metrics-linger``: after training, every rank keeps serving its final metrics,
and a SIGTERM (or Ctrl-C) then ends the wait early with exit code 0, since training finished.

torch's agent (the launcher) answers SIGTERM by stopping its ranks and re-raising the signal,
whatever the ranks were doing, so the launcher alone cannot tell a stop during training from
one during the linger. Each rank therefore leaves a mark in a folder the launcher names
(:data:`FINISHED_ENV`) once its training is over, and the launcher exits 0 on a signal when
every rank left one.
"""

from __future__ import annotations

import os
from pathlib import Path

FINISHED_ENV = "RRFP_TRAIN_FINISHED_DIR"
"""Set by the ``rrfp train`` launcher in its ranks' environment: the folder of their marks."""


def mark_finished(rank: int) -> bool:
    """Mark this rank's training over (call before its linger). False, and nothing marked, when
    not started by the ``rrfp train`` launcher (plain torchrun, ``rrfp node``)."""
    folder = os.environ.get(FINISHED_ENV)
    if folder:
        (Path(folder) / f"rank-{rank}").touch()
    return bool(folder)


def all_finished(folder: str | os.PathLike, world_size: int) -> bool:
    """Whether all ``world_size`` ranks marked their training finished in ``folder``."""
    return all((Path(folder) / f"rank-{r}").exists() for r in range(world_size))
