"""The README's whole `Pipeline` script ("Your own model") runs as written under torchrun, and
its first step's loss is the unsplit model's on the same batch (a single-process reference)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"


def _script() -> str:
    text = README.read_text()
    start = text.index("A whole script you can run")
    block = text[text.index("```python\n", start) + len("```python\n"):]
    return block[:block.index("```")]


@pytest.mark.timeout(600)
def test_the_readmes_whole_script_runs_under_torchrun_and_matches_the_unsplit_model(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_script())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("step ")]
    assert [int(l.split()[1].rstrip(":")) for l in lines] == list(range(1, 13)), p.stdout
    # Step 1 runs the initial weights: its loss is the unsplit model's MSE on the first batch.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)])
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=data), torch.randn(32, 16, generator=data)
    with torch.no_grad():
        want = nn.functional.mse_loss(model(x), y).item()
    got = float(re.search(r"loss ([\d.]+)", lines[0]).group(1))
    assert got == pytest.approx(want, abs=1e-4), (got, want)
