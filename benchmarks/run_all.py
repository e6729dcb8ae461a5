"""Run every benchmark and write ``BENCHMARKS.md`` (one command regenerates it).

Usage::

    python benchmarks/run_all.py --out BENCHMARKS.md      # full run, ~10 minutes on 2 cores
    python benchmarks/run_all.py --quick                  # CI smoke run (small sizes, few rounds)
    rrfp bench --all --out BENCHMARKS.md                  # the same through the rrfp CLI

Exit status: 0 when every benchmark ran (missed targets are reported, not failed), 1 when a
benchmark failed (a rank died or timed out, or gradients differ between systems).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Torch-free: compare, micro and report import torch, so run and render import them, after
# options_error has checked the options.
from benchmarks import report_peers, sim_targets  # noqa: E402
from benchmarks import settings as setting_table  # noqa: E402
from rrfp import _json as strict_json  # noqa: E402
from rrfp.bench_cli import add_options  # noqa: E402

PARTS = ("compare", "micro", "sim_targets")
CANDIDATES_TITLE = "Candidate hints at equal memory (`--candidates`)"
SWEEP_MICROBATCHES = (8, 16, 32, 64, 128)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="benchmarks/run_all.py", description=__doc__.split("\n\n")[0])
    add_options(p)
    return p


MAX_TIMEOUT_S = 86400.0
"""Longest ``--timeout`` (one day): a bound for a hang, never reached by a healthy run."""


def options_error(args: argparse.Namespace) -> str | None:
    """One line naming a bad option, or None."""
    names = [s for s in args.settings.split(",") if s]
    bad = [s for s in names if s not in setting_table.SETTINGS]
    if bad or not names:
        return f"--settings {args.settings!r}: expected a comma-separated subset of {', '.join(setting_table.SETTINGS)}"
    from rrfp.scheduler.hints import resolve_hint
    from rrfp.scheduler.tasks import Placement

    if getattr(args, "candidates", None) is not None and not _candidates(args):
        return f"--candidates {args.candidates!r}: expected one or more hint names, comma-separated"
    for flag, hints in (("--hint", [] if args.hint is None else [args.hint]), ("--candidates", _candidates(args))):
        for h in hints:
            if h == "auto":
                return (f"{flag} 'auto': auto chooses among hints on a job's own steps, more steps than a "
                        "phase has; name the hints to measure (e.g. strict-split,wfloat,bfw-mem)")
            try:
                resolve_hint(h, Placement(4), 16)
            except ValueError as e:
                return f"{flag} {h!r}: {e}"
            except OSError as e:  # a CSV hint's file: missing, a folder, unreadable
                return f"{flag} {h!r}: cannot read {e.filename or h}: {e.strerror or e}"
    if args.rounds is not None and args.rounds < 1:
        return f"--rounds {args.rounds}: expected at least 1"
    # Not `<= 0`: nan compares false with everything and would pass; inf and huge values
    # overflow the waits (threading and select take at most ~292 years, time.monotonic() + inf).
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        return f"--timeout {args.timeout}: expected a positive number of seconds, at most {MAX_TIMEOUT_S:.0f}"
    return None


def _candidates(args: argparse.Namespace) -> list[str]:
    return [h for h in (getattr(args, "candidates", "") or "").split(",") if h]


START_S, START_S_PER_RANK = 6.0, 0.5
"""Seconds on 2 quiet cores before a setting's first round: importing torch and the benchmarks
once (:mod:`benchmarks.launcher`'s starter), then per rank its fork, process group and pipelines."""
FIXED_S = {"probe": 15.0, "micro": 40.0, "sim_targets": 45.0, "ideal": 30.0}
QUICK_FIXED_S = {"micro": 20.0, "sim_targets": 20.0}


def estimate_seconds(args: argparse.Namespace, parts: Sequence[str], settings: Sequence[str]) -> tuple[float, dict]:
    """A rough wall time of the run on 2 quiet cores (seconds, and per part), from each
    setting's rank count, systems, rounds and ``step_s`` (a system's step time there, measured)
    and the other parts' usual times; the report lists what each part really took."""
    out: dict[str, float] = {}
    fixed = QUICK_FIXED_S if args.quick else FIXED_S
    if "compare" in parts:
        if not args.quick:
            out["probe"] = fixed["probe"]
        for name in settings:
            cfg = setting_table.setting_config(name, quick=args.quick, rounds=args.rounds, candidates=_candidates(args))
            rounds = sum(2 + ph["rounds"] for ph in cfg["phases"])
            out[name] = START_S + START_S_PER_RANK * cfg["n_ranks"] + rounds * len(cfg["systems"]) * cfg["step_s"]
        if not args.no_sim and not args.quick:
            out["ideal"] = fixed["ideal"]
    for part in ("micro", "sim_targets"):
        if part in parts:
            out[part] = fixed[part]
    return sum(out.values()), out


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _simulate(setting: dict, level: str, n_microbatches: int | None = None) -> dict | None:
    """The simulator's ideal speedups (no runtime overhead, no communication) for a setting's
    calibrated costs, through ``rrfp simulate`` (None if it is unavailable)."""
    return _sim_speedups(setting, level, [], "bf,bfw,strict-1f1b,strict-gpipe", n_microbatches)


def _sim_speedups(setting: dict, level: str, extra: list[str], hints: str,
                  n_microbatches: int | None = None) -> dict | None:
    """``rrfp simulate``'s speedups of ``hints`` over strict 1F1B for a setting's calibrated
    costs at jitter ``level`` (``extra``: more flags), or None if it is unavailable."""
    cal, cfg = setting["calibration"], setting["config"]
    M = n_microbatches or cfg["n_microbatches"]
    tmp = tempfile.TemporaryDirectory(prefix="rrfp-bench-sim-")  # removed on every path, a failure's too
    out = Path(tmp.name) / "sim.json"
    cmd = [sys.executable, "-m", "rrfp", "simulate", "-p", str(cfg["n_ranks"]), "-m", str(M),
           "--cost-f", ",".join(f"{c['F']:.6f}" for c in cal), "--cost-b", ",".join(f"{c['B']:.6f}" for c in cal),
           "--jitter", level, "--hints", hints, "--baseline", "strict-1f1b", "--steps", "20",
           "--seed", str(cfg["seed"]), "--json", str(out), *extra]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        data = json.loads(out.read_text())
        # auto's row is labelled with the hint it kept ("auto (strict-split)"): keyed "auto" too.
        speedups = {r["hint"]: r["speedup"] for r in data["runs"]}
        speedups.update({h.split(" (", 1)[0]: v for h, v in speedups.items() if h.startswith("auto (")})
        return speedups
    except Exception:  # noqa: BLE001 - the simulator is context, not a benchmark
        return None
    finally:
        tmp.cleanup()


def ideal(setting: dict) -> dict[str, dict]:
    """Per phase, the simulator's ideal (the same arbiter on the setting's calibrated costs, no
    runtime overhead) of the default hint: at 1F1B's memory over strict 1F1B (``1f1b``) and
    unlimited over strict GPipe (``gpipe``), with the setting's variability (injected compute
    jitter, message jitter, or image counts), and the ``rrfp simulate`` flags that give it."""
    cfg = setting["config"]
    hint = setting.get("default_hint", "bf")
    extra: list[str] = []
    if cfg.get("comm"):
        extra += ["--comm-jitter", cfg["comm"]]
    if cfg.get("workload") == "multimodal":
        extra += ["--images", "randint:0,6", "--samples-per-mb", str(cfg["batch_size"] // cfg["n_microbatches"]),
                  "--encoder-stages", "1"]
    out = {}
    for ph in setting["phases"]:
        a = _sim_speedups(setting, ph["level"], [*extra, "--limit", "1f1b"], f"{hint},strict-1f1b")
        b = _sim_speedups(setting, ph["level"], extra, f"{hint},strict-gpipe,strict-1f1b")
        out[ph["name"]] = {
            "1f1b": a.get(hint) if a else None,
            "gpipe": b[hint] / b["strict-gpipe"] if b and b.get("strict-gpipe") else None,
            "flags": " ".join(["--jitter", ph["level"], *extra]),
        }
    return out


def rerender(args: argparse.Namespace) -> int:
    """Write the report of an earlier run from its raw results (``--from-json``)."""
    try:
        results = strict_json.restore(json.loads(Path(args.from_json).read_text()))
        if not isinstance(results, dict):
            raise TypeError(f"a JSON {type(results).__name__}, expected an object")
        text = render(results, args, command=results.get("command"))
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:  # LookupError: a key or an index
        print(f"rrfp bench: error: --from-json {args.from_json}: not the raw results of a benchmark run ({e})",
              file=sys.stderr)
        return 2
    return _publish(text, results, args, f"from {args.from_json}")


GENERATED = ("Machine", "Failures", "Targets", "The default hint at equal memory", CANDIDATES_TITLE,
             report_peers.PEERS_TITLE, report_peers.RANKS_TITLE,
             "rrfp against PyTorch's pipeline schedules", "Micro-benchmarks of the runtime", sim_targets.TITLE)


def kept_sections(old: str) -> str:
    """The sections of an existing report that this command does not write (engineers'
    hand-measured sections appended at the end): from the first ``## `` heading, after the
    generated ones, whose title is not one this command writes."""
    lines = old.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("## ") and line[3:].strip() not in GENERATED:
            return "\n" + "".join(lines[i:])
    return ""


def _publish(text: str, results: dict, args: argparse.Namespace, how: str) -> int:
    """Write the report to ``--out`` (or print it); the exit status says whether a part failed."""
    if args.out:
        out = Path(args.out)
        if out.exists():
            text = text.rstrip() + "\n" + kept_sections(out.read_text())
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
        _log(f"wrote {args.out} ({how})")
    else:
        print(text)
    return 1 if results.get("errors") else 0


def run(args: argparse.Namespace) -> int:
    from benchmarks import compare, micro, report

    if args.from_json:
        return rerender(args)
    parts = [p for p in PARTS if getattr(args, p)] or list(PARTS)
    if args.all:
        parts = list(PARTS)
    settings = [s for s in args.settings.split(",") if s]
    t_start = time.monotonic()
    results: dict[str, Any] = {"machine": report.machine_info(), "quick": args.quick, "compare": {}, "micro": None,
                               "errors": [], "command": _command(args)}

    timings: dict[str, float] = results.setdefault("timings", {})
    est, est_parts = estimate_seconds(args, parts, settings)
    _log(f"estimated {est:.0f} s on 2 quiet cores ({', '.join(f'{k} ~{v:.0f} s' for k, v in est_parts.items())}); "
         "each part's time is logged as it ends and listed in the report")

    def attempt(label: str, fn):
        # A failed part is reported (and fails the run) without losing the parts that ran.
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - BenchError (ranks, gradients) or a runtime error
            msg = f"{label}: {type(e).__name__}: {e}"
            results["errors"].append(msg)
            print(f"benchmark failed: {msg}", file=sys.stderr, flush=True)
            return None
        finally:
            timings[label] = time.monotonic() - t0
            _log(f"{label}: {timings[label]:.0f} s")
            if args.json:  # keep what ran so far
                Path(args.json).write_text(strict_json.dumps(results, indent=1, default=str))

    if "compare" in parts and not args.quick:  # a fact of the installed torch, not a timing
        _log("probing PyTorch pipelining with a changing sequence length")
        results["probe"] = attempt("probe", compare.probe_static_shapes)
    if "compare" in parts:
        for name in settings:
            cfg = compare.setting_config(name, quick=args.quick, seed=args.seed, rounds=args.rounds, hint=args.hint,
                                         candidates=_candidates(args))
            _log(f"setting {name}: {cfg['title']} ({len(cfg['phases'])} phases, {len(cfg['systems'])} systems)")
            res = attempt(f"setting {name}", lambda: compare.run_setting(cfg, timeout=args.timeout))
            if res is not None:
                # The cores the setting's rank processes shared (report_peers.run_cores): an offline
                # refit on another machine must not take that machine's count.
                res["cores"] = results["machine"]["nproc"]
                results["compare"][name] = res
    if not args.no_sim:  # in-process simulations of the zero-bubble and many-rank rows (seconds)
        for name, res in results["compare"].items():
            res["predicted"] = attempt(f"predictions of {name}", lambda: report_peers.predictions(res))
            res["sim_model"] = attempt(f"calibrated model of {name}", lambda: report_peers.models(res))
    if "micro" in parts:
        _log("micro-benchmarks")
        results["micro"] = attempt("micro-benchmarks", lambda: micro.run_micro(quick=args.quick, timeout=args.timeout,
                                                                                 hint=args.hint))
    if "sim_targets" in parts:
        # After the timed parts: the suite keeps one core busy for about a minute.
        _log("simulator and training targets")
        results["sim_targets"] = sim_targets.run(args.quick, args.timeout, attempt)
    if not args.no_sim and not args.quick:
        results["ideal"] = attempt("ideal speedups (rrfp simulate)",
                                   lambda: {name: ideal(st) for name, st in results["compare"].items()}) or {}
        if "jitter4-m64" in results["compare"]:
            st = results["compare"]["jitter4-m64"]
            results["sim"] = {"jitter4-m64": {"J2": _simulate(st, "J2")}}
    results["machine"]["loadavg_end"] = report.machine_info()["loadavg"]
    results["seconds"] = time.monotonic() - t_start
    results = json.loads(json.dumps(results))  # one form for keys (str), whatever produced them
    text = render(results, args)
    if args.json:
        Path(args.json).write_text(strict_json.dumps(results, indent=1))
    return _publish(text, results, args, f"{results['seconds']:.0f} s in all")


def _ok(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _command(args: argparse.Namespace) -> str:
    """The flags that shaped this run, as ``rrfp bench`` takes them (``benchmarks/run_all.py``
    takes the same)."""
    flags = [f"--{p.replace('_', '-')}" for p in PARTS if getattr(args, p, False) and not getattr(args, "all", False)]
    if args.quick:
        flags.append("--quick")
    default_settings = build_parser().get_default("settings")
    if args.settings != default_settings:
        flags.append(f"--settings {args.settings}")
    if args.rounds is not None:
        flags.append(f"--rounds {args.rounds}")
    if args.seed:
        flags.append(f"--seed {args.seed}")
    if args.no_sim:
        flags.append("--no-sim")
    if args.hint:
        flags.append(f"--hint {shlex.quote(args.hint)}")
    if _candidates(args):
        flags.append(f"--candidates {shlex.quote(','.join(_candidates(args)))}")
    if args.out:
        flags.append(f"--out {shlex.quote(args.out)}")
    if args.json:
        flags.append(f"--json {shlex.quote(args.json)}")
    return " ".join(["rrfp bench", *flags])


def _raw_numbers(command: str) -> str:
    """The header's sentence on the raw results: where this run wrote them (its ``--json``),
    or how to get them."""
    try:
        words = shlex.split(command)
    except ValueError:  # an older run's command line, unquoted
        words = command.split()
    if "--json" in words[:-1]:
        path = shlex.quote(words[words.index("--json") + 1])
        return f"Raw numbers: `{path}`; `rrfp bench --from-json {path}` renders this report again from them."
    return "Raw numbers: add `--json results.json`; `--from-json results.json` renders this report again from them."


def render(results: dict, args: argparse.Namespace, command: str | None = None) -> str:
    from benchmarks import report

    m = results["machine"]
    command = command or _command(args)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` (the same as `python benchmarks/run_all.py` with those "
        f"flags) in {results['seconds']:.0f} s. `--quick` runs the same code at small sizes for CI. "
        + _raw_numbers(command),
        "",
        *([f"Time per part (s, wall): {', '.join(f'{k} {v:.0f}' for k, v in results['timings'].items())}.", ""]
          if results.get("timings") else []),
        "## Machine",
        "",
        f"- {m['nproc']} CPUs ({m['cpu']}), {m['platform']}",
        f"- Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, pyzmq {m['pyzmq']}",
        f"- {m['date']}; load average {m['loadavg'][0]:.2f} at the start, "
        f"{m.get('loadavg_end', m['loadavg'])[0]:.2f} at the end. Every comparison is a ratio of runs "
        "alternated in one run and paired round by round, which cancels the machine's drift but not all of "
        "its noise.",
        "",
    ]
    if results.get("errors"):
        lines += ["## Failures", "", "This run is incomplete; these parts failed:", ""]
        lines += [f"- `{e.splitlines()[0][:400]}`" for e in results["errors"]] + [""]
    summaries = {}
    setting_text = []
    for name, res in results["compare"].items():
        text, summ = report.render_setting(res)
        summaries[name] = summ
        setting_text.append(text)
    ideal = results.get("ideal") or {}
    rows = report.targets(summaries, results.get("micro"), ideal)
    rows += report.calibration_targets(summaries)
    peer_lines, peer_targets = report_peers.render(results["compare"], bool(results.get("quick")))
    rows += peer_targets
    if results.get("quick"):  # one timed round at small sizes decides nothing (as sim_targets.target_rows)
        rows = [[t, f, "- (quick)", i] for t, f, _, i in rows]
    all_grads = [ph["worst_grad_ratio"] for res in results["compare"].values() for ph in res["phases"]]
    if all_grads:
        n_checks = sum(len(ph["rounds"]) * len(ph["rounds"][0]["systems"]) for res in results["compare"].values()
                       for ph in res["phases"])
        rows.append(["gradients equal across all systems after every benchmarked step (rtol 1e-5, atol 1e-6)",
                     f"{n_checks} checks, worst {max(all_grads):.3f} of tolerance", _ok(max(all_grads) <= 1), "-"])
    if results.get("sim_targets"):
        rows += [[t, f, v, "-"] for t, f, v in sim_targets.target_rows(results["sim_targets"])]
    if rows:
        lines += ["## Targets", "", report._table(["target", "measured", "verdict", "simulator: ideal; calibrated"], rows), "",
                  TARGETS_NOTE, ""]
    eq = report.equal_memory(summaries, ideal)
    if eq:
        lines += ["## The default hint at equal memory", "",
                  "Speedup of rrfp's default hint with `memory_budget` set to the bytes PyTorch's schedule holds on "
                  "each rank, over that schedule (median over rounds of the paired ratio, quartiles of the "
                  "per-round ratios), the peak saved activations both measured on each rank, and the simulator's "
                  "ideal for the same setting (`rrfp simulate` on the setting's calibrated costs, with "
                  "`--limit 1f1b` for 1F1B's memory, unlimited over `strict-gpipe` for GPipe's) beside the "
                  "calibrated simulator's speedup of the same two rows (the run's own delays; PyTorch's schedule "
                  "as its order on rrfp's calibrated model; the model under each setting's table).", ""]
        lines += [report._table(["setting", "phase", "rows", "speedup", "rrfp peak MiB per rank",
                                 "torch peak MiB per rank", "simulator: ideal; calibrated"], eq), ""]
        flags = [f"- {name}, {ph}: `rrfp simulate -p {results['compare'][name]['config']['n_ranks']} -m "
                 f"{results['compare'][name]['config']['n_microbatches']} --cost-f ... --cost-b ... {v['flags']} "
                 f"--steps 20 --hints <default>,strict-1f1b --limit 1f1b`"
                 for name, by in ideal.items() for ph, v in by.items()]
        if flags:
            lines += ["The simulator runs behind the ideal column (costs: each setting's calibration below):", "",
                      *flags, ""]
    lines += peer_lines
    cand = report.candidates(summaries, results)
    if cand:
        lines += [f"## {CANDIDATES_TITLE}", "",
                  "Each candidate hint ran at 1F1B's and GPipe's memory budgets beside the default hint, in the "
                  "same rounds (same batches, delays and rotation): speedups are medians of the per-round paired "
                  f"ratios, with their quartiles and n. Load average {m['loadavg'][0]:.2f} at the start, "
                  f"{m.get('loadavg_end', m['loadavg'])[0]:.2f} at the end.", "",
                  report._table(["setting", "phase", "memory", "candidate", "default vs torch", "candidate vs torch",
                                 "candidate vs default"], cand), ""]
    if results.get("sim"):
        lines += ["The simulator's ideal (`rrfp simulate` with each setting's calibrated per-stage costs, no "
                  "runtime overhead, no communication time, 20 steps), speedup over strict 1F1B:", ""]
        sim_rows = [[name, lv, *[f"{v[h]:.2f}x" if v and h in v else "-" for h in ("bf", "bfw", "strict-gpipe")]]
                    for name, by_level in results["sim"].items() for lv, v in by_level.items()]
        lines += [report._table(["setting", "jitter", "bf", "bfw", "strict-gpipe"], sim_rows), ""]
    reading = report.interpret(summaries, results.get("sim"))
    if reading:
        lines += ["Reading the comparison: the same runtime with and without readiness, and the same fixed "
                  "order in both runtimes (paired medians):", "", *reading, ""]
    if results["compare"]:
        lines += ["## rrfp against PyTorch's pipeline schedules", "", METHOD, ""]
        lines += setting_text
        probe = results.get("probe")
        if probe:
            lines += ["### PyTorch's pipelining and a changing sequence length", "",
                      "A 2-rank `Schedule1F1B` stepped with sequence length 16, then with a longer or a "
                      "shorter one (what each rank reported):", ""]
            for label, outs in probe.items():
                lines += [f"- {label}:"] + [f"  - `{o}`" for o in outs]
            lines += ["", PROBE_NOTE, ""]
    if results.get("micro"):
        lines += ["## Micro-benchmarks of the runtime", "", report.render_micro(results["micro"])]
    if results.get("sim_targets"):
        lines += ["", *sim_targets.render(results["sim_targets"])]
    return "\n".join(lines).rstrip() + "\n"


TARGETS_NOTE = """\
How to read the targets:

- They are rrfp's goals for the real runtime, not figures PyTorch claims. Each compares rrfp's
  default hint (`auto`, the default of `rrfp.Pipeline`, `LocalPipeline` and `rrfp train`: the hint it kept
  is named in each row; `--hint` names another) with a PyTorch schedule **at equal memory**:
  rrfp gets `memory_budget` = the bytes that schedule's order holds on each rank for the setting's
  microbatches (per-microbatch activation bytes measured on the rank's stage, as rrfp's own budget
  measures them; `rrfp.scheduler.memory.order_peak_bytes` over the schedule's order). The peak
  saved activations both systems then measure on each rank are in the tables below.
- The simulator's ideal is the same arbiter on the setting's calibrated task costs with no runtime
  overhead, no communication time and one processor per rank. Where a setting runs more rank
  processes than this machine has cores (4, 8 or 16 ranks on 2), a task's time depends on what
  the other ranks run; the ideal is the reference for the setting, not an upper bound there.
- The calibrated figure beside it is the simulator on the model of what this run's runtime paid
  (`rrfp.sim.calibration`, read off the strict rows' task records in the same timed rounds, per
  placement: strict 1F1B's for one stage per rank, the strict Int1F1B and IntZB orders' for
  interleaved rows, the strict ZBV and DualPipeV orders' for V rows: each task's own cost in
  place, the runtime's time per task, per received input, per message and per step, half of a
  message's time on its receiving rank; where each rank has a core, how the activations a rank
  holds slow its tasks, read off the run's other rows; each round the median over one simulation per recorded
  step, at that step's own task costs and message times; docs/simulator.md), with the very
  delays the run injected, round by round; a
  PyTorch schedule is predicted as its order run strictly on that model (PyTorch's own runtime
  costs are not modelled, so the runtime's share of a gain over PyTorch is not in it). The
  settings' tables give each row's simulated step time and real / simulated.
- Overhead: the runtime's CPU time per task in one process (`LocalPipeline`, 4 ranks on one event
  loop, do-nothing stages, messages through the codec as between processes) minus the same tasks
  run by hand; the median of 5 runs (each the fastest of 20 steps)."""


METHOD = """\
How these numbers are made (`benchmarks/compare.py`):

- One set of rank processes (gloo default group; rrfp's pipelines use ZeroMQ endpoints exchanged
  through the same store) holds every system side by side, each with its own copy of the same
  initial weights. Each round gives every system the same batch, microbatches, step id and
  injected delays; the systems' order rotates from round to round, so the machine's drift
  cancels out of the paired ratios. The rows a target compares (the default hint at a
  schedule's memory, that PyTorch schedule, candidate hints) run side by side, and every other
  round runs the order backwards, so each runs first in half the rounds
  (`benchmarks.harness.round_order`). Round 0 warms up (PyTorch infers its shapes), round 1
  measures activation memory (a row held to a schedule's measured bytes runs after that
  schedule and gets them from then on), later rounds are timed. The optimizer never steps.
- Step time: each rank's time from a barrier to the end of its `step()`; a round's step time is
  the slowest rank's. Speedup of A over B: the median over rounds of `t_B / t_A`, with the
  quartiles of those per-round ratios and a 95% percentile-bootstrap interval of their median
  (how far the median of this many rounds moves between runs: a verdict whose interval holds
  the threshold is decided by noise).
- Injected jitter: the paper's J0-J3 model (`rrfp.sim.jitter`) keyed by (seed, step, stage,
  microbatch, kind), injected by a wrapper around each stage module: a sleep before the forward,
  and a custom autograd Function whose backward sleeps. The wrapper reads the microbatch from an
  int64 microbatch-id tensor carried through the stages as an extra stage input and output (both
  rrfp and PyTorch's pipelining pass tuples of mixed-dtype tensors). The model's running average
  `e` is fixed per (stage, kind) from a calibration of the base compute, so every system sees
  identical delays; with two virtual stages per rank each gets half of its rank's delay, so each
  rank's injected total is the same in every system (checked every round; message delays, keyed
  by the sending stage, among the systems with the same split into stages).
- Bubble per rank: 1 - busy / step time, busy being the time in compute calls (rrfp: task time
  from its `StepStats`, which includes encoding outputs; PyTorch: `forward_one_chunk`,
  `backward_one_chunk`, `backward_weight_one_chunk` and the loss). Injected delays count as busy.
- Peak saved activations: the most bytes of tensors autograd held for backward at once on the
  rank (`saved_tensors_hooks`, storages counted once, parameters excluded), in round 1.
  Peak in-flight: rrfp's most microbatches forwarded and not yet backwarded (`-` for PyTorch).
- Gradients: after every step, every system's gradients are gathered into one full-model vector
  and compared with the round's first system (and in round 0 with a single-process model):
  fp32 `rtol=1e-5, atol=1e-6`, or the benchmark fails naming the system and parameter.
- Loss: the mean over all tokens of the batch (rrfp: `lm_loss` weighted by `count_tokens`;
  PyTorch: summed cross entropy over the batch's token count, `scale_grads=False`).
- Memory-matched rows (`rrfp default, 1F1B memory` / `GPipe memory`): before the first round each
  rank runs its stage's forward once per distinct microbatch shape of every round under a
  saved-tensor hook (storages counted once, parameters excluded: what rrfp's budget counts) and
  takes the most bytes the schedule's order (`one_f_one_b` / `gpipe` of `rrfp.scheduler.schedules`,
  PyTorch's orders) holds with those sizes: that is the rank's `memory_budget`. The peak columns
  are measured separately, by the activation meter, for every system alike.
- Message delays (`comm4`): every activation and gradient message gets a delay keyed by (seed, step,
  sending stage, microbatch, direction), the draw of `rrfp simulate --comm-jitter J2` (a hit with
  probability p, then 10 ms x a x (0.5 + U)), and may not be consumed before its send time plus
  that delay. The send time travels as a float64 stamp tensor beside the activation (the clock
  when the forward ended) and as that stamp's gradient (the clock when the next stage's backward
  ended). Both systems run the same stage wrapper, which sleeps until the delivery time before a
  forward and, first thing in the backward, before a backward: PyTorch's schedules wait on each
  receive right before the task it feeds, so for them this is the delayed delivery. rrfp's inbox
  holds each arrival until the same delivery time before the arbiter learns of it
  (`RankRuntime.inbox.hold`), so a late input is not ready and other ready tasks run; when the
  wrapper runs, its sleep is zero. The wrapper sums every delay it draws, and the run fails unless
  the sums are equal for every system on every rank and round.
- Multimodal (`multimodal4`): `rrfp/model/multimodal.py` on `rrfp/data/digits.py` captions; every
  microbatch holds one 6-image sample (so the decoder's shapes are fixed, as PyTorch's receive
  buffers need) and samples of 0-6 images; the padded images are packed on stage 0 before the
  encoder, in both systems alike, so encoder work follows the microbatch's image count."""

PROBE_NOTE = """\
PyTorch's `PipelineStage` infers shapes on the first step and preallocates its receive buffers
from them, so every later microbatch must have exactly those shapes: a longer one aborts the
receiving process inside gloo, a shorter one is received into the old buffer and computed at
the old shape (here the loss's shape check catches it). A user of PyTorch's schedules therefore
pads every microbatch to one fixed length; rrfp sends each message with its own shapes, so its
users pad each microbatch only to its own longest sample. The variable-length rows above compare
exactly that: what a user of each would run, same samples, same gradients."""


def main(argv: Sequence[str] | None = None) -> int:
    from rrfp.bench_cli import run as bench_run  # the same checks and stop (SIGTERM, Ctrl-C) as rrfp bench
    from rrfp.cli import UsageError

    args = build_parser().parse_args(argv)
    try:
        return bench_run(args)
    except UsageError as e:
        print(f"run_all.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
