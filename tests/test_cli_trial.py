"""A new user's trial of ``rrfp simulate`` and ``rrfp train``: each bad value is one line
naming it and what was expected, exit code 2, before anything runs (no rank, no simulation)."""

from __future__ import annotations

import pytest

from rrfp.cli import main

from cli_lines import error_line as _line


@pytest.mark.parametrize("form", ["{}", "strict-{}", "csv:{}"])
def test_simulate_names_an_unreadable_hint_file_not_the_trace(form, tmp_path, capsys):
    missing = str(tmp_path / "no_such.csv")
    hint = form.format(missing)
    assert main(["simulate", "--hint", hint]) == 2
    assert _line(capsys, "simulate") == f"hint {hint!r}: cannot read {missing}: No such file or directory"
    assert main(["simulate", "--hint", f"csv:{tmp_path}"]) == 2
    assert _line(capsys, "simulate") == f"hint 'csv:{tmp_path}': cannot read {tmp_path}: Is a directory"


@pytest.mark.parametrize("flags,named", [
    (["--costs", "/no/such.json"], "--costs"),
    (["--cost-f", "0.1"], "--cost-f"),
    (["-p", "8", "--jitter", "J2"], "--ranks, --jitter"),
])
def test_suite_refuses_the_flags_it_would_ignore(flags, named, capsys):
    assert main(["simulate", "--suite", "--suite-ranks", "4", *flags]) == 2
    line = _line(capsys, "simulate")
    assert line.startswith(f"--suite does not take {named}: its scenarios ")
    assert ("fixed costs" in line) == named.startswith("--cost")


@pytest.mark.parametrize("given", ["", ","])
def test_an_empty_suite_scenario_list_is_an_error(given, capsys):
    assert main(["simulate", "--suite", "--suite-scenarios", given]) == 2
    assert _line(capsys, "simulate").startswith(f"--suite-scenarios {given!r}: expected some of J0, ")


def test_train_config_that_is_not_utf8_is_one_line(tmp_path, capsys, no_launch):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"steps = 3\n\xff\xfe\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert _line(capsys, "train") == f"--config={str(cfg)!r}: not UTF-8 text (byte 10), expected a TOML file"


def _strict(path) -> dict:
    import json

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_simulate_json_is_strict_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["simulate", "-p", "2", "-m", "2", "--json", str(out)]) == 0
    assert _strict(out)["config"]["bandwidth"] == "inf"  # the default: free messages


def test_nonfinite_floats_round_trip_through_strict_json():
    import math

    from rrfp import _json

    text = _json.dumps({"a": [math.inf, -math.inf, 1.5, "x"], "b": {"c": math.nan}})
    assert "Infinity" not in text and "NaN" not in text
    back = _json.restore(__import__("json").loads(text))
    assert back["a"][:3] == [math.inf, -math.inf, 1.5] and back["a"][3] == "x" and math.isnan(back["b"]["c"])


@pytest.mark.parametrize("flags,line", [
    (["--memory-budget", "-5", "--act-bytes", "100"],
     "memory size '-5': expected a positive size with an optional unit, e.g. 64MiB, 1.5GB"),
    (["--hints", "bf,,bfw"], "--hints 'bf,,bfw': expected comma-separated hint names, none empty"),
    (["--hints", ""], "--hints '': expected comma-separated hint names, none empty"),
    (["--csv", ""], "--csv '': expected a file name"),
    (["--trace", ""], "--trace '': expected a folder name"),
    (["--samples-per-mb", "0"], "--samples-per-mb 0: expected at least 1 sample per microbatch"),
    (["--encoder-stages", "-1"], "--encoder-stages -1: expected a number of stages >= 0"),
    (["--act-bytes", "1XB"], "--act-bytes '1XB': expected a size (4096, 64MiB, 1.5GB), or one per stage separated by commas"),
])
def test_simulate_papercuts_are_one_line(flags, line, capsys):
    assert main(["simulate", *flags]) == 2
    assert _line(capsys, "simulate") == line


def test_act_bytes_takes_the_size_units_of_memory_budget(capsys):
    """``--act-bytes 1MiB`` is 1048576 bytes, as ``--memory-budget`` reads it: four of them in
    flight on rank 0 of a 4-rank strict 1F1B are 4.0 MiB."""
    assert main(["simulate", "-p", "4", "--hints", "strict-1f1b", "--act-bytes", "1MiB"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("strict-1f1b"))
    assert row.split()[-1] == "4.0"
