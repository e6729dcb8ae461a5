"""``rrfp simulate``: ``--hints auto``, the unknown-hint list, ``--memory-budget`` without sizes,
and the seconds columns' decimals."""

from __future__ import annotations

import argparse
import csv

from rrfp.cli import main
from rrfp.sim.auto import simulate_auto
from rrfp.sim.cli import config_from_args, register
from rrfp.sim.compare import SimConfig
from rrfp.sim.jitter import LEVELS


def _sim(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_hints_auto_is_the_run_of_the_hint_it_kept(capsys, tmp_path) -> None:
    rc, out, _ = _sim(capsys, "-p", "4", "-m", "8", "--hints", "auto,bf", "--jitter", "J2", "--csv", str(tmp_path / "t.csv"))
    assert rc == 0
    kept = simulate_auto(SimConfig(n_ranks=4, n_microbatches=8, jitter=LEVELS["J2"])).chosen
    rows = {r["policy"]: r for r in csv.DictReader(open(tmp_path / "t.csv"))}
    assert f"auto ({kept})" in rows and kept in rows
    assert {k: v for k, v in rows[f"auto ({kept})"].items() if k != "policy"} == \
        {k: v for k, v in rows[kept].items() if k != "policy"}
    assert f"# auto kept {kept}: median of 3 trial steps" in out
    rc, _, err = _sim(capsys, "--sweep", "--hints", "auto")
    assert rc == 2 and "auto runs in single simulations and in --suite" in err


def test_the_kept_line_after_extra_rounds_counts_their_steps_and_gives_the_medians_it_chose_on(capsys) -> None:
    """At 4 ranks, 16 microbatches, J2, 1F1B's memory the trial leaves two hints to its noise
    (rrfp.sim.trial.undecided): they run EXTRA_ROUNDS more rounds and the choice is made on their
    six steps each. The line said "median of 3 trial steps" and listed the three hints' medians
    adjusted together (backfill first, strict-split kept)."""
    from rrfp.sim.trial import EXTRA_ROUNDS, TRIAL_ROUNDS, keep, margin, medians

    argv = ["-p", "4", "-m", "16", "--jitter", "J2", "--limit", "16", "--memory-budget", "1f1b", "--act-bytes", "1MiB"]
    rc, out, _ = _sim(capsys, *argv, "--hints", "auto")
    assert rc == 0
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    run = simulate_auto(config_from_args(parser.parse_args(["simulate", *argv])))  # the flags' own config
    pair = sorted(h for h, v in run.walls.items() if len(v) == TRIAL_ROUNDS + EXTRA_ROUNDS)
    third = [h for h in run.walls if h not in pair]
    assert len(pair) == 2 and len(third) == 1 and run.chosen == keep({h: run.walls[h] for h in pair}, run.ranking.strict)
    med = medians({h: run.walls[h] for h in pair})
    want = ", ".join(f"{h} {med[h]:.4g} s" for h in sorted(pair, key=med.get))
    line = next(x for x in out.splitlines() if x.startswith("# auto kept"))
    assert line.startswith(f"# auto kept {run.chosen}: median of {TRIAL_ROUNDS + EXTRA_ROUNDS} trial steps of the two "
                           f"the trial's noise left undecided (seeds of their own; at their median batch work): {want}; "
                           f"faster counts beyond {100 * margin({h: run.walls[h] for h in pair}):.1f}%; "
                           f"{third[0]} lost in the trial's {TRIAL_ROUNDS} rounds; ")


def test_unknown_hint_lists_auto_and_the_table_names(capsys) -> None:
    rc, _, err = _sim(capsys, "--hints", "nosuch")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "unknown hint 'nosuch': expected auto or one of bf, " in err
    for name in ("split", "backfill", "bfw-mem", "zb-v", "dualpipev"):
        assert name in err


def test_memory_budget_without_sizes_says_act_bytes(capsys) -> None:
    rc, _, err = _sim(capsys, "--memory-budget", "1f1b")
    assert rc == 2 and err.strip().endswith("--memory-budget 1f1b: needs activation sizes: give --act-bytes SIZE "
                                            "(or a cost file with act_bytes)")
    assert _sim(capsys, "--memory-budget", "1f1b", "--act-bytes", "1MiB")[0] == 0


def test_seconds_columns_have_one_number_of_decimals(capsys, tmp_path) -> None:
    # Makespans 0.57 (bf, strict 1F1B) and 0.54 (strict-split) once printed as 0.57 / 0.54; the
    # smallest value sets 4 significant digits for the whole table.
    rc, out, _ = _sim(capsys, "-p", "4", "--hints", "bf,strict-split", "--csv", str(tmp_path / "t.csv"))
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert rc == 0 and [r["makespan_s"] for r in rows] == ["0.5700", "0.5400", "0.5700"]
    assert {len(r["lower_bound_s"].split(".")[1]) for r in rows} == {4}
    rc, out, _ = _sim(capsys, "-p", "4", "--hints", "bf", "--cost-f", "0.00001", "--cost-b", "0.00002",
                      "--csv", str(tmp_path / "u.csv"))
    assert [r["makespan_s"] for r in csv.DictReader(open(tmp_path / "u.csv"))] == ["0.0005700", "0.0005700"]
