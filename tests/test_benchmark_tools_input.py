"""The benchmark tools' bad input: ``python -m benchmarks.report_fit --from-json`` on files that
are not a benchmark run's raw results (or hold nothing it can refit), and
``benchmarks.overhead_instructions``' flags: one line on stderr naming the value and what was
expected, exit 2, no traceback."""

from __future__ import annotations

import json

import pytest

from benchmarks import report_fit


def _lines(capsys) -> list[str]:
    cap = capsys.readouterr()
    assert cap.out == ""
    return cap.err.strip().splitlines()


@pytest.mark.parametrize("raw,needle", [
    ({"compare": {"jitter4": {}}}, "'config'"),                                  # a setting without its fields
    ({"compare": {"jitter4": {"config": {}, "phases": []}}}, "'calibration'"),
    ({"compare": {"jitter4": []}}, "jitter4"),                                   # a setting that is no object
    ({"compare": {"jitter4": {"config": {}, "calibration": None, "phases": [{}]}}}, "jitter4"),
])
def test_a_setting_without_its_raw_results_is_one_line(tmp_path, capsys, raw, needle):
    f = tmp_path / "results.json"
    f.write_text(json.dumps(raw))
    assert report_fit.main(["--from-json", str(f)]) == 2
    err = _lines(capsys)
    assert len(err) == 1, err
    assert err[0].startswith(f"report_fit: error: --from-json {f}: setting 'jitter4': "), err
    assert needle in err[0]


def test_a_run_without_settings_is_refused_not_passed(tmp_path, capsys):
    # Nothing to check is no pass: a run of `rrfp bench --micro` records no comparison settings.
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"compare": {}}))
    assert report_fit.main(["--from-json", str(f)]) == 2
    assert _lines(capsys) == [f"report_fit: error: --from-json {f}: no comparison settings recorded "
                              "(expected the raw results of `rrfp bench --compare --json`)"]


def _phase(name: str, *, sleep: bool = False, calibrated: bool = False) -> dict:
    """A phase summary as :func:`benchmarks.report_fit.check` returns it, nothing predicted."""
    return {"names": ["rrfp strict-1f1b"], "predicted": {}, "sleep": sleep, "calibrated": calibrated,
            "steps": {}, "kept": {}}


def test_a_phase_that_cannot_be_refit_says_why_and_a_file_with_none_fails(tmp_path, capsys, monkeypatch):
    # A run recorded before every rrfp row kept its task records (or one whose tasks sleep) has
    # nothing to refit: each phase says so on its own line, and with no phase refit at all the
    # command fails (it printed nothing and exited 0: a check that checked nothing passed).
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"compare": {"jitter4": {}, "sleep4": {}}}))
    phases = {"jitter4": {"J0": _phase("J0"), "J2": _phase("J2", calibrated=True)},
              "sleep4": {"J1": _phase("J1", sleep=True, calibrated=True)}}
    monkeypatch.setattr(report_fit, "check", lambda res: phases.pop(next(iter(phases))))
    assert report_fit.main(["--from-json", str(f)]) == 2
    cap = capsys.readouterr()
    assert cap.out.splitlines() == [
        "jitter4, J0: not refit (no calibrated model: no strict row's task records, or too few to fit)",
        "jitter4, J2: not refit (no rrfp row with a prediction)",
        "sleep4, J1: not refit (its tasks sleep: the report's own rows for such settings, benchmarks/report_peers.py)",
    ]
    assert cap.err.splitlines() == [f"report_fit: error: --from-json {f}: no phase of jitter4, sleep4 could be refit"]


def test_one_phase_refit_is_a_pass_and_the_other_still_says_why_not(tmp_path, capsys, monkeypatch):
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"compare": {"jitter4": {}}}))
    ok = {"names": ["rrfp strict-1f1b"], "predicted": {"rrfp strict-1f1b": [0.1, 0.1]}, "sleep": False,
          "calibrated": True, "steps": {"rrfp strict-1f1b": [0.102, 0.104]}, "kept": {}}  # real / sim 1.02, 1.04
    monkeypatch.setattr(report_fit, "check", lambda res: {"J0": _phase("J0"), "J2": ok})
    assert report_fit.main(["--from-json", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["jitter4, J2: each rrfp row's real step within 5% of the calibrated simulator's: 1 of 1 rows; "
                   "real / simulated 1.030-1.030 (worst strict-1f1b) [met]",
                   "jitter4, J0: not refit (no calibrated model: no strict row's task records, or too few to fit)"]


def test_overhead_instructions_refuses_a_negative_count_before_running(capsys):
    # It printed the per-task line and no function (Counter.most_common(-1)), exit 0.
    from benchmarks import overhead_instructions

    assert overhead_instructions.main(["--bytecodes", "-1"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == "--bytecodes -1: expected a count of functions to list (>= 0)\n"
