"""``--plugin MODULE``: import a user's module before a command resolves its hints, so that the
hints it registers (:func:`rrfp.scheduler.registry.register`) are names the command accepts.

``rrfp train`` re-runs its own command line in every rank, so the flag imports the module in
the launcher (where the flags are checked) and again in each rank, before any hint is resolved
there; ``rrfp simulate`` imports it before it simulates. A module that cannot be imported is
refused in one line before anything starts (docs/scheduling.md, "Adding a hint").
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Iterable

from .errors import UsageError


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--plugin MODULE`` (repeatable) to ``parser``."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (a dotted name importable from the current folder or "
                        "PYTHONPATH; repeatable): the hints it registers with rrfp.scheduler.registry.register "
                        "become hint names here (and in every rank of rrfp train)")


def load(modules: Iterable[str] | str | None) -> None:
    """Import each of ``modules`` (once: a module already imported is not run again). The
    current folder is searched too, as ``python -m`` searches it, so the launcher and its
    ranks find the same module.

    Raises:
        UsageError: one line naming a module that is not a dotted name, cannot be found, or
            raised while importing (its error).
    """
    for name in [modules] if isinstance(modules, str) else modules or ():  # a TOML file's one value
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise UsageError(f"--plugin={name!r}: expected a dotted module name (mypkg.hints), not a path")
        if name in sys.modules:
            continue
        cwd = os.getcwd()
        added = "" not in sys.path and cwd not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                raise UsageError(f"--plugin={name!r}: no module named {e.name!r} in the current folder or on "
                                 "PYTHONPATH") from None
            raise UsageError(f"--plugin={name!r}: importing it failed: {type(e).__name__}: {e}") from None
        except Exception as e:  # the plugin's own error, in one line
            raise UsageError(f"--plugin={name!r}: importing it failed: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}") from None
        finally:
            if added:
                sys.path.remove(cwd)
