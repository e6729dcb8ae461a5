"""``rrfp bench``'s command line: bad output paths and options refused before anything runs,
and a stopped run (SIGTERM, Ctrl-C, SIGKILL) leaves no rank process and no temporary folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import launcher, run_all  # noqa: E402
from benchmarks.harness import BenchError  # noqa: E402
from benchmarks.launcher import LAUNCHED_ENV  # noqa: E402
from rrfp.cli import main  # noqa: E402


@pytest.fixture
def no_run(monkeypatch):
    """``rrfp bench`` must refuse before running: a run fails the test at once."""

    def ran(args):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(run_all, "run", ran)


@pytest.mark.parametrize("flag", ["--json", "--out"])
@pytest.mark.parametrize("case,problem", [
    ("folder", "is a folder, expected a file path"),
    ("missing", "its folder 'MISSING' does not exist"),
    ("device", "is not a regular file, expected a file path"),
])
def test_output_paths_are_checked_before_the_benchmark_runs(flag, case, problem, tmp_path, capsys, no_run):
    path = {"folder": str(tmp_path), "missing": str(tmp_path / "no" / "dir" / "x.json"), "device": "/dev/full"}[case]
    assert main(["bench", "--quick", flag, path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rrfp bench: error: {flag} {path}: {problem.replace('MISSING', str(tmp_path / 'no' / 'dir'))}"]


def test_a_missing_hint_file_or_a_folder_for_from_json_is_one_line(tmp_path, capfd, no_run):
    missing = tmp_path / "no_such.csv"
    assert main(["bench", "--quick", "--hint", str(missing)]) == 2  # refused by the benchmark program
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rrfp bench: error: --hint {str(missing)!r}: ") and "No such file" in err[0]
    assert main(["bench", "--from-json", str(tmp_path)]) == 2
    assert capfd.readouterr().err.strip() == f"rrfp bench: error: --from-json {tmp_path}: is a folder, expected a file"
    assert main(["bench", "--from-json", ""]) == 2  # read as no flag: the whole benchmark ran
    assert capfd.readouterr().err.strip() == "rrfp bench: error: --from-json '': expected a file"


@pytest.mark.parametrize("argv,line", [
    (["--settings", "nope"], "rrfp bench: error: --settings 'nope': expected a comma-separated subset of jitter4, "),
    (["--rounds", "0"], "rrfp bench: error: --rounds 0: expected at least 1"),
    (["--timeout", "nan"], "rrfp bench: error: --timeout nan: expected a positive number of seconds, at most 86400"),
    (["--candidates", "bf,zzz"], "rrfp bench: error: --candidates 'zzz': unknown hint 'zzz'"),
    (["--candidates", ""], "rrfp bench: error: --candidates '': expected one or more hint names, comma-separated"),
    (["--candidates", "auto,bf"], "rrfp bench: error: --candidates 'auto': auto chooses among hints"),
    (["--hint", ""], "rrfp bench: error: --hint '': unknown hint ''"),  # ran the benchmark with auto
])
def test_bad_options_are_refused_before_torch_loads(argv, line, tmp_path):
    """``rrfp bench`` and the benchmark program it starts: one line, exit 2, and neither process
    imported torch (PYTHONPROFILEIMPORTTIME, inherited by the program, lists both's imports)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    p = subprocess.run([sys.executable, "-m", "rrfp", "bench", *argv], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=env)
    imports = [ln.split("|")[-1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    assert "benchmarks.settings" in imports and "torch" not in imports, imports  # the program ran its checks
    assert p.returncode == 2 and len(errors) == 1 and errors[0].startswith(line), p.stderr[-2000:]


@pytest.mark.slow
def test_the_launcher_removes_its_temporary_folder(tmp_path, monkeypatch):
    """Each launch (the probe, every setting) made an ``rrfp-bench-*`` folder and left it."""
    monkeypatch.setattr(launcher.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(BenchError, match="wrote no result"):  # idle returns nothing
        launcher.launch("benchmarks.launcher:idle", 2, {"seconds": 0}, timeout=120)
    with pytest.raises(BenchError, match="failing on purpose"):
        launcher.launch("benchmarks.launcher:idle", 2, {"fail_rank": 1}, timeout=120)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreaper and PR_SET_PDEATHSIG are Linux-only")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stopped_bench_leaves_no_rank_running(sig, tmp_path):
    """``rrfp bench`` stopped while its ranks start: SIGTERM and Ctrl-C stop it cleanly (one
    line, exit 128 + the signal, the launcher kills its ranks), SIGKILL takes the ranks with it
    (PR_SET_PDEATHSIG). The launcher runs under tests/reaper.py, a child subreaper that waits
    for the ranks, and signals it once the launcher names its ranks' pids (through a FIFO, the
    test hook ``RRFP_TEST_BENCH_LAUNCHED``): how each rank died is asserted, not how fast. A
    rank that outlived its launcher ended by its own error (exit 1) or a timeout, before."""
    fifo = tmp_path / "launched"
    os.mkfifo(fifo)
    env = {**os.environ, LAUNCHED_ENV: str(fifo), "TMPDIR": str(tmp_path)}
    reaper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), sys.executable, "-m",
                               "rrfp", "bench", "--quick", "--compare", "--settings", "compute2", "--no-sim"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=str(tmp_path))
    ranks: list[int] = []
    try:
        launcher = int(reaper.stdout.readline().split()[1])  # "launched PID"
        reader = threading.Thread(target=lambda: ranks.extend(map(int, fifo.read_text().split(","))), daemon=True)
        reader.start()
        reader.join(180)  # a hang bound only: the launcher writes once its ranks are started
        assert ranks, "the launcher never named its ranks"
        reaper.stdin.write(",".join(map(str, [launcher, *ranks])) + "\n")
        reaper.stdin.flush()
        os.kill(launcher, sig)
        out, err = reaper.communicate(timeout=120)  # a hang bound only: a rank left alive runs on
    finally:
        if reaper.poll() is None:
            for r in ranks:
                try:
                    os.kill(r, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reaper.kill()
            reaper.wait()
    how = json.loads(next(ln for ln in out.splitlines() if ln.startswith("reaped ")).split(" ", 1)[1])
    rank_ends = {how[str(r)] for r in ranks}
    killed = {f"signal {int(signal.SIGKILL)}", f"exit {128 + int(signal.SIGKILL)}"}
    # "not reaped": the launcher itself waited for the rank (the reaper is a subreaper, so a
    # rank alive after its launcher exited would have been its child, and reaped).
    assert rank_ends <= (killed if sig == signal.SIGKILL else killed | {"not reaped"}), (how, err)
    if sig == signal.SIGKILL:
        assert how[str(launcher)] == f"signal {int(sig)}"
    else:
        assert how[str(launcher)] == f"exit {128 + int(sig)}", (how, err)
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == f"rrfp bench: stopped by {sig.name}; its rank processes were stopped too"
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("rrfp-bench-")]


def test_the_report_header_gives_the_json_flag_it_was_run_with():
    from benchmarks import report

    results = {"machine": report.machine_info(), "quick": True, "compare": {}, "micro": None, "errors": [],
               "seconds": 1.0}
    args = run_all.build_parser().parse_args(["--quick", "--micro", "--json", "raw results.json", "--out", "r.md"])
    header = run_all.render(results, args).splitlines()[2]
    assert header.startswith("Generated by `rrfp bench --micro --quick --out r.md --json 'raw results.json'` ")
    assert header.endswith("Raw numbers: `'raw results.json'`; `rrfp bench --from-json 'raw results.json'` renders "
                           "this report again from them.")
    plain = run_all.render(results, run_all.build_parser().parse_args(["--quick"])).splitlines()[2]
    assert plain.startswith("Generated by `rrfp bench --quick` ") and "add `--json results.json`" in plain


@pytest.mark.parametrize("quick", [True, False])
def test_a_quick_run_gives_no_verdict_on_speed_targets(quick, monkeypatch):
    """One timed round at small sizes decides nothing: ``--quick`` reads "- (quick)", as the
    simulator's targets do; a full run says met or missed."""
    from benchmarks import report

    monkeypatch.setattr(report, "render_micro", lambda micro: "")
    micro = {"overhead_local": {"bf, codec": {"overhead_cpu_us": 80.0}}, "arbiter": {"bf": {"32": {"median": 1.0}}}}
    results = {"machine": report.machine_info(), "quick": quick, "compare": {}, "micro": micro, "errors": [],
               "seconds": 1.0}
    text = run_all.render(results, run_all.build_parser().parse_args(["--micro"] + (["--quick"] if quick else [])))
    verdicts = [ln.split(" | ")[2] for ln in text.splitlines() if ln.startswith("| runtime overhead") or
                ln.startswith("| arbiter decision")]
    assert verdicts == (["- (quick)", "- (quick)"] if quick else ["**missed**", "met"])


def test_the_estimate_names_every_part_it_runs_and_the_report_lists_their_times():
    full = run_all.build_parser().parse_args([])
    quick = run_all.build_parser().parse_args(["--quick"])
    settings = full.settings.split(",")
    total, parts = run_all.estimate_seconds(full, run_all.PARTS, settings)
    assert set(parts) == {*settings, "probe", "ideal", "micro", "sim_targets"}
    assert total == pytest.approx(sum(parts.values()))
    q_total, q_parts = run_all.estimate_seconds(quick, run_all.PARTS, settings)
    assert "probe" not in q_parts and all(q_parts[s] < parts[s] for s in settings) and q_total < total
    from benchmarks import report

    results = {"machine": report.machine_info(), "quick": True, "compare": {}, "micro": None, "errors": [],
               "seconds": 3.0, "timings": {"setting ranks8": 1.4, "micro-benchmarks": 1.6}}
    text = run_all.render(results, quick)
    assert "Time per part (s, wall): setting ranks8 1, micro-benchmarks 2." in text
