"""`rrfp train --dp/--tp` bad input: one line, exit code 2, no process started."""

from __future__ import annotations

import pytest

from rrfp.cli import main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tp", "3"], "--tp=3: expected a divisor of the 2 attention heads of model 'tiny'"),
        (["--dp", "0"], "--dp=0: expected a positive integer"),
        (["--dp", "8", "--microbatches", "8", "--batch-size", "32"], "--microbatches=8 x --dp=8 exceeds --batch-size=32"),
        (["--dp", "2", "--trace", "/tmp/rrfp-par-trace"], "--trace records one pipeline"),
    ],
)
def test_layout_flags_bad_input_is_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr("rrfp.train.cli.launch", no_launch)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rrfp train: error: ") and needle in err[0], err


def test_launch_starts_stages_x_dp_x_tp_processes(monkeypatch):
    from rrfp.train.zygote import LocalJob

    seen = {}
    monkeypatch.setattr(LocalJob, "start", lambda job: seen.setdefault("n", job.world))
    monkeypatch.setattr(LocalJob, "wait", lambda job: {})
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--stages", "2", "--dp", "2", "--tp", "2", "--model", "small"]) == 0
    assert seen["n"] == 8
