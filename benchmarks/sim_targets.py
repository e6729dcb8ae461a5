"""The targets that the simulator and the training job measure (the ``--sim-targets``
part of ``rrfp bench``): the scenario suite at 1F1B's memory and unlimited, the simulator's
speed on 128 ranks x 2 virtual stages x 1024 microbatches, and ``rrfp train --model
multimodal`` with no other arguments.

Each runs in this process (the suite, the simulator) or as the user would run it (the
training job, a subprocess with ``--loss-file``), so the report's figures come from the same
code a user runs. ``quick`` shrinks every size for a smoke run; its verdicts are not the
targets' (they are marked so).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUITE_COMMAND = "rrfp simulate --suite --markdown docs/suite.md"
TRAIN_COMMAND = [sys.executable, "-m", "rrfp", "train", "--model", "multimodal"]
TRAIN_LIMIT_S = 300.0
"""The target's bound on the multimodal run's wall time on a 2-core machine (5 minutes)."""


REPORT_SUITE: dict[str, Any] = {"ranks": (4, 8), "seeds": (0,)}
"""The suite's points this report runs: every scenario, layout and memory at 4 and 8 ranks, seed
0 (about 30 CPU-seconds; 16 and 32 ranks and three seeds take tens of minutes, and
``rrfp simulate --suite`` writes them to ``docs/suite.md``)."""
QUICK_SUITE: dict[str, Any] = {"scenarios": ("J0", "J2"), "ranks": (4,), "seeds": (0,)}


def run_suite_part(quick: bool) -> dict[str, Any]:
    """The scenario suite for its hints (``auto`` first, the train default) and the library's
    default hint: per judged hint the targets (``rrfp.sim.suite.suite_targets``), min and median
    speedups with the ceiling beside them, and the best hint by median at 1F1B's memory over
    the scenarios with variability."""
    from rrfp.scheduler.hints import DEFAULT_HINT
    from rrfp.sim import suite

    from benchmarks.bench_sim import timed

    hints = list(dict.fromkeys([*suite.SUITE_HINTS, DEFAULT_HINT]))
    kw: dict[str, Any] = dict(QUICK_SUITE) if quick else dict(REPORT_SUITE)
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Two worker processes (the machine's 2 cores); their CPU time counts once they are reaped.
    rows, wall, cpu = timed(lambda: suite.run_suite(hints, jobs=2, **kw))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += (after.ru_utime + after.ru_stime) - (kids.ru_utime + kids.ru_stime)
    # Hints run at every point (each layout's baseline runs only at its own points).
    shown = [h for h in dict.fromkeys(hints + [c for r in rows for c in r.candidates])
             if all(h in r.makespan for r in rows)]
    best = max(shown, key=lambda h: suite.variable_median(rows, h))
    judged = list(dict.fromkeys([*suite.judged_hints(hints), best]))
    return {
        "default": hints[0],
        "best": best,
        "targets": {h: [list(t) for t in suite.suite_targets(rows, h)] for h in judged},
        "per_hint": suite.median_speedups(rows, hints),
        "points": len(rows),
        "subset": {k: list(v) for k, v in (QUICK_SUITE if quick else REPORT_SUITE).items()},
        "wall_s": wall,
        "cpu_s": cpu,
    }


def run_sim_speed(quick: bool, repeat: int = 3) -> dict[str, Any]:
    """The simulator's time on 128 ranks x 2 virtual stages x 1024 microbatches under the
    default hint (``benchmarks/bench_sim.py``'s configuration): best wall and CPU seconds of
    ``repeat`` runs."""
    from benchmarks.bench_sim import simulate_once, timed
    from rrfp.scheduler.hints import DEFAULT_HINT

    ranks, virtual, mbs = (16, 2, 64) if quick else (128, 2, 1024)
    runs = [timed(lambda: simulate_once(ranks, virtual, mbs, DEFAULT_HINT)) for _ in range(repeat)]
    walls, cpus = [w for _, w, _ in runs], [c for _, _, c in runs]
    return {"ranks": ranks, "virtual": virtual, "microbatches": mbs, "hint": DEFAULT_HINT,
            "wall_s": min(walls), "cpu_s": min(cpus), "walls": walls, "loadavg": os.getloadavg()[0]}


def run_multimodal_train(quick: bool, timeout: float) -> dict[str, Any]:
    """``rrfp train --model multimodal`` (``--steps 4`` when quick) in a scratch folder, timed
    from start to exit; the first and last step losses from its ``--loss-file``.

    Raises:
        RuntimeError: the run failed or timed out (its last output lines in the message).
    """
    with tempfile.TemporaryDirectory(prefix="rrfp-bench-train-") as tmp:
        loss_file = Path(tmp) / "losses.txt"
        cmd = [*TRAIN_COMMAND, "--loss-file", str(loss_file), *(["--steps", "4"] if quick else [])]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`rrfp train --model multimodal` ran past {timeout:.0f} s") from None
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"`rrfp train --model multimodal` exited {proc.returncode}: {tail}")
        # One line "<step> <float.hex>" per step (rrfp.train.report.write_loss_file).
        losses = [float.fromhex(line.split()[1]) for line in loss_file.read_text().splitlines() if line.strip()]
    if not losses:
        raise RuntimeError("`rrfp train --model multimodal` wrote no losses")
    return {"wall_s": wall, "steps": len(losses), "first": losses[0], "last": losses[-1],
            "fall": 1.0 - losses[-1] / losses[0], "quick": quick}


def run(quick: bool, timeout: float, attempt) -> dict[str, Any]:
    """Every part, each through ``attempt(label, fn)`` (``run_all``'s: a failure is reported
    and fails the run without losing the other parts)."""
    return {
        "suite": attempt("scenario suite", lambda: run_suite_part(quick)),
        "speed": attempt("simulator speed", lambda: run_sim_speed(quick)),
        "train": attempt("multimodal training run", lambda: run_multimodal_train(quick, timeout)),
        "quick": quick,
    }


TITLE = "Simulator and training targets"


def target_rows(res: dict[str, Any]) -> list[list[str]]:
    """``[target, figure, verdict]`` per target measured (the report's targets table)."""
    from rrfp.sim import suite

    rows: list[list[str]] = []
    s = res.get("suite")
    if s:
        for hint, targets in s["targets"].items():
            role = "default" if hint == s["default"] else "best by median" if hint == s["best"] else "library default"
            for target, figure, ok in targets:
                rows.append([f"Suite ({role} hint `{hint}`): {target.removeprefix(hint + ' ')}", figure,
                             suite.verdict(ok)])
    sp = res.get("speed")
    if sp:
        rows.append([f"Simulator: {sp['ranks']} ranks x {sp['virtual']} virtual stages x {sp['microbatches']} "
                     f"microbatches, default hint `{sp['hint']}`, <= 2.5 s",
                     f"best of {len(sp['walls'])}: {sp['wall_s']:.2f} s wall, {sp['cpu_s']:.2f} s CPU "
                     f"(load average {sp['loadavg']:.1f})", "met" if sp["wall_s"] <= 2.5 else "**missed**"])
    tr = res.get("train")
    if tr:
        ok = tr["wall_s"] < TRAIN_LIMIT_S and tr["fall"] >= 0.30
        rows.append(["`rrfp train --model multimodal`, no other arguments: < 5 min, loss falls >= 30%",
                     f"{tr['wall_s']:.1f} s wall, {tr['steps']} steps, loss {tr['first']:.4f} -> {tr['last']:.4f} "
                     f"({-100 * tr['fall']:+.1f}%)", "met" if ok else "**missed**"])
    if res.get("quick"):
        rows = [[t, f, "- (quick)"] for t, f, _ in rows]
    return rows


def render(res: dict[str, Any]) -> list[str]:
    """The report's section: how the figures were made and the suite's per-hint summary (the
    targets themselves go in the report's targets table, :func:`target_rows`)."""
    lines = [f"## {TITLE}", ""]
    if res.get("quick"):
        lines += ["`--quick`: every size is shrunk (suite: J0 and J2 on 4 ranks; simulator: 16 x 2 x 64; "
                  "training: 4 steps), so these figures do not judge the targets.", ""]
    lines += ["Their targets are in the table of targets at the top of this report.", ""]
    tr = res.get("train")
    if tr:
        lines += [f"The training run: `rrfp train --model multimodal{' --steps 4' if tr['quick'] else ''}` in a scratch "
                  f"folder, its losses from `--loss-file`, timed from start to exit (rendezvous, {tr['steps']} steps, "
                  "evaluations and shutdown).", ""]
    s = res.get("suite")
    if s:
        sub = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in (s.get("subset") or {}).items())
        lines += [f"The suite (`{SUITE_COMMAND}` writes the full table at 4-32 ranks and three seeds; here "
                  f"{s['points']} points{f' ({sub})' if sub else ''} in {s['wall_s']:.0f} s wall, "
                  f"{s['cpu_s']:.0f} s CPU, so its targets below are judged on these points only): "
                  "every point is a fixed-order baseline "
                  "(strict 1F1B; strict interleaved 1F1B with 2 virtual stages) against each hint on the same "
                  "workload and seed, at the baseline's memory (`1f1b`) and without a budget (`unlimited`).", "",
                  "| hint | memory | min | median | ceiling min | ceiling median |", "|---|---|---|---|---|---|"]
        lines += [f"| {' | '.join(r)} |" for r in s["per_hint"]]
        lines.append("")
    return lines
