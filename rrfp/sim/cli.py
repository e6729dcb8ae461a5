"""``rrfp simulate``: discrete-event simulation of a pipeline under one or more hints.

Examples::

    rrfp simulate --ranks 8 --microbatches 32 --hints bf,bfw,strict-1f1b --jitter J2
    rrfp simulate --ranks 4 --costs profile.json --limit 1f1b --trace out/
    rrfp simulate --sweep --depths 4,8,16 --mb-per-stage 1,2,4 --jitter-levels J0,J2 \\
        --imbalance 1,2 --out sweep

The guide is docs/simulator.md. No torch is imported.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import asdict, replace
from typing import Any

from .. import _json as strict_json
from ..errors import UsageError
from ..plugins import add_flag as add_plugin_flag, load as load_plugins
from ..resources import doc_path
from ..scheduler.registry import forms as hint_forms
from .auto import AUTO, simulate_auto
from .trial import EXTRA_ROUNDS, TRIAL_ROUNDS, decided_on, margin, medians
from .compare import SimConfig, compare, default_baseline, sweep, sweep_table
from .costs import MAX_BYTES, MAX_SECONDS, CostModel, StageCost, load_costs, short
from .duration import Dist
from .engine import DeadlockError
from .jitter import parse_jitter
from .metrics import format_csv, format_markdown, format_text, table_rows, to_json
from .modes import check_flags, check_study, suite_tasks, sweep_tasks


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand to ``rrfp``'s argparse subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline under hints (no GPUs, no processes)",
        description="Discrete-event simulation of a pipeline driving the real scheduler. "
        f"Times in seconds, sizes in bytes. Guide: {doc_path('simulator.md')}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("pipeline")
    g.add_argument("--pp", "-p", "--ranks", dest="ranks", type=int, default=4, help="pipeline ranks (PP degree)")
    g.add_argument("-v", "--virtual", type=int, default=1, help="virtual stages per rank")
    g.add_argument("--placement", choices=("loop", "v"), default="loop", help="stage placement")
    g.add_argument("-m", "--microbatches", type=int, default=None, help="microbatches per step; without -m, 4 x --ranks")
    g.add_argument("--steps", type=int, default=1, help="training steps back to back")
    g.add_argument("--step-overhead", type=float, default=0.0, help="seconds between a rank's steps (optimizer)")

    g = p.add_argument_group("scheduling")
    g.add_argument("--hint", action="append", default=[], help="a hint (repeatable): auto, or " + hint_forms())
    g.add_argument("--hints", default=None, help="comma-separated hints, side by side; without --hint/--hints, bf,bfw "
                   "(and the baseline)")
    add_plugin_flag(g)
    g.add_argument("--backpressure", choices=["admission", "completion-order"], default="admission",
                   help="with virtual stages: admission (the limit counts microbatches in flight) or "
                   "completion-order (RRFP App. C.2)")
    g.add_argument("--inflight-limit", "--limit", dest="limit", default="32", help="in-flight limit: an integer, or 1f1b (1F1B's p - r per rank)")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="activation bytes per rank: a size (64MiB, 1.5GB, 4096) or 1f1b / gpipe (what that schedule "
                   "holds on each rank with these sizes); needs --act-bytes or a cost file with act_bytes")
    g.add_argument("--baseline", default="auto",
                   help="hint the speedups are over (added to the table when missing): a hint name, none, or auto: "
                   "strict-1f1b with one stage per rank, strict-interleaved-1f1b with virtual stages in the loop "
                   "placement, strict-zb-v with 2 virtual stages in the v placement (none with other v placements)")

    g = p.add_argument_group("task costs (seconds per microbatch)")
    g.add_argument("--costs", default=None, help="cost file: .json profile (rrfp train) or .toml")
    g.add_argument("--cost-f", default=None, help="forward; one value, or one per stage (a,b,...); without it, 0.010")
    g.add_argument("--cost-b", default=None, help="full backward; one value, or one per stage (a,b,...); without it, I + W if both are given, else 0.020")
    g.add_argument("--cost-i", default=None, help="split backward, input gradient; one value, or one per stage (a,b,...); without it, B - W, or B/2")
    g.add_argument("--cost-w", default=None, help="split backward, weight gradient; one value, or one per stage (a,b,...); without it, B - I, or B/2")
    g.add_argument("--act-bytes", default=None, help="activation bytes one microbatch holds on a stage, a size (4096, 64MiB, 1.5GB), or one per stage")
    g.add_argument("--msg-bytes", default=None, help="bytes of a stage's output message, a size, or one per stage; without it, --act-bytes")

    g = p.add_argument_group("variability (all seeded)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--jitter", default="J0", help="injected compute jitter: J0..J3, or p,b,a (b in seconds)")
    g.add_argument("--noise", type=float, default=0.0, help="sigma of lognormal compute noise (mean 1)")
    g.add_argument("--seqlen", default=None, help="per-microbatch length ratio, e.g. lognormal:0.4, uniform:0.5,1.5")
    g.add_argument("--images", default=None, help="per-sample image count, e.g. poisson:2, randint:0,4")
    g.add_argument("--samples-per-mb", type=int, default=4, help="samples per microbatch (image draws)")
    g.add_argument("--encoder-stages", type=int, default=1, help="leading stages forming the image encoder")
    g.add_argument("--encoder-scale", type=float, default=1.0, help="encoder stages' cost multiplier (imbalance)")
    g.add_argument("--straggler", action="append", default=[], metavar="RANK:FACTOR",
                   help="slow rank RANK down by FACTOR (repeatable)")

    g = p.add_argument_group("communication")
    g.add_argument("--latency", type=float, default=0.0, help="seconds per message")
    g.add_argument("--bandwidth", type=float, default=math.inf, help="bytes per second (inf: free)")
    g.add_argument("--comm-noise", type=float, default=0.0, help="sigma of lognormal message noise")
    g.add_argument("--comm-jitter", default="J0", help="injected message jitter level (J0..J3 or p,b,a)")

    _add_study_flags(p)
    p.set_defaults(func=run)


def _add_study_flags(p: argparse.ArgumentParser) -> None:
    """``rrfp simulate``'s outputs, sweep and scenario-suite flags."""
    g = p.add_argument_group("outputs")
    g.add_argument("--csv", default=None, help="write the table as CSV")
    g.add_argument("--json", default=None, help="write every run's details as JSON")
    g.add_argument("--markdown", default=None, help="write the table as markdown")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="write <hint>.json (Chrome trace) and <hint>.png (Gantt) per hint")

    g = p.add_argument_group("sweep (the paper's scaling study)")
    g.add_argument("--sweep", action="store_true", help="sweep the axes below instead of one run")
    g.add_argument("--depths", default="4,8,16", help="pipeline depths (ranks)")
    g.add_argument("--mb-per-stage", default="1,2,4", help="microbatches per stage (M = value x ranks)")
    g.add_argument("--jitter-levels", default="J0,J1,J2,J3", help="jitter levels")
    g.add_argument("--imbalance", default="1", help="encoder-scale values (encoder/LLM imbalance)")
    g.add_argument("--seeds", type=int, default=None,
                   help="seeds per point, from --seed: a sweep averages its makespans (none given: 1); the suite runs "
                   "each (none given: 3)")
    g.add_argument("--out", default="sweep", help="sweep output prefix: writes PREFIX.csv and PREFIX.md")

    g = p.add_argument_group("scenario suite (docs/suite.md)")
    g.add_argument("--suite", action="store_true",
                   help="run the scenario suite (compute and message jitter, sequence length, multimodal, a straggler; "
                   "at 1F1B's memory and unlimited) for --hints; --markdown writes the document")
    g.add_argument("--suite-ranks", default="4,8,16,32", help="suite pipeline depths (ranks)")
    g.add_argument("--suite-scenarios", default=None, help="comma-separated suite scenarios; without it, all")
    g.add_argument("--suite-jobs", type=int, default=1, help="worker processes for the suite (same figures for any count)")


# ---------------------------------------------------------------- argument parsing
# Upper bounds that keep every simulated time finite: a task's duration is a cost (at most
# MAX_SECONDS) times a few factors, each bounded here, so no product or sum reaches inf.
MAX_FACTOR = 1e6
"""Largest dimensionless multiplier (--encoder-scale, --imbalance, straggler factors, a
jitter level's ``a``, a --seqlen ratio)."""

MAX_SIGMA = 10.0
"""Largest lognormal sigma (--noise, --comm-noise, --seqlen lognormal:SIGMA). The factor
``exp(sigma Z - sigma^2/2)`` then stays within floats; far above it every draw underflows to
0 or overflows to inf."""


def _ints(text: str, what: str, most: int | None = None) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"--{what} {text!r}: expected integers >= 1")
    if most is not None and max(vals) > most:
        raise UsageError(f"--{what} {max(vals)}: expected at most {most}")
    return vals


def _floats(text: str, what: str, limit: float = MAX_FACTOR) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: expected comma-separated numbers") from None
    if not vals or any(not (v >= 0 and math.isfinite(v)) for v in vals):
        raise UsageError(f"--{what} {text!r}: expected finite numbers >= 0")
    if any(v > limit for v in vals):
        raise UsageError(f"--{what} {text!r}: expected numbers <= {short(limit)}")
    return vals


# Flag -> (largest value, its unit in the message).
_BOUNDED_FLAGS = {
    "step_overhead": (MAX_SECONDS, "seconds"),
    "latency": (MAX_SECONDS, "seconds"),
    "noise": (MAX_SIGMA, "a sigma"),
    "comm_noise": (MAX_SIGMA, "a sigma"),
    "encoder_scale": (MAX_FACTOR, "a factor"),
}


_SIZE_CAPS = {"ranks": 1024, "virtual": 64, "microbatches": 65536, "steps": 10000, "samples_per_mb": 4096,
              "seeds": 1000, "suite_jobs": 256}
"""Largest accepted simulator sizes (ranks, microbatches, steps, samples), far above any real
pipeline: a typo or hostile value is one line, not minutes of work and gigabytes."""
MAX_TASKS = 2_000_000
"""Most tasks (F, B/I, W per stage, microbatch and step) one simulation may hold."""


def _check_numbers(args: argparse.Namespace) -> None:
    """NaN or infinite values would make the simulation loop forever or print nonsense, and
    huge finite ones would overflow the makespan to inf.

    Raises:
        UsageError: one line naming the flag, its value and the accepted range.
    """
    for name, limit in _SIZE_CAPS.items():  # hostile sizes: refused before any allocation
        v = getattr(args, name, None)
        if isinstance(v, int) and v > limit:
            raise UsageError(f"--{name.replace('_', '-')} {v}: expected at most {limit}")
    mb = getattr(args, "microbatches", None) or 4 * getattr(args, "ranks", 1)
    n_tasks = 3 * getattr(args, "ranks", 1) * getattr(args, "virtual", 1) * mb * getattr(args, "steps", 1)
    if n_tasks > MAX_TASKS:
        raise UsageError(f"--ranks x --virtual x --microbatches x --steps: {n_tasks} tasks to simulate, "
                         f"expected at most {MAX_TASKS}")
    for name, (limit, unit) in _BOUNDED_FLAGS.items():
        v = getattr(args, name, None)
        flag = f"--{name.replace('_', '-')}"
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} {short(v)}: expected a finite number >= 0")
        if v is not None and v > limit:
            raise UsageError(f"{flag} {short(v)}: expected {unit} <= {short(limit)}")
    if getattr(args, "samples_per_mb", 1) < 1:
        raise UsageError(f"--samples-per-mb {args.samples_per_mb}: expected at least 1 sample per microbatch")
    if getattr(args, "encoder_stages", 0) < 0:
        raise UsageError(f"--encoder-stages {args.encoder_stages}: expected a number of stages >= 0")
    if not getattr(args, "suite", False):  # a sweep's shallowest point must hold the encoder too
        ranks = min(_ints(args.depths, "depths")) if args.sweep else args.ranks
        if args.encoder_stages > ranks * args.virtual:
            raise UsageError(f"--encoder-stages {args.encoder_stages}: the pipeline has {ranks * args.virtual} stages "
                             f"({ranks} ranks x {args.virtual} virtual), expected at most that many")
    bw = getattr(args, "bandwidth", None)
    if bw is not None and not bw > 0:
        raise UsageError(f"--bandwidth={bw}: expected a positive number of bytes per second (inf: free)")


def _jitter(text: str, flag: str) -> Any:
    """A jitter level whose injected delays stay finite (``b`` in seconds, ``a`` a factor).

    Raises:
        ValueError: a bad level, or ``b`` / ``a`` above their bounds.
    """
    level = parse_jitter(text)
    if level.b > MAX_SECONDS:
        raise ValueError(f"{flag} {text}: b={short(level.b)}: expected seconds <= {short(MAX_SECONDS)}")
    if level.a > MAX_FACTOR:
        raise ValueError(f"{flag} {text}: a={short(level.a)}: expected a factor <= {short(MAX_FACTOR)}")
    return level


def _seqlen(text: str) -> Dist:
    """The --seqlen ratio distribution, with bounded ratios.

    Raises:
        ValueError: a bad distribution, a lognormal sigma above :data:`MAX_SIGMA` or another
            parameter above :data:`MAX_FACTOR`.
    """
    d = Dist.parse(text)
    limit, unit = (MAX_SIGMA, "a sigma") if d.kind == "lognormal" else (MAX_FACTOR, "ratios")
    if d.kind != "poisson" and max(d.params) > limit:  # poisson has its own bound
        raise ValueError(f"--seqlen {text}: expected {unit} <= {short(limit)}")
    return d


def _limit(text: str) -> Any:
    if text == "1f1b":
        return "1f1b"
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"--limit {text!r}: expected an integer >= 1 or 1f1b") from None
    if v < 1:
        raise UsageError(f"--limit {text!r}: expected an integer >= 1 or 1f1b")
    return v


def _hints(args: argparse.Namespace) -> list[str]:
    return _hints_or(args, ["bf", "bfw"])


def _hints_or(args: argparse.Namespace, default: Any) -> Any:
    hints = list(args.hint)
    if args.hints is not None:
        items = [h.strip() for h in args.hints.split(",")]
        if not all(items):  # `bf,,bfw` or '': a typo, not "the default hints"
            raise UsageError(f"--hints {args.hints!r}: expected comma-separated hint names, none empty")
        hints += items
    return list(dict.fromkeys(hints)) or default


def _stragglers(items: list[str]) -> dict[int, float]:
    out = {}
    for it in items:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-9.eE+-]+)\s*", it)
        try:
            factor = float(m.group(2)) if m else math.nan
        except ValueError:
            factor = math.nan
        if not m or not 0 <= factor <= MAX_FACTOR:
            raise UsageError(f"--straggler {it!r}: expected RANK:FACTOR with 0 <= FACTOR <= {short(MAX_FACTOR)}, e.g. 3:1.5")
        out[int(m.group(1))] = factor
    return out


def _cost_list(text: str | None, flag: str, kind: type = float) -> list | None:
    """One cost flag's values: seconds (``kind`` float) or bytes (``kind`` int).

    Raises:
        UsageError: not numbers, negative or non-finite values, or values above
            :data:`MAX_SECONDS` / :data:`MAX_BYTES`.
    """
    if text is None:
        return None
    expected = "a size (4096, 64MiB, 1.5GB)" if kind is int else "a number"
    try:
        vals = [_number(x, kind) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected {expected}, or one per stage separated by commas") from None
    if not vals:
        raise UsageError(f"{flag} {text!r}: expected {expected}, or one per stage separated by commas")
    unit, limit, shown = ("bytes", MAX_BYTES, "2**53") if kind is int else ("seconds", MAX_SECONDS, short(MAX_SECONDS))
    for v in vals:
        if not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} {text}: expected finite {unit} >= 0")
        if v > limit:
            raise UsageError(f"{flag} {text}: expected {unit} <= {shown}")
    return [kind(v) for v in vals]


def _number(text: str, kind: type) -> float:
    """A number; for bytes (``kind`` int) also a size with a unit, read as ``--memory-budget``
    reads it (:func:`rrfp.scheduler.memory.parse_size`). Raises ValueError."""
    try:
        return float(text)
    except ValueError:
        if kind is not int:
            raise
        from ..scheduler.memory import parse_size

        return float(parse_size(text.strip()))


def _costs(args: argparse.Namespace) -> CostModel | None:
    flags = {"F": ("--cost-f", args.cost_f, float), "B": ("--cost-b", args.cost_b, float),
             "I": ("--cost-i", args.cost_i, float), "W": ("--cost-w", args.cost_w, float),
             "act_bytes": ("--act-bytes", args.act_bytes, int), "msg_bytes": ("--msg-bytes", args.msg_bytes, int)}
    given = {k: _cost_list(v, flag, kind) for k, (flag, v, kind) in flags.items() if v is not None}
    if args.costs:
        if given:
            raise UsageError("--costs and --cost-*/--act-bytes/--msg-bytes: give costs one way")
        try:
            return _check_messages(load_costs(args.costs), args)
        except OSError as e:
            raise UsageError(f"--costs {args.costs}: {e.strerror or e}") from None
    if not given:
        return None
    if "F" not in given:
        given["F"] = [0.010]
    if "B" not in given and not ("I" in given and "W" in given):
        given["B"] = [0.020]
    n = max(len(v) for v in given.values())
    bad = [k for k, v in given.items() if len(v) not in (1, n)]
    if bad:
        raise UsageError(f"cost flags: {flags[bad[0]][0]} has {len(given[bad[0]])} values, others {n}: "
                         "give one value, or one per stage")
    stages = [StageCost.from_mapping({k: v[i] if len(v) > 1 else v[0] for k, v in given.items()}, f"stage {i}")
              for i in range(n)]
    return _check_messages(CostModel(tuple(stages)), args)


def _check_messages(costs: CostModel, args: argparse.Namespace) -> CostModel:
    """``costs``, once its largest message is known to take at most :data:`MAX_SECONDS` at
    ``--bandwidth`` (bounds on sizes and bandwidth alone would not bound their quotient).

    Raises:
        UsageError: naming the message size, the bandwidth and the time it would take.
    """
    biggest = max(c.msg_bytes for c in costs.stages)
    if args.bandwidth > 0 and biggest / args.bandwidth > MAX_SECONDS:
        raise UsageError(f"--bandwidth {short(args.bandwidth)}: a message of {biggest} bytes would take "
                         f"{short(biggest / args.bandwidth)} s: expected seconds <= {short(MAX_SECONDS)}")
    return costs


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` the flags describe.

    Raises:
        UsageError: one line for any bad value.
    """
    try:
        if args.ranks < 1 or args.virtual < 1:
            raise ValueError(f"--ranks {args.ranks}, --virtual {args.virtual}: expected >= 1")
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps}: expected >= 1")
        m = args.microbatches if args.microbatches is not None else 4 * args.ranks
        if m < 1:
            raise ValueError(f"--microbatches {m}: expected >= 1")
        straggle = _stragglers(args.straggler)
        bad = [r for r in straggle if r >= args.ranks]
        if bad:
            raise ValueError(f"--straggler rank {bad[0]}: the pipeline has ranks 0..{args.ranks - 1}")
        cfg = SimConfig(
            n_ranks=args.ranks, n_microbatches=m, n_virtual=args.virtual, placement=args.placement,
            steps=args.steps, step_overhead=args.step_overhead, limit=_limit(args.limit), backpressure=args.backpressure,
            memory_budget=args.memory_budget,
            costs=_costs(args), seed=args.seed, jitter=_jitter(args.jitter, "--jitter"), noise=args.noise,
            seqlen=_seqlen(args.seqlen) if args.seqlen else None,
            images=Dist.parse(args.images) if args.images else None,
            samples_per_microbatch=args.samples_per_mb, encoder_stages=args.encoder_stages,
            encoder_scale=args.encoder_scale, stragglers=straggle, latency=args.latency,
            bandwidth=args.bandwidth, comm_noise=args.comm_noise, comm_jitter=_jitter(args.comm_jitter, "--comm-jitter"),
        )
        if not args.sweep:
            # Build everything once so that a bad value fails here, in one line (a sweep
            # builds per point: its stage count changes).
            cfg.make_placement()
            cfg.limits()
            cfg.memory_budgets()
            cfg.duration_model()
            cfg.comm_model()
        return cfg
    except ValueError as e:
        raise UsageError(str(e)) from None


def _baseline(args: argparse.Namespace) -> str | None:
    if args.baseline == "none":
        return None
    if args.baseline == "auto":
        return default_baseline(args.virtual, args.placement)
    return args.baseline


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output file whose folder does not exist (or is a file), before simulating
    anything, as ``rrfp train --log-file`` and ``rrfp bench --out`` do: a typo in a path must
    not create folders, nor cost a finished run its results.

    Raises:
        UsageError: one line naming the flag, the path and its missing folder.
    """
    outputs = [(f"--{k}", getattr(args, k)) for k in ("csv", "json", "markdown")]
    if args.sweep:
        outputs.append(("--out", args.out))
    outputs.append(("--trace", args.trace))
    for flag, value, expected in (("--costs", args.costs, "a cost file"),
                                  ("--baseline", args.baseline, "a hint name, auto or none")):
        if value == "":  # read as no flag: a run without the costs or baseline asked for
            raise UsageError(f"{flag} '': expected {expected}")
    for flag, path in outputs:
        if path == "":
            raise UsageError(f"{flag} '': expected a {'folder' if flag == '--trace' else 'file'} name")
        if path is None or flag == "--trace":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: its folder {folder} does not exist")
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a folder, expected a file name")


def _check_hint_files(cfg: SimConfig, hints: list[str]) -> None:
    """Resolve every hint before simulating: an unknown name is one line listing the known ones
    (``auto`` first, as in the README's hint table), and an unreadable CSV file (``x.csv``,
    ``strict-x.csv``, ``csv:x``) is named as the hint's file, not blamed on ``--trace``.

    Raises:
        UsageError: one line naming the hint (and its file).
    """
    from ..scheduler.hints import resolve_hint

    for h in hints:
        if h == AUTO:
            continue
        try:
            resolve_hint(h, cfg.make_placement(), cfg.n_microbatches)
        except OSError as e:
            raise UsageError(f"hint {h!r}: cannot read {e.filename or h}: {e.strerror or e}") from None
        except ValueError as e:
            if str(e).startswith("unknown hint"):  # simulate also takes auto (README's hint table)
                raise UsageError(f"hint {h!r}: {str(e).replace('expected one of ', 'expected auto or one of ', 1)}") from None
            # else reported by the run itself, with its limits


def _describe(cfg: SimConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["costs"] = [asdict(c) for c in cfg.cost_model().stages] if cfg.costs is not None else "default"
    for k in ("seqlen", "images"):
        d[k] = str(getattr(cfg, k)) if getattr(cfg, k) else None
    d["jitter"] = cfg.jitter.name if cfg.jitter else None
    d["comm_jitter"] = cfg.comm_jitter.name if cfg.comm_jitter else None
    return d


# ---------------------------------------------------------------------- commands
def run(args: argparse.Namespace) -> int:
    """Entry point of ``rrfp simulate``; returns the exit code.

    Raises:
        UsageError: bad flags, an unknown hint, a hint that does not fit, a schedule that
            cannot finish, or an output that cannot be written, or a ``--plugin`` that cannot
            be imported.
    """
    load_plugins(getattr(args, "plugin", None))  # before any hint is read: its hints are names here
    _check_numbers(args)
    check_flags(args, register)  # flags the mode (single run, --sweep, --suite) does not read
    _check_outputs(args)
    if args.suite:
        from .suite import SCENARIOS, SEEDS, SUITE_HINTS, run_suite_command

        ranks, hints = _ints(args.suite_ranks, "suite-ranks", _SIZE_CAPS["ranks"]), _hints_or(args, None)
        n_scen = len(args.suite_scenarios.split(",")) if args.suite_scenarios else len(SCENARIOS)
        check_study(suite_tasks(ranks, n_scen, args.seeds or len(SEEDS), len(hints or SUITE_HINTS)),
                    "--suite-ranks x --suite-scenarios x --seeds x hints")
        return run_suite_command(args, hints, ranks, _write)
    cfg = config_from_args(args)
    if args.sweep:
        return _run_sweep(args, cfg)
    hints = _hints(args)
    baseline = _baseline(args)

    def on_result(name: str, summary: Any, res: Any) -> None:
        if not args.trace:
            return
        from ..obs.trace import write_chrome_trace, write_gantt_png

        os.makedirs(args.trace, exist_ok=True)
        stem = os.path.join(args.trace, re.sub(r"[^A-Za-z0-9_.-]+", "_", name))
        write_chrome_trace(res.records, stem + ".json", metadata={"hint": name, "makespan_s": res.makespan})
        mode = "strict order" if summary.extra.get("strict") else f"in-flight limit {cfg.limit}"
        write_gantt_png(res.records, stem + ".png", title=f"{name} ({mode})", n_ranks=cfg.n_ranks)

    _check_hint_files(cfg, [*hints, *([baseline] if baseline else [])])
    try:
        chosen = simulate_auto(cfg) if AUTO in hints else None  # rrfp.sim.auto: ranking, then trial
        ran = list(dict.fromkeys(chosen.chosen if h == AUTO and chosen else h for h in hints))
        rows = compare(cfg, ran, baseline, on_result=on_result)
    except (ValueError, DeadlockError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--trace {args.trace}: cannot write the trace: {e.strerror or e}") from None
    if chosen is not None:  # auto's row: the run of the hint it kept, judged on this seed
        kept = next(r for r in rows if r.hint == chosen.chosen)
        rows.insert(hints.index(AUTO), replace(kept, hint=f"{AUTO} ({chosen.chosen})", extra=dict(kept.extra)))
    header, cells = table_rows(rows)
    jit = cfg.jitter.name if cfg.jitter else "J0"
    print(f"# {cfg.n_ranks} ranks x {cfg.n_virtual} virtual stages ({cfg.placement}), "
          f"{cfg.n_microbatches} microbatches, {cfg.steps} step(s), limit {cfg.limit}, jitter {jit}, seed {cfg.seed}"
          + (f", memory budget {cfg.memory_budget}" if cfg.memory_budget is not None else ""))
    print(format_text(header, cells))
    if baseline:
        print(f"# speedup = makespan of {baseline} / makespan; bound = lower bound of that run (docs/simulator.md)")
    if chosen is not None:
        # After extra rounds the choice is made on their two hints' steps alone (rrfp.sim.trial.undecided).
        pair = chosen.extension
        basis = decided_on(chosen.walls, pair)
        med = ", ".join(f"{h} {v:.4g} s" for h, v in sorted(medians(basis).items(), key=lambda x: x[1]))
        which = (f"{TRIAL_ROUNDS + EXTRA_ROUNDS} trial steps of the two the trial's noise left undecided" if pair
                 else f"{TRIAL_ROUNDS} trial steps")
        lost = "".join(f"{h} lost in the trial's {TRIAL_ROUNDS} rounds; " for h in chosen.walls if pair and h not in pair)
        print(f"# auto kept {chosen.chosen}: median of {which} (seeds of their own; at their median batch work): {med}; "
              f"faster counts beyond {100 * margin(basis):.1f}%; {lost}{chosen.ranking.reason()}")
    if args.csv:
        _write(args.csv, format_csv(header, cells))
    if args.markdown:
        _write(args.markdown, format_markdown(header, cells) + "\n")
    if args.json:
        _write(args.json, to_json(rows, _describe(cfg)) + "\n")
    return 0


def _run_sweep(args: argparse.Namespace, cfg: SimConfig) -> int:
    depths = _ints(args.depths, "depths", _SIZE_CAPS["ranks"])
    mps = _ints(args.mb_per_stage, "mb-per-stage", _SIZE_CAPS["microbatches"] // max(depths))
    try:
        jitters = [_jitter(j, "--jitter-levels") for j in args.jitter_levels.split(",") if j.strip()]
    except ValueError as e:
        raise UsageError(str(e)) from None
    imbalances = _floats(args.imbalance, "imbalance")
    hints = _hints(args)
    if AUTO in hints:
        raise UsageError("--sweep --hints auto: auto runs in single simulations and in --suite, not in a sweep")
    baseline = _baseline(args)
    repeats = len(jitters) * len(imbalances) * (args.seeds or 1) * len({*hints, baseline} - {None})
    check_study(sweep_tasks(depths, mps, cfg.n_virtual, cfg.steps, repeats),
                "--depths x --mb-per-stage x --jitter-levels x --imbalance x --seeds x hints")
    try:
        points = sweep(cfg, depths=depths, mb_per_stage=mps, jitters=jitters, imbalances=imbalances,
                       hints=hints, baseline=baseline, seeds=args.seeds if args.seeds is not None else 1,
                       progress=lambda s: print(s, file=sys.stderr))
    except (ValueError, DeadlockError) as e:
        raise UsageError(str(e)) from None
    header, cells = sweep_table(points, hints, baseline)
    print(format_text(header, cells))
    for pt in points:
        for name, err in pt.errors.items():
            print(f"# n/a: {name} at ranks={pt.n_ranks}, M={pt.n_microbatches}: {err}", file=sys.stderr)
    _write(args.out + ".csv", format_csv(header, cells))
    _write(args.out + ".md", format_markdown(header, cells) + "\n")
    if args.json:
        detail = [{**{k: v for k, v in vars(pt).items() if k != "runs"},
                   "runs": {h: r.to_dict() for h, r in pt.runs.items()}} for pt in points]
        _write(args.json, strict_json.dumps({"config": _describe(cfg), "points": detail}, indent=1, default=str) + "\n")
    print(f"# wrote {args.out}.csv and {args.out}.md", file=sys.stderr)
    return 0
