"""Markdown pieces the benchmark reports share (their one copy: :mod:`benchmarks.report` and
:mod:`benchmarks.report_peers` both write tables, and neither imports the other for it)."""

from __future__ import annotations

from typing import Any, Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table: one header row, one row per entry of ``rows``
    (each cell rendered with ``str``), lines joined by newlines, no trailing newline."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
