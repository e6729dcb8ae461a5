"""Whether this process is a rank of a launched job: torchrun / torch.distributed.run (or
Kubernetes) sets the ``env://`` variables. Torch-free, so that ``rrfp train`` can tell the
launcher from a rank while it checks its flags, before torch is imported."""

from __future__ import annotations

import os

REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def in_launched_worker() -> bool:
    """True inside a process started by torchrun / torch.distributed.run (or with its env)."""
    return all(k in os.environ for k in REQUIRED_ENV)
