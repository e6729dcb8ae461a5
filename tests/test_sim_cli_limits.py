"""``rrfp simulate`` rejects huge finite costs and delays up front, so a makespan never
overflows to inf: one line, exit code 2, naming the flag (or file and field) and the bound."""

from __future__ import annotations

import json
import math

import pytest

from rrfp.cli import main
from rrfp.sim.costs import MAX_BYTES, MAX_SECONDS, StageCost, load_costs


def _sim(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv,msg", [
    (["--cost-f", "1e308"], "--cost-f 1e308: expected seconds <= 1e9"),
    (["--cost-b", "0.02,1e10"], "--cost-b 0.02,1e10: expected seconds <= 1e9"),
    (["--cost-i", "1e300", "--cost-w", "0.01"], "--cost-i 1e300: expected seconds <= 1e9"),
    (["--cost-w", "nan"], "--cost-w nan: expected finite seconds >= 0"),
    (["--act-bytes", "1e308"], "--act-bytes 1e308: expected bytes <= 2**53"),
    (["--msg-bytes", "inf"], "--msg-bytes inf: expected finite bytes >= 0"),
    (["--latency", "1e308"], "--latency 1e308: expected seconds <= 1e9"),
    (["--step-overhead", "1e300", "--steps", "2"], "--step-overhead 1e300: expected seconds <= 1e9"),
    (["--encoder-scale", "1e308"], "--encoder-scale 1e308: expected a factor <= 1e6"),
    (["--noise", "1000"], "--noise 1000: expected a sigma <= 10"),
    (["--comm-noise", "1000"], "--comm-noise 1000: expected a sigma <= 10"),
    (["--straggler", "0:1e308"], "--straggler '0:1e308': expected RANK:FACTOR with 0 <= FACTOR <= 1e6, e.g. 3:1.5"),
    (["--jitter", "1,1e308,1"], "--jitter 1,1e308,1: b=1e308: expected seconds <= 1e9"),
    (["--comm-jitter", "1,0.01,1e308"], "--comm-jitter 1,0.01,1e308: a=1e308: expected a factor <= 1e6"),
    (["--seqlen", "lognormal:1000"], "--seqlen lognormal:1000: expected a sigma <= 10"),
    (["--seqlen", "uniform:1,1e300"], "--seqlen uniform:1,1e300: expected ratios <= 1e6"),
    (["--msg-bytes", "1e12", "--bandwidth", "1"],
     "--bandwidth 1: a message of 1000000000000 bytes would take 1e12 s: expected seconds <= 1e9"),
    (["--sweep", "--imbalance", "1,1e308"], "--imbalance '1,1e308': expected numbers <= 1e6"),
])
def test_huge_values_are_one_line_and_exit_2(capsys, argv, msg) -> None:
    rc, out, err = _sim(capsys, *argv)
    assert rc == 2 and out == ""
    assert err == f"rrfp simulate: error: {msg}\n", err


@pytest.mark.parametrize("name,text,msg", [
    ("c.toml", "F = 1e308\nB = 0.02\n", "c.toml: F=1e+308: expected seconds <= 1e9"),
    ("c.json", json.dumps({"stages": [{"F": 0.01, "B": 0.02}, {"F": 0.01, "B": 1e10}]}),
     "c.json: stage 1: B=10000000000.0: expected seconds <= 1e9"),
    ("c.json", '{"stages": [{"F": 0.01, "B": 0.02, "act_bytes": 1' + "0" * 400 + "}]}",
     "c.json: stage 0: act_bytes=100000000000... (401 digits): expected bytes <= 9007199254740992 (2**53)"),
])
def test_huge_values_in_cost_files_are_rejected(capsys, tmp_path, name, text, msg) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="expected"):
        load_costs(path)
    rc, out, err = _sim(capsys, "--costs", str(path))
    assert rc == 2 and out == ""
    assert err.startswith("rrfp simulate: error: ") and err.endswith(msg + "\n") and err.count("\n") == 1, err


def test_stage_cost_bounds_are_inclusive() -> None:
    c = StageCost.from_mapping({"F": MAX_SECONDS, "B": MAX_SECONDS, "act_bytes": MAX_BYTES})
    assert (c.F, c.act_bytes, c.msg_bytes) == (MAX_SECONDS, MAX_BYTES, MAX_BYTES)
    with pytest.raises(ValueError, match="W=1000000001.0: expected seconds <= 1e9"):
        StageCost.from_mapping({"F": 1.0, "I": 1.0, "W": MAX_SECONDS + 1})


def test_every_bound_at_once_keeps_the_makespan_finite(capsys, tmp_path) -> None:
    # Each flag at its largest accepted value: the worst product of bounded factors.
    rc, _, err = _sim(
        capsys, "-p", "2", "-m", "4", "--steps", "2", "--cost-f", "1e9", "--cost-b", "1e9",
        "--act-bytes", str(MAX_BYTES), "--bandwidth", str(MAX_BYTES / MAX_SECONDS), "--latency", "1e9",
        "--step-overhead", "1e9", "--encoder-scale", "1e6", "--straggler", "0:1e6", "--noise", "10",
        "--comm-noise", "10", "--jitter", "1,1e9,1e6", "--comm-jitter", "1,1e9,1e6", "--seqlen", "uniform:0,1e6",
        "--json", str(tmp_path / "r.json"),
    )
    assert rc == 0, err
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert len(runs) == 3
    for r in runs:
        assert math.isfinite(r["makespan"]) and r["makespan"] > 0
        assert math.isfinite(r["lower_bound"]) and math.isfinite(r["speedup"])


@pytest.mark.parametrize("argv,msg", [
    (["--ranks", "100000"], "--ranks 100000: expected at most 1024"),
    (["-m", "10000000"], "--microbatches 10000000: expected at most 65536"),
    (["--steps", "100000000"], "--steps 100000000: expected at most 10000"),
    (["--samples-per-mb", "1000000000"], "--samples-per-mb 1000000000: expected at most 4096"),
    (["--ranks", "1024", "-m", "65536"],
     "--ranks x --virtual x --microbatches x --steps: 201326592 tasks to simulate, expected at most 2000000"),
])
def test_simulator_sizes_are_capped_in_one_line(capsys, argv, msg):
    rc, out, err = _sim(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.strip() == f"rrfp simulate: error: {msg}"
