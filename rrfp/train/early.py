"""The checks of ``rrfp train``'s flags that need no torch, run by :func:`rrfp.cli.main` right
after parsing, so that a misspelt flag value answers in a fraction of a second instead of
after torch's import (seconds, minutes on a loaded machine). The full check
(:func:`rrfp.train.cli.validate`) follows."""

from __future__ import annotations

import argparse

from ..scheduler.hints import HINT_NAMES, _forms
from ..runtime.names import hint_text


def hint_problem(text: str, default: str | None) -> str | None:
    """Why ``text`` cannot name a hint (None: it can): not a policy or schedule (rrfp's or
    PyTorch's name, optionally ``strict-``), an ``order:``, or a CSV file. The parser's
    default is always accepted."""
    if text == default:
        return None
    name = hint_text(text)
    name = name[len("strict-"):] if name.startswith("strict-") else name
    if name in HINT_NAMES or name.startswith(("order:", "csv:")) or name.endswith(".csv"):
        return None
    return f"--hint={text!r}: unknown hint {text!r}: expected one of {_forms()}"


def check(args: argparse.Namespace) -> str | None:
    """The first problem found in the flags checked before torch is imported, or None."""
    parser = getattr(args, "_parser", None)
    default = parser.get_default("hint") if parser is not None else None
    return hint_problem(args.hint, default)
