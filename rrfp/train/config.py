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


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read ``path`` and return ``{dest: value}`` for ``parser.set_defaults``.

    Raises:
        UsageError: one line naming a missing or malformed file, an unknown key (with the
            known ones), or a value of the wrong type.
    """
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--config={path!r}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--config={path!r}: not UTF-8 text (byte {e.start}), expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config={path!r}: not valid TOML: {e}") from None
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
