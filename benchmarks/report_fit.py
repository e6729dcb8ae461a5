"""The calibrated simulator against a recorded run, offline: refit the model of every setting
and phase from the raw results of ``rrfp bench --json`` (each rrfp row's task records,
``record_tasks``) and print, per setting and phase, how many rrfp rows' real step times are within
5% of the simulated ones and how many speedups over strict 1F1B within 0.05 (issue 33's targets,
:func:`benchmarks.report.calibration_targets`), with each row's figures under ``--rows``.

One real run, many model variants: the predictions are :func:`benchmarks.report_peers.predictions`,
the report's own, so a change to the model (``rrfp/sim/calibration.py``,
``benchmarks/sim_pred.py``) is checked here against recorded runs before a new one is taken::

    python -m benchmarks.report_fit --from-json results.json [--settings jitter4,compute2] [--rows] [--memory]

``--memory``: per row held to a PyTorch schedule's bytes, each rank's budget beside the most
bytes the row held in its timed rounds, replayed from its task records with each virtual stage's
bytes (:func:`held_peaks`): whether the runtime kept within the budget the simulator holds it
to (the timed rounds record no peak of their own; the memory round's ran before ``auto`` chose).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np


def check(res: dict) -> dict[str, dict]:
    """Per phase of one setting's raw result, its summary (:func:`benchmarks.report.phase_summary`)
    with the refitted predictions (``predicted``) and whether they ran calibrated
    (``calibrated``), as :func:`benchmarks.report.calibration_targets` reads them."""
    from .report import phase_summary
    from .report_peers import models, predictions

    pred, model = predictions(res), models(res)
    out = {}
    for ph in res["phases"]:
        s = phase_summary(ph)
        s["predicted"] = {n: v for n, v in (pred.get(ph["name"]) or {}).items() if n in s["names"]}
        s["sleep"] = bool(res["config"].get("sleep"))
        s["calibrated"] = bool(model.get(ph["name"]))
        out[ph["name"]] = s
    return out


def why_not_refit(s: dict) -> str:
    """Why a phase summary (:func:`check`) yields no calibration target."""
    if s.get("sleep"):
        return "its tasks sleep: the report's own rows for such settings, benchmarks/report_peers.py"
    if not s.get("calibrated"):
        return "no calibrated model: no strict row's task records, or too few to fit"
    return "no rrfp row with a prediction"


def row_lines(s: dict) -> list[str]:
    """Per rrfp row with a prediction: real and simulated medians (ms), real / simulated, and the
    real and simulated speedups over strict 1F1B."""
    from .report import simulated_speedup

    base = "rrfp strict-1f1b"
    lines = []
    for n in s["names"]:
        sim = s["predicted"].get(n)
        if not n.startswith("rrfp ") or not sim:
            continue
        real = np.asarray(s["steps"][n])
        spd = ""
        if base in s["predicted"]:
            spd = f"  speedup real {s['speedup'][n][base]:.3f} sim {simulated_speedup(s, n, base):.3f}"
        kept = s["kept"].get(n)
        lines.append(f"  {n + (f' ({kept})' if kept else ''):58s} real {1e3 * np.median(real):7.1f} ms  sim "
                     f"{1e3 * np.median(sim):7.1f} ms  real/sim {np.median(real / np.asarray(sim)):.3f}{spd}")
    return lines


def same_schedule(s: dict) -> dict[str, float]:
    """Per rrfp row that ran strict 1F1B's very schedule (``auto`` kept ``strict-1f1b``), the
    median over the rounds of its real step over the ``rrfp strict-1f1b`` row's, paired: what
    no model of the schedule can tell apart (the run's noise, and what those rows' runtime pays
    that the strict row's does not; before db671b9 the layers auto's split trial had routed
    stayed routed, 5-20% here)."""
    base = "rrfp strict-1f1b"
    if base not in s["steps"]:
        return {}
    return {n: float(np.median(np.asarray(s["steps"][n]) / np.asarray(s["steps"][base])))
            for n, k in s["kept"].items() if k == "strict-1f1b" and n in s["steps"]}


def held_peaks(steps: dict, stage_bytes: Sequence[Sequence[int]], n_virtual: int, placement: str) -> list[tuple[int, int]]:
    """Per rank, (the most activation bytes held, the most microbatches in flight) over a row's
    recorded steps (step id -> per rank ``{"rank", "tasks": [[stage, kind, mb, start, end], ...]}``),
    by the memory ledger's rule on each rank's own order (:func:`rrfp.scheduler.memory.order_bytes`;
    a split backward's ``W`` bytes unknown here, so all held until ``W``: an upper bound) with
    ``stage_bytes[rank][i]`` the bytes of one microbatch on the rank's ``i``-th virtual stage. A
    microbatch is in flight from its first virtual stage's forward to that stage's last backward."""
    from rrfp.scheduler.memory import order_bytes
    from rrfp.scheduler.tasks import B, F, W, Placement, Task

    place = Placement(len(stage_bytes), n_virtual, placement)
    size = {s: int(stage_bytes[r][i]) for r in range(place.n_ranks) for i, s in enumerate(place.stages_of(r))}
    out = [(0, 0)] * place.n_ranks
    for ranks in steps.values():
        for rs in ranks:
            r, first = rs["rank"], place.stages_of(rs["rank"])[0]
            order = [Task(int(s), str(k), int(m)) for s, k, m, *_ in sorted(rs["tasks"], key=lambda t: t[3])]
            held = max(order_bytes(order, lambda s, m: size[s], lambda s, m: None), default=0)
            split = any(t.kind == W for t in order)
            live, most = set(), 0
            for t in order:
                if t.stage == first and t.kind == F:
                    live.add(t.mb)
                elif t.stage == first and t.kind == (W if split else B):
                    live.discard(t.mb)
                most = max(most, len(live))
            out[r] = (max(out[r][0], held), max(out[r][1], most))
    return out


def memory_lines(res: dict) -> list[str]:
    """Per phase and row held to a PyTorch schedule's bytes (:data:`benchmarks.systems.PEERS`)
    whose task records were kept: each rank's budget, the most bytes held and microbatches in
    flight in its timed rounds (:func:`held_peaks`)."""
    from .report_peers import _memory
    from .systems import PEERS, peer_default

    lines = []
    for ph in res["phases"]:
        for label, p in PEERS.items():
            row, budget = peer_default(label), _memory(ph, p["torch"])
            steps = (ph.get("recorded") or {}).get(row)
            if not steps or not budget:
                continue
            sb = [b[p["placement"]] for b in res["virtual_stage_bytes"]]
            peaks = held_peaks(steps, sb, 2, p["placement"])
            lines.append(f"{ph['name']}, {row}: per rank budget / held at most (ratio) / in flight at most: " + "; ".join(
                f"{b / 1024:.0f} / {h / 1024:.0f} KiB ({h / b:.3f}) / {n}" for b, (h, n) in zip(budget, peaks)))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from rrfp import _json as strict_json

    from .report import calibration_targets

    ap = argparse.ArgumentParser(prog="python -m benchmarks.report_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-json", required=True, metavar="FILE", help="raw results of `rrfp bench --json`")
    ap.add_argument("--settings", default="", help="comma-separated settings (default: every one recorded)")
    ap.add_argument("--rows", action="store_true", help="each rrfp row's figures too")
    ap.add_argument("--memory", action="store_true",
                    help="each row held to a schedule's bytes: its budget and the bytes it held, per rank")
    args = ap.parse_args(argv)
    try:
        results = strict_json.restore(json.loads(Path(args.from_json).read_text()))
        compare = results["compare"]
        if not isinstance(compare, dict):
            raise TypeError("'compare' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"report_fit: error: --from-json {args.from_json}: not the raw results of a benchmark run ({e})",
              file=sys.stderr)
        return 2
    if not compare:
        print(f"report_fit: error: --from-json {args.from_json}: no comparison settings recorded "
              "(expected the raw results of `rrfp bench --compare --json`)", file=sys.stderr)
        return 2
    wanted = [s for s in args.settings.split(",") if s] or list(compare)
    missing = [s for s in wanted if s not in compare]
    if missing:
        print(f"report_fit: error: --settings {missing[0]!r}: not in {args.from_json} (has {', '.join(compare)})",
              file=sys.stderr)
        return 2
    refit = 0
    for name in wanted:
        try:
            phases = check(compare[name])
            held = memory_lines(compare[name]) if args.memory else []
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            # A setting's result without the fields a run records: one line, not a traceback.
            print(f"report_fit: error: --from-json {args.from_json}: setting {name!r}: not the raw results "
                  f"of a benchmark run ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        rows = calibration_targets({name: phases})
        for target, measured, verdict, _ in rows:
            print(f"{target}: {measured} [{verdict.strip('*')}]")
        for ph, s in phases.items():
            if any(r[0].startswith(f"{name}, {ph}: ") for r in rows):
                refit += 1
            else:  # nothing to count here: say why rather than print nothing
                print(f"{name}, {ph}: not refit ({why_not_refit(s)})")
            same = same_schedule(s)
            if same:
                print(f"{name}, {ph}: rows that ran strict 1F1B's schedule, real / strict-1f1b's real: "
                      + ", ".join(f"{n} {v:.3f}" for n, v in same.items()))
            if args.rows:
                print(f"{name}, {ph}:")
                print("\n".join(row_lines(s)))
        for line in held:
            print(f"{name}, {line}")
    if not refit:
        print(f"report_fit: error: --from-json {args.from_json}: no phase of {', '.join(wanted)} could be refit",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
