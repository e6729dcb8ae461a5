"""``rrfp bench``: rrfp against PyTorch's pipeline schedules, and micro-benchmarks of the runtime.

The benchmarks live in the source tree (``benchmarks/``, next to the ``rrfp`` package); this
subcommand runs ``benchmarks/run_all.py`` with the same options::

    rrfp bench --all --out BENCHMARKS.md     # regenerate BENCHMARKS.md (under 10 minutes on 2 quiet cores)
    rrfp bench --quick                       # CI smoke run at small sizes (a few minutes), printed

Each prints its estimated time first and every part's time as it ends.
    rrfp bench --micro                       # only the micro-benchmarks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ._paths import output_file_problem
from .errors import UsageError
from .lines import say

PROGRAM = "benchmarks.run_all"
"""The benchmark program, run as ``python -m`` from the folder :func:`~rrfp.resources.bench_root`
finds: the package runs it as a child process and never imports it."""

LAUNCHED_ENV = "RRFP_BENCH_LAUNCHED"
"""Set in the program's environment by ``rrfp bench``, so that its errors read ``rrfp bench: ...``."""


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``rrfp bench`` and ``benchmarks/run_all.py`` (one definition for both;
    no torch import, so ``rrfp --help`` stays fast)."""
    p.add_argument("--all", action="store_true", help="run every part (the default when no part is named)")
    p.add_argument("--compare", action="store_true", help="rrfp against PyTorch's pipeline schedules")
    p.add_argument("--micro", action="store_true", help="arbiter, runtime overhead and transport micro-benchmarks")
    p.add_argument("--sim-targets", action="store_true",
                   help="the simulator and training targets: the scenario suite, the simulator's speed, and the "
                   "`rrfp train --model multimodal` run")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and one timed round, no verdicts (CI smoke test, a few minutes)")
    p.add_argument("--settings", default="jitter4,comm4,multimodal4,compute2,ranks8,ranks16",
                   help="comparison settings, comma-separated (jitter4, comm4, multimodal4, compute2, ranks8, "
                   "ranks16, jitter4-m64)")
    p.add_argument("--hint", default=None,
                   help="hint of the 'rrfp default' rows (a candidate); without it, auto (Pipeline's default: its "
                   "measuring and trial steps run in each phase before the timed rounds, which run the hint it kept)")
    p.add_argument("--candidates", default=None,
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
    p.set_defaults(func=launch)


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


def _check_paths(args: argparse.Namespace) -> None:
    for flag, path in (("--out", args.out), ("--json", args.json)):
        if path is not None and (problem := output_file_problem(path)):
            raise UsageError(f"{flag} {path}: {problem}")
    if args.from_json == "":  # read as no flag: the whole benchmark ran
        raise UsageError("--from-json '': expected a file")
    if args.from_json and not Path(args.from_json).is_file():
        what = "is a folder, expected a file" if Path(args.from_json).is_dir() else "no such file"
        raise UsageError(f"--from-json {args.from_json}: {what}")


def launch(args: argparse.Namespace) -> int:
    """``rrfp bench``: the benchmark program (:data:`PROGRAM`) as a child process with the same
    arguments; SIGTERM and SIGINT are passed on to it, so it stops its rank processes itself.

    Returns:
        the program's exit status (128 + the signal when a signal ended it).

    Raises:
        UsageError: a bad output path, or an installation without the benchmarks.
    """
    import os
    import signal
    import subprocess

    from .resources import bench_root

    _check_paths(args)
    root = bench_root()
    if root is None:
        raise UsageError("this installation has no benchmarks: run rrfp bench from a clone of the rrfp repository")
    argv = args.argv[args.argv.index("bench") + 1:]
    # The rank processes import ``benchmarks`` too (python -m benchmarks.launcher).
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), LAUNCHED_ENV: "1"}
    child = subprocess.Popen([sys.executable, "-m", PROGRAM, *argv], env=env, preexec_fn=_die_with_parent)
    previous = {s: signal.signal(s, lambda signum, frame: child.send_signal(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def _die_with_parent() -> None:
    # In the forked child: a SIGKILLed ``rrfp bench`` takes the program (and, through the
    # program's own parent-death signal, its ranks) with it.
    from ._pdeathsig import set_parent_death_signal

    set_parent_death_signal()


def run(args: argparse.Namespace) -> int:
    """The benchmark program's run under ``rrfp bench``'s checks and stop handling; called by the
    program's ``main`` (``python -m benchmarks.run_all``), which is the ``__main__`` module.

    Returns:
        the program's exit status; 2 after an error line when started by :func:`launch`;
        128 + the signal when SIGTERM or SIGINT stopped it (its rank processes stopped too).

    Raises:
        UsageError: a bad option, when not started by :func:`launch`.
    """
    import os
    import signal

    program = sys.modules["__main__"]
    if not (hasattr(program, "options_error") and hasattr(program, "run")):
        raise RuntimeError(f"rrfp.bench_cli.run runs inside {PROGRAM} (its main calls it); use rrfp bench")
    try:
        err = program.options_error(args)
        if err:
            raise UsageError(err)
        _check_paths(args)
    except UsageError as e:
        if os.environ.get(LAUNCHED_ENV) != "1":
            raise
        say(f"rrfp bench: error: {e}", sys.stderr)
        return 2
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return program.run(args)
    except KeyboardInterrupt as e:
        sig = signal.Signals(getattr(e, "signum", signal.SIGINT))
        say(f"rrfp bench: stopped by {sig.name}; its rank processes were stopped too", sys.stderr)
        return 128 + int(sig)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
