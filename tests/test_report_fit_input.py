"""``python -m benchmarks.report_fit --from-json`` on files that are not a benchmark run's raw
results: one line on stderr naming the file and what is wrong, exit 2, no traceback."""

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
