"""``rrfp bench``: rrfp against PyTorch's pipeline schedules, and micro-benchmarks of the runtime.

The benchmarks live in the source tree (``benchmarks/``, next to the ``rrfp`` package); this
subcommand runs ``benchmarks/run_all.py`` with the same options::

    rrfp bench --all --out BENCHMARKS.md     # regenerate BENCHMARKS.md (~10 minutes on 2 cores)
    rrfp bench --quick                       # CI smoke run, printed
    rrfp bench --micro                       # only the micro-benchmarks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ._paths import output_file_problem
from .cli import UsageError
from .train.lines import say

def _run_all():
    import os

    from .resources import bench_root

    root = bench_root()
    if root is None:
        raise UsageError("this installation has no benchmarks: run rrfp bench from a clone of the rrfp repository")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    # The rank processes import ``benchmarks`` too (python -m benchmarks.harness).
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, paths)])
    from benchmarks import run_all

    return run_all


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``rrfp bench`` and ``benchmarks/run_all.py`` (one definition for both;
    no torch import, so ``rrfp --help`` stays fast)."""
    p.add_argument("--all", action="store_true", help="run every part (the default when no part is named)")
    p.add_argument("--compare", action="store_true", help="rrfp against PyTorch's pipeline schedules")
    p.add_argument("--micro", action="store_true", help="arbiter, runtime overhead and transport micro-benchmarks")
    p.add_argument("--sim-targets", action="store_true",
                   help="issue 13's simulator targets: the scenario suite, the simulator's speed, and the "
                   "`rrfp train --model multimodal` run")
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds (CI smoke test)")
    p.add_argument("--settings", default="jitter4,comm4,multimodal4,compute2,ranks8,ranks16",
                   help="comparison settings, comma-separated (jitter4, comm4, multimodal4, compute2, ranks8, "
                   "ranks16, jitter4-m64)")
    p.add_argument("--hint", default=None,
                   help="hint of the 'rrfp default' rows (a candidate); without it, rrfp.Pipeline's default")
    p.add_argument("--candidates", default="",
                   help="more hints, comma-separated, each run at 1F1B's and GPipe's memory beside the default hint "
                        "in the same rounds (paired), e.g. bfw-alt-df,bfw-alt")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per phase; without it, each setting's own")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and injected delays")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one multi-process run may take")
    p.add_argument("--out", default=None, help="write the Markdown report here; without it, print it")
    p.add_argument("--json", default=None, help="also write the raw results as JSON")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's ideal speedups")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="run nothing: render the report from the raw results of an earlier run (--json)")


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``rrfp``'s argparse subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark rrfp against PyTorch's pipeline schedules; runtime micro-benchmarks",
        description="Run rrfp and torch.distributed.pipelining's schedules side by side in the same rank "
        "processes (alternating, same weights, batches and injected jitter, gradients checked equal), and "
        "micro-benchmarks of the arbiter, the runtime's per-task overhead and the transports.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_options(p)
    p.set_defaults(func=run)


class Stopped(KeyboardInterrupt):
    """SIGTERM (or SIGINT) while ``rrfp bench`` runs: unwinds like Ctrl-C, so the launcher's
    ``finally`` stops the rank processes and removes their folder. ``signum``: the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    import signal

    # Once: a second signal (either) must not interrupt the cleanup the first one started.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


def run(args: argparse.Namespace) -> int:
    import signal

    run_all = _run_all()
    err = run_all.options_error(args)
    if err:
        raise UsageError(err)
    for flag, path in (("--out", args.out), ("--json", args.json)):
        if path is not None and (problem := output_file_problem(path)):
            raise UsageError(f"{flag} {path}: {problem}")
    if args.from_json and not Path(args.from_json).is_file():
        what = "is a folder, expected a file" if Path(args.from_json).is_dir() else "no such file"
        raise UsageError(f"--from-json {args.from_json}: {what}")
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_all.run(args)
    except KeyboardInterrupt as e:
        sig = signal.Signals(getattr(e, "signum", signal.SIGINT))
        say(f"rrfp bench: stopped by {sig.name}; its rank processes were stopped too", sys.stderr)
        return 128 + int(sig)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
