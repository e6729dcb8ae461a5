"""Whole ``rrfp train`` runs as subprocesses, shared by the tests that compare one run with
another (test_ckpt_layouts, test_parallel_layouts): small deterministic flags, the losses
read back exactly from ``--loss-file``. Each run is under a timeout that bounds a hang only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SMALL = ["--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1", "--deterministic", "--quiet"]
_STEP = re.compile(r"^step +(\d+)/\d+ .*\bloss +(\S+) .*\bgrad norm +(\S+) ")


def train(*flags: str, quiet: bool = True) -> str:
    """``rrfp train`` with :data:`SMALL` and ``flags``; asserts exit 0, returns stdout (with
    ``quiet=False``, the step lines too: :func:`step_lines`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    small = SMALL if quiet else [f for f in SMALL if f != "--quiet"]
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *small, *flags], capture_output=True, text=True,
                       timeout=1200, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def losses(path: Path) -> dict[int, float]:
    """``--loss-file``: step -> loss (exact, written as float.hex)."""
    return {int(s): float.fromhex(x) for s, x in (ln.split() for ln in path.read_text().splitlines())}


def step_lines(stdout: str) -> dict[int, tuple[str, str]]:
    """The step lines ``rrfp train`` prints: step -> (loss, grad norm) as printed (4 decimals)."""
    found = {}
    for line in stdout.splitlines():
        if (m := _STEP.match(line)) is not None:
            found[int(m.group(1))] = (m.group(2), m.group(3))
    return found
