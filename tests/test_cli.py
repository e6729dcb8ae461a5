"""`rrfp train` rejects bad input with one line and exit code 2, before any process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rrfp.cli import main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--microbatches", "64", "--batch-size", "8"], "--microbatches=64 exceeds --batch-size=8"),
        (["--stages", "8"], "8 stages exceeds the 4 layers of model 'tiny'"),
        (["--stages", "2", "--virtual-stages", "4"], "8 stages exceeds the 4 layers"),
        (["--hint", "nope"], "unknown hint 'nope'"),
        (["--hint", "zb-v"], "--hint='zb-v' needs --virtual-stages 2 --placement v (got 1 virtual stage, loop placement)"),
        (["--hint", "strict-missing.csv"], "missing.csv"),
        (["--data", "/no/such/path"], "data path '/no/such/path' does not exist"),
        (["--inflight-limit", "0"], "--inflight-limit='0'"),
        (["--model", "huge"], "--model='huge'"),
        (["--steps", "0"], "--steps=0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr("rrfp.train.cli.launch", no_launch)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rrfp train: error: ") and needle in err[0], err


@pytest.mark.timeout(60)
def test_console_entry_point_exit_code():
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--hint", "nope"], check=False, capture_output=True, text=True, timeout=50)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "unknown hint 'nope'" in p.stderr


def test_launcher_summary_names_the_rank_that_died_first():
    from types import SimpleNamespace as NS

    from rrfp.train.cli import describe_failures

    killed = {0: NS(exitcode=1, timestamp=10.0), 1: NS(exitcode=1, timestamp=10.5),
              2: NS(exitcode=-9, timestamp=11.0), 3: NS(exitcode=-15, timestamp=9.0)}
    assert describe_failures(killed) == "rank 2 died (SIGKILL); ranks 0, 1, 3 stopped too"
    errored = {0: NS(exitcode=1, timestamp=12.0), 3: NS(exitcode=1, timestamp=11.0)}
    assert describe_failures(errored) == "rank 3 failed (exit code 1); rank 0 stopped too"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--steps", "abc"], "rrfp train: error: argument --steps: invalid int value: 'abc'"),
        (["train", "--hint"], "rrfp train: error: argument --hint: expected one argument"),
        (["train", "--placement", "zigzag"], "rrfp train: error: argument --placement: invalid choice: 'zigzag'"),
        (["train", "--lr", "fast"], "rrfp train: error: argument --lr: invalid float value: 'fast'"),
        (["train", "--no-such-flag", "3"], "rrfp train: error: unrecognized arguments: --no-such-flag 3"),
        # Never a prefix: --step is not --steps (it ran 5 steps silently before).
        (["train", "--step", "5"], "rrfp train: error: unrecognized arguments: --step 5"),
        (["simulate", "--microbatch", "8"], "rrfp simulate: error: unrecognized arguments: --microbatch 8"),
        (["simulate", "-p", "x"], "rrfp simulate: error: argument --pp/-p/--ranks: invalid int value: 'x'"),
        (["simulate", "--latency", "soon"], "rrfp simulate: error: argument --latency: invalid float value: 'soon'"),
        (["bench", "--rounds", "q"], "rrfp bench: error: argument --rounds: invalid int value: 'q'"),
        (["nosuch"], "rrfp: error: argument {train,simulate,bench,node,export}: invalid choice: 'nosuch'"),
    ],
)
def test_argparse_errors_are_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(needle), err
    assert "usage:" not in cap.err and cap.out == ""


@pytest.mark.timeout(60)
def test_argparse_error_from_the_console_entry_point():
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--steps", "abc"],
                       check=False, capture_output=True, text=True, timeout=50)
    assert p.returncode == 2
    assert p.stderr == "rrfp train: error: argument --steps: invalid int value: 'abc'\n", p.stderr


@pytest.mark.parametrize("cmd", ["train", "simulate", "bench"])
def test_help_still_prints_the_full_usage(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rrfp {cmd} ") and "--seed" in out


@pytest.mark.parametrize("cmd", ["train", "simulate"])
def test_help_states_each_default_once(cmd, capsys, monkeypatch):
    # ArgumentDefaultsHelpFormatter appends "(default: ...)"; a hand-written one would be a second.
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "(default: " in line]
    assert lines and not [line for line in lines if line.lower().count("default") > 1], lines


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`rrfp simulate ... | head -1`: once the reader has gone, the command stops with the
    shell's SIGPIPE status (141) and no traceback."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "rrfp", "simulate", "-p", "4"], stdout=w,
                              stderr=subprocess.PIPE, cwd=tmp_path, timeout=120, check=False)
    finally:
        os.close(w)
    assert b"Traceback" not in proc.stderr and b"BrokenPipeError" not in proc.stderr, proc.stderr.decode()[-2000:]
    assert proc.returncode == 141
