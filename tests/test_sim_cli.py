"""``rrfp simulate``: tables, outputs, traces, sweeps and one-line errors (exit 2)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from rrfp.cli import main
from rrfp.sim.compare import SimConfig, compare, run_one
from rrfp.sim.jitter import LEVELS


def _sim(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_side_by_side_table_and_outputs(capsys, tmp_path) -> None:
    rc, out, _ = _sim(capsys, "--ranks", "4", "-m", "8", "--hints", "bf,bfw,strict-gpipe", "--jitter", "J2",
                      "--csv", str(tmp_path / "t.csv"), "--json", str(tmp_path / "t.json"),
                      "--markdown", str(tmp_path / "t.md"))
    assert rc == 0
    assert "strict-1f1b" in out and "speedup" in out  # the baseline joins the table
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert [r["policy"] for r in rows] == ["bf", "bfw", "strict-gpipe", "strict-1f1b"]
    base = next(r for r in rows if r["policy"] == "strict-1f1b")
    assert float(base["speedup"]) == 1.0
    for r in rows:
        assert float(r["makespan/bound"]) >= 1.0
    doc = json.load(open(tmp_path / "t.json"))
    assert doc["config"]["n_ranks"] == 4 and len(doc["runs"]) == 4
    run = doc["runs"][0]
    assert len(run["bubble"]) == 4 and len(run["peak_inflight"]) == 4 and run["lower_bound"] > 0
    assert (tmp_path / "t.md").read_text().startswith("| policy |")


def test_limit_1f1b_makes_bf_equal_strict_1f1b(capsys, tmp_path) -> None:
    rc, _, _ = _sim(capsys, "--ranks", "5", "-m", "10", "--hint", "bf", "--limit", "1f1b",
                    "--csv", str(tmp_path / "t.csv"))
    assert rc == 0
    rows = {r["policy"]: r for r in csv.DictReader(open(tmp_path / "t.csv"))}
    assert rows["bf"]["makespan_s"] == rows["strict-1f1b"]["makespan_s"]
    assert rows["bf"]["peak_inflight_max"] == rows["strict-1f1b"]["peak_inflight_max"] == "5"


def test_cost_file_and_trace(capsys, tmp_path) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"stages": [{"F": 0.002, "B": 0.004, "act_bytes": 2 ** 20}] * 3}))
    rc, out, _ = _sim(capsys, "--ranks", "3", "-m", "4", "--costs", str(prof), "--hints", "bf,bfw",
                      "--trace", str(tmp_path / "tr"), "--latency", "0.0001", "--bandwidth", "1e9")
    assert rc == 0
    for name in ("bf", "bfw", "strict-1f1b"):
        trace = json.load(open(tmp_path / "tr" / f"{name}.json"))
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert len(xs) == 3 * 4 * (3 if name == "bfw" else 2)
        assert (tmp_path / "tr" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,msg", [
    (["--hint", "nope"], "unknown hint 'nope'"),
    (["--limit", "0"], "--inflight-limit='0'"),  # --limit: an alias of --inflight-limit
    (["--ranks", "0"], "--pp=0"),  # --ranks: an alias of --pp
    (["--jitter", "J7"], "jitter 'J7'"),
    (["--seqlen", "gauss:1"], "distribution 'gauss'"),
    (["--straggler", "9:2"], "--straggler rank 9"),
    (["--costs", "/nonexistent.json"], "--costs /nonexistent.json"),
    (["--costs", "x.json", "--cost-f", "1"], "give costs one way"),
    (["-v", "2", "--hint", "1f1b"], "1f1b"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, msg) -> None:
    rc, out, err = _sim(capsys, *argv)
    assert rc == 2
    assert msg in err and err.count("\n") == 1 and err.startswith("rrfp simulate: error:")


@pytest.mark.parametrize("flag", ["--csv", "--json", "--markdown"])
def test_an_output_in_a_missing_folder_is_refused_before_running(capsys, tmp_path, flag) -> None:
    """Like every other output: no folder is created, and the refusal comes before the run."""
    missing = tmp_path / "absent"
    rc, out, err = _sim(capsys, "-p", "2", "-m", "4", flag, str(missing / "x"))
    assert rc == 2 and out == ""
    assert err == f"rrfp simulate: error: {flag} {missing / 'x'}: its folder {missing} does not exist\n"
    assert not missing.exists()
    rc, out, err = _sim(capsys, "-p", "2", "-m", "4", flag, str(tmp_path))
    assert rc == 2 and "is a folder, expected a file name" in err and err.count("\n") == 1


def test_sweep_prefix_in_a_missing_folder_is_refused(capsys, tmp_path) -> None:
    rc, _, err = _sim(capsys, "--sweep", "--depths", "2", "--mb-per-stage", "1", "--out", str(tmp_path / "no" / "sweep"))
    assert rc == 2 and f"--out {tmp_path / 'no' / 'sweep'}: its folder" in err
    assert not (tmp_path / "no").exists()


def test_sweep_writes_one_table(capsys, tmp_path) -> None:
    prefix = tmp_path / "sw"
    rc, out, err = _sim(capsys, "--sweep", "--depths", "2,4", "--mb-per-stage", "1,2", "--jitter-levels", "J0,J2",
                        "--imbalance", "1,3", "--hints", "bf,bfw,zb-h1", "--out", str(prefix))
    assert rc == 0
    rows = list(csv.DictReader(open(f"{prefix}.csv")))
    assert len(rows) == 2 * 2 * 2 * 2
    assert {"bf speedup", "bfw speedup", "zb-h1 speedup", "strict-1f1b (s)", "bound (s)"} <= set(rows[0])
    balanced = next(r for r in rows if r["jitter"] == "J0" and r["imbalance"] == "1")
    assert balanced["bf speedup"] == "1.00x"  # BF = 1F1B without variability (limit 32 >= p)
    md = open(f"{prefix}.md").read()
    assert md.count("\n") == len(rows) + 2


def test_compare_api_and_sweep_speedups() -> None:
    cfg = SimConfig(n_ranks=4, n_microbatches=8, jitter=LEVELS["J3"], seed=3)
    rows = compare(cfg, ["bf", "bfw"])
    assert [r.hint for r in rows] == ["bf", "bfw", "strict-1f1b"]
    assert rows[-1].speedup == 1.0
    assert all(r.makespan >= r.lower_bound for r in rows)
    summary, res = run_one(cfg, "bf", record=False)
    assert summary.makespan == rows[0].makespan and res.records == []


def test_module_entry_point_runs_without_torch() -> None:
    code = ("import sys; from rrfp.cli import main; rc = main(['simulate', '--ranks', '2', '-m', '2']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
