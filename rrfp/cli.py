"""The ``rrfp`` command: ``rrfp train | simulate | bench | node | export``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds an
argparse parser whose ``func`` default takes the parsed namespace and returns an exit code.
Modules are imported only when listed, and every flag is checked before torch is imported
(:data:`EARLY_CHECKS`), so a bad flag is one line within a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

from .errors import UsageError
from .lines import say

SUBCOMMANDS = {
    "train": "rrfp.train.cli",
    "simulate": "rrfp.sim.cli",
    "bench": "rrfp.bench_cli",
    "node": "rrfp.node.cli",
    "export": "rrfp.train.export_cli",
}


# Checks of a subcommand's flags before its heavy imports (torch): "module:function", the
# function taking the parsed namespace and returning one line naming the first problem, or
# None. rrfp node checks its flags and its rrfp train arguments in rrfp.node.cli.resolve,
# torch-free up to the host checks; rrfp bench imports torch only in the benchmarks it runs.
EARLY_CHECKS = {
    "train": "rrfp.train.early:check",
    "simulate": "rrfp.cli:check_simulate",
    "export": "rrfp.train.export_cli:check",
}


def check_simulate(args: argparse.Namespace) -> str | None:
    """``rrfp simulate``'s pipeline degree and in-flight limit, named as ``rrfp train`` names
    them (``--pp``, ``--inflight-limit``), or None."""
    for flag, value in (("--pp", args.ranks), ("--virtual", args.virtual)):
        if value < 1:
            return f"{flag}={value}: expected a positive integer"
    limit = getattr(args, "limit", "1f1b")
    try:
        ok = limit == "1f1b" or int(limit) >= 1
    except ValueError:
        ok = False
    if not ok:
        return f"--inflight-limit={limit!r}: expected a positive integer or '1f1b'"
    return None


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with errors in the project's form: one line, exit code 2.

    A malformed flag (``--steps abc``, a bad choice, a missing value, an unknown flag)
    prints ``<prog>: error: <argparse's message>`` to stderr, without the usage block
    (``--help`` still prints it). :func:`main` passes it to ``add_subparsers`` as
    ``parser_class``, so every subcommand's parser is one too.

    Flags are never abbreviated (``--step`` is an unknown flag, not ``--steps``).

    A value that reads as a negative quantity (``-5MiB``, ``-1e-3``, ``-2.5``) is taken as the
    flag's value, so the flag's own check names it; argparse would take it for a flag and say
    only "expected one argument".
    """

    def __init__(self, *args, **kwargs) -> None:
        # No prefix matching: ``--step 5`` must not silently mean ``--steps 5``, and a flag
        # added later must not change what an old command line means.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[A-Za-z]*$")

    def error(self, message: str) -> NoReturn:
        """Print one line naming the problem and exit.

        Raises:
            SystemExit: always, with code 2.
        """
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(
        prog="rrfp", description="Readiness-driven runtime for pipeline-parallel training."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"rrfp {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", parser_class=ArgumentParser
    )
    name = next((a for a in argv if not a.startswith("-")), None)
    for cmd, module in SUBCOMMANDS.items():
        # An unknown subcommand registers them all, so that the error lists the choices.
        if name not in SUBCOMMANDS or cmd == name:
            try:
                importlib.import_module(module).register(sub)
            except ModuleNotFoundError as e:
                if e.name is None or not e.name.startswith("rrfp"):
                    raise
                sub.add_parser(cmd, help="(not available in this build)")
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "pass_through", False):
        args.extra, extra = extra, []  # rrfp node hands the arguments it does not know to rrfp train
    if extra:
        # Reported by the subcommand's parser, so the line names the subcommand (rrfp train: ...).
        owner = sub.choices.get(getattr(args, "command", None) or "", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(argv)  # lets a launcher re-run the same command in each rank
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    early = EARLY_CHECKS.get(args.command)
    if early:
        module, _, function = early.partition(":")
        problem = getattr(importlib.import_module(module), function)(args)
    else:
        problem = None
    if problem:
        say(f"rrfp {args.command}: error: {' '.join(problem.split())}", sys.stderr)
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except UsageError as e:
        say(f"rrfp {args.command}: error: {e}", sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`rrfp simulate ... | head`): stop quietly, as Unix tools do.
        # Python would report the pipe again while flushing stdout at exit, so point stdout
        # at /dev/null first (the recipe in Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal


if __name__ == "__main__":
    sys.exit(main())
