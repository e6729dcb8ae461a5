"""Whole ``rrfp train`` runs as subprocesses, shared by the tests that compare one run with
another (test_ckpt_layouts, test_parallel_layouts): small deterministic flags, the losses
read back exactly from ``--loss-file``. Each run is under a timeout that bounds a hang only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SMALL = ["--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1", "--deterministic", "--quiet"]


def train(*flags: str) -> str:
    """``rrfp train`` with :data:`SMALL` and ``flags``; asserts exit 0, returns stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *SMALL, *flags], capture_output=True, text=True,
                       timeout=1200, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def losses(path: Path) -> dict[int, float]:
    """``--loss-file``: step -> loss (exact, written as float.hex)."""
    return {int(s): float.fromhex(x) for s, x in (ln.split() for ln in path.read_text().splitlines())}
