"""``rrfp train --trace DIR``: the per-stage profile carries measured activation sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rrfp.model.gpt import GPT_PRESETS
from rrfp.runtime.engine.stage import PipelineStage
from rrfp.scheduler.tasks import parse_action
from rrfp.sim.costs import load_profile
from rrfp.train.tracing import profile_from_records, record_output_bytes


def test_output_bytes_are_recorded_per_forward_and_their_median_is_act_bytes() -> None:
    from rrfp.runtime.engine.rank import TaskRecord

    stage = PipelineStage(torch.nn.Linear(3, 5), 1, 2)
    sizes = record_output_bytes([stage])
    for rows in (2, 4, 1):
        stage.submod(torch.zeros(rows, 3))
    assert sizes == {1: [2 * 5 * 4, 4 * 5 * 4, 1 * 5 * 4]}
    records = [TaskRecord(r, k, parse_action(t), 0.0, 1.0) for k in (0, 1)
               for r, t in ((0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0"))]
    costs = profile_from_records(records, 2, sizes)
    assert [c.act_bytes for c in costs.stages] == [0, 40]  # stage 0 recorded nothing
    assert costs.stages[1].msg_bytes == 40


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trace_profile_has_the_stage_output_sizes(tmp_path) -> None:
    # Paragraphs far longer than --max-len: every sample is cut to max_len + 1 bytes, so
    # every microbatch has exactly max_len positions and the sizes are known in advance.
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"paragraph {i} " + "lorem ipsum dolor sit amet " * 3 for i in range(40)))
    max_len, batch, n_mb = 16, 4, 2
    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--stages", "2", "--steps", "2", "--batch-size", str(batch),
         "--microbatches", str(n_mb), "--max-len", str(max_len), "--data", str(data), "--quiet",
         "--trace", str(tmp_path / "tr")],
        check=False, capture_output=True, text=True, timeout=230,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    cfg = GPT_PRESETS["tiny"]
    mb = batch // n_mb
    hidden = mb * max_len * cfg.d_model * 4  # float32 residual stream sent from stage 0 to 1
    logits = mb * max_len * cfg.vocab_size * 4  # the last stage's output (not sent)
    costs = load_profile(tmp_path / "tr" / "profile.json")
    assert [c.act_bytes for c in costs.stages] == [hidden, logits]
    assert costs.stages[0].msg_bytes == hidden
    assert all(c.F > 0 and c.B > 0 for c in costs.stages)
    prof = json.loads((tmp_path / "tr" / "profile.json").read_text())
    assert prof["meta"]["source"] == "rrfp train"
