"""What rank 0 of ``rrfp train`` shows: a progress bar with ETA on a terminal (tqdm), one
plain line per step otherwise, and every line also in ``--log-file``."""

from __future__ import annotations

import os
import sys
from typing import IO

from ..lines import say


def _columns(stream: IO[str]) -> int | None:
    """The terminal's width in columns; None when it cannot say. A terminal that says 0 (a pty
    nobody sized: ``script``, some CI runners) gets plain lines: a bar 0 columns wide shows
    nothing at all."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


class Output:
    """Rank 0's output.

    Args:
        total: steps in the run (the bar's length).
        quiet: no per-step lines or bar, only :meth:`message` lines (summary, evaluations).
        log_file: a path that receives every step and message line (truncated first).
        stream: where lines go (default: stdout).
        bar: draw a tqdm bar; default: when ``stream`` is a terminal of some width and not
            quiet.

    Raises:
        OSError: the log file cannot be opened.
    """

    def __init__(self, total: int, quiet: bool = False, log_file: str | None = None,
                 stream: IO[str] | None = None, bar: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.quiet = quiet
        self.log = open(log_file, "w", buffering=1) if log_file else None
        if bar is None:
            isatty = getattr(self.stream, "isatty", None)
            bar = bool(isatty and isatty()) and not quiet and _columns(self.stream) != 0
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True, leave=True)

    def step(self, line: str, postfix: str = "") -> None:
        """One step done: advance the bar (``postfix`` beside it) or print ``line``."""
        self._log(line)
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            say(line, self.stream)

    def message(self, line: str) -> None:
        """A line shown whatever the mode (evaluations, the summary), above the bar."""
        self._log(line)
        if self.bar is not None:
            self.bar.write(line + "\n", file=self.stream, end="")  # one write (rrfp/lines.py)
        else:
            say(line, self.stream)

    def _log(self, line: str) -> None:
        if self.log is not None:
            self.log.write(line + "\n")

    def close_bar(self) -> None:
        """End the bar (the summary follows on its own line)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        if self.log is not None:
            self.log.close()
            self.log = None
