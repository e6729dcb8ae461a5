"""What a refused ``rrfp`` command printed: one line on stderr, ``rrfp CMD: error: ...``."""

from __future__ import annotations


def error_line(capsys, cmd: str) -> str:
    """The text after ``rrfp CMD: error: `` of the one line the command printed on stderr
    (asserts there was exactly one, and that it has that prefix)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rrfp {cmd}: error: "), err
    return err[0][len(f"rrfp {cmd}: error: "):]
