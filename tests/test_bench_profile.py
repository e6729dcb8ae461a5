"""benchmarks/profile_comm.py: the message-time profile of a comparison setting."""

from __future__ import annotations

import pytest

from benchmarks import profile_comm
from benchmarks.settings import setting_config


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_records_releases_sends_and_replays(tmp_path, capsys):
    """The tiny comm4 setting, profiled: rrfp's tasks, sends and PyTorch's compute calls are
    recorded on every rank; a held message is never admitted before its delivery time (the
    inbox's kernel timer, rrfp/runtime/engine/timer.py); the replay prints one line per rrfp system
    and latency."""
    assert profile_comm.main(["--quick", "--rounds", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = profile_comm.summarize(tmp_path, 4)
    m = setting_config("comm4", quick=True, systems=profile_comm.SYSTEMS)["n_microbatches"]
    for r in range(4):
        rrfp = summary[r]["rrfp default, 1F1B memory"]
        # The default row runs auto, whose kept hint may split the backward (I and W, no B).
        backward = rrfp["task B"] if "task B" in rrfp else rrfp["task I"]
        assert rrfp["task F"]["n"] == 2 * m and backward["n"] == 2 * m  # 2 steps x m microbatches
        assert summary[r]["torch 1F1B"]["call forward_one_chunk"]["n"] == 2 * m
        if r < 3:  # every rank but the last sends each microbatch's activation
            assert rrfp["send wall"]["n"] >= 2 * m and rrfp["send cpu"]["p50"] >= 0
        for name in ("rrfp default, 1F1B memory", "rrfp strict-1f1b"):
            for k in ("release late, idle", "release late, busy"):
                if k in summary[r][name]:
                    assert summary[r][name][k]["p10"] >= 0 and summary[r][name][k]["p50"] >= 0, (r, name, k)
    replayed = [l for l in out.splitlines() if "replayed" in l]
    assert len(replayed) == 2 * 3 and all("real" in l for l in replayed)


def test_profile_rejects_bad_rounds(capsys):
    with pytest.raises(SystemExit) as e:
        profile_comm.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds 0: expected at least 1" in capsys.readouterr().err
