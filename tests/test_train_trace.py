"""``rrfp train --trace DIR``: the per-stage profile carries measured activation sizes: ``act_bytes``
what a forward saved for its backward (the runtime's sizer), ``msg_bytes`` its output message."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rrfp.model.gpt import GPT_PRESETS
from rrfp.runtime.engine.stage import PipelineStage
from rrfp.scheduler.tasks import parse_action
from rrfp.sim.costs import load_profile
from rrfp.runtime.engine.memory import ForwardSizer
from rrfp.train.tracing import profile_from_records, record_output_bytes, record_saved_bytes


def _records():
    from rrfp.runtime.engine.rank import TaskRecord

    return [TaskRecord(r, k, parse_action(t), 0.0, 1.0) for k in (0, 1)
            for r, t in ((0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0"))]


def test_output_bytes_are_recorded_per_forward_and_their_median_is_msg_bytes() -> None:
    stage = PipelineStage(torch.nn.Linear(3, 5), 1, 2)
    sizes = record_output_bytes([stage])
    for rows in (2, 4, 1):
        stage.submod(torch.zeros(rows, 3))
    assert sizes == {1: [2 * 5 * 4, 4 * 5 * 4, 1 * 5 * 4]}
    costs = profile_from_records(_records(), 2, sizes)
    assert [c.msg_bytes for c in costs.stages] == [0, 40]  # stage 0 recorded nothing
    assert [c.act_bytes for c in costs.stages] == [0, 0]  # no saved bytes: not a message's size


def test_saved_bytes_are_the_sizers_per_forward_and_their_median_is_act_bytes() -> None:
    # Linear(3, 5) saves its input for the weight gradient (rows x 3 float32); its weight is a
    # parameter, not an activation; its output (rows x 5) is not saved.
    lin = torch.nn.Linear(3, 5)
    sizer = ForwardSizer({1: lin}, first_stage=1)
    sizer.begin_step({})
    rt = SimpleNamespace(sizer=sizer, stages={1: None})
    saved: dict[int, list[int]] = {}
    for m, rows in enumerate((2, 4, 1)):
        x = torch.zeros(rows, 3)
        with sizer.measure(1, m, (x,)):
            lin(x)
    record_saved_bytes(SimpleNamespace(runtimes=[rt, SimpleNamespace(sizer=None, stages={0: None})]), 3, saved)
    assert saved == {1: [2 * 3 * 4, 4 * 3 * 4, 1 * 3 * 4]}
    costs = profile_from_records(_records(), 2, {1: [40, 80, 20]}, saved)
    assert [(c.act_bytes, c.msg_bytes) for c in costs.stages] == [(0, 0), (24, 40)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trace_profile_has_the_saved_bytes_the_memory_line_adds_up(tmp_path) -> None:
    # Paragraphs far longer than --max-len: every sample is cut to max_len + 1 bytes, so
    # every microbatch has exactly max_len positions and the sizes are known in advance.
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"paragraph {i} " + "lorem ipsum dolor sit amet " * 3 for i in range(40)))
    max_len, batch, n_mb = 16, 4, 2
    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--stages", "2", "--steps", "2", "--batch-size", str(batch),
         "--microbatches", str(n_mb), "--max-len", str(max_len), "--data", str(data), "--quiet",
         "--hint", "1f1b", "--trace", str(tmp_path / "tr")],
        check=False, capture_output=True, text=True, timeout=230,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    cfg = GPT_PRESETS["tiny"]
    mb = batch // n_mb
    hidden = mb * max_len * cfg.d_model * 4  # float32 residual stream sent from stage 0 to 1
    logits = mb * max_len * cfg.vocab_size * 4  # the last stage's output (not sent)
    costs = load_profile(tmp_path / "tr" / "profile.json")
    assert [c.msg_bytes for c in costs.stages] == [hidden, logits]
    # The memory line's activations: the most bytes each rank held at once. Under 1F1B with two
    # microbatches rank 0 holds both forwards before its first backward, rank 1 one at a time.
    held = re.search(r"activations \[([\d.]+) ([\d.]+)\]", p.stdout)
    assert held, p.stdout[-2000:]
    mib = [float(held.group(1)), float(held.group(2))]
    act = [c.act_bytes for c in costs.stages]
    assert abs(2 * act[0] / 2**20 - mib[0]) <= 0.005 and abs(act[1] / 2**20 - mib[1]) <= 0.005, (act, mib)
    assert act[0] > 4 * hidden  # each of stage 0's blocks saves several residual-sized tensors
    assert all(c.F > 0 and c.B > 0 for c in costs.stages)
    prof = json.loads((tmp_path / "tr" / "profile.json").read_text())
    assert prof["meta"]["source"] == "rrfp train"
