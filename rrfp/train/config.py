"""``rrfp train --config FILE.toml``: a TOML file whose keys are the command's flags.

Keys are flag names without the dashes (``batch-size`` or ``batch_size``); values have the
flag's type (``steps = 100``, ``hint = "bfw"``, ``data = ["a.txt", "docs/"]``,
``deterministic = true``). A flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import UsageError

NOT_FROM_FILE = {"config", "help", "func", "command", "argv"}

MAX_CONFIG_BYTES = 1 << 20
"""A configuration file larger than this (1 MiB) is refused unread: flags fit in a few KiB."""
MAX_DEPTH = 16
"""Arrays and inline tables nested deeper than this are refused before parsing: no flag takes
more than a list, and Python's TOML parser recurses once per level (a file nested thousands
deep would end in a RecursionError)."""


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read ``path`` and return ``{dest: value}`` for ``parser.set_defaults``.

    Raises:
        UsageError: one line naming a missing or malformed file, an unknown key (with the
            known ones), or a value of the wrong type.
    """
    from .._inputs import read_small_file

    try:
        text = read_small_file(path, MAX_CONFIG_BYTES).decode()
        if (depth := nesting(text)) > MAX_DEPTH:
            raise UsageError(f"--config={path!r}: arrays or inline tables nested {depth} deep, expected at most "
                             f"{MAX_DEPTH} (a flag takes a value or a list)")
        raw = tomllib.loads(text)
    except OSError as e:
        raise UsageError(f"--config={path!r}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--config={path!r}: not UTF-8 text (byte {e.start}), expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config={path!r}: not valid TOML: {e}") from None
    except ValueError as e:  # not a regular file, or too large
        raise UsageError(f"--config={path!r}: {e}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_FROM_FILE and a.option_strings}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            known = ", ".join(sorted(d.replace("_", "-") for d in actions))
            raise UsageError(f"--config={path!r}: unknown key {key!r} (expected one of: {known})")
        out[dest] = _convert(path, key, value, action)
    return out


def nesting(text: str) -> int:
    """How deep TOML ``text`` nests arrays and inline tables (brackets and braces outside
    strings and comments; a table header ``[a]`` counts 1)."""
    depth = deepest = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
        elif c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c in "\"'":
            i = _string_end(text, i)
            continue
        i += 1
    return deepest


def _string_end(text: str, i: int) -> int:
    """The index after the TOML string starting at ``text[i]`` (basic or literal, one line or
    multi-line); the end of the text for an unterminated one (the parser then says so)."""
    q = text[i]
    multi = text.startswith(q * 3, i)
    end_mark = q * 3 if multi else q
    j = i + len(end_mark)
    while True:
        k = text.find(end_mark, j)
        if k < 0:
            return len(text)
        if q == '"':  # an odd run of backslashes before the quote escapes it
            b = k
            while b > j and text[b - 1] == "\\":
                b -= 1
            if (k - b) % 2:
                j = k + 1
                continue
        while multi and text.startswith(q, k + 3):  # up to two quotes may end the content
            k += 1
        return k + len(end_mark)


def _convert(path: str, key: str, value: Any, action: argparse.Action) -> Any:
    where = f"--config={path!r}: key {key!r}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_scalar(where, v, action) for v in items]
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: expected one value, got {value!r}")
    return _scalar(where, value, action)


def _scalar(where: str, value: Any, action: argparse.Action) -> Any:
    if isinstance(value, (dict, list)) or isinstance(value, bool) and action.type is not None:
        raise UsageError(f"{where}: expected a single {getattr(action.type, '__name__', 'value')}, got {value!r}")
    try:
        v = action.type(value) if action.type is not None else str(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{where}: expected {getattr(action.type, '__name__', 'a value')}, got {value!r}") from None
    if action.type is int and isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise UsageError(f"{where}: expected an integer, got {value!r}")
    if action.choices is not None and v not in action.choices:
        raise UsageError(f"{where}: {v!r} is not one of {', '.join(map(str, action.choices))}")
    return v


def apply_config(args: argparse.Namespace) -> argparse.Namespace:
    """Re-parse the command line with the file's values as defaults (the command line wins).

    Raises:
        UsageError: as :func:`load_config`.
    """
    parser: argparse.ArgumentParser = args._parser
    argv = list(getattr(args, "argv", None) or [])
    rest = argv[argv.index("train") + 1:] if "train" in argv else argv
    parser.set_defaults(**load_config(args.config, parser))
    new = parser.parse_args(rest)
    new.argv = argv
    new.command = getattr(args, "command", "train")
    return new
