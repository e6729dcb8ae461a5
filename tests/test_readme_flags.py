"""Every flag `rrfp train --help` lists is in the README's flags table (a new user reads the
table, not the help): `--plugin` was missing from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.timeout(120)
def test_every_flag_of_rrfp_train_help_is_in_the_readmes_flags_table() -> None:
    text = README.read_text()
    start = text.index("## Flags of `rrfp train`")
    table = text[start:text.index("\n## ", start + 1)]
    helptext = subprocess.run([sys.executable, "-m", "rrfp", "train", "--help"], capture_output=True,
                              text=True, check=True, timeout=100).stdout
    flags = set(re.findall(r"^  (--[a-z][a-z0-9-]*)", helptext, re.M)) - {"--help"}
    assert len(flags) > 40  # the help was parsed (the table has over 40 rows)
    missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}(?![a-z0-9-])", table))
    assert missing == []
