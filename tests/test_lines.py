"""Every line a rank (or the launcher or node agent beside them) writes reaches the stream in
one write call (rrfp.lines.say), so that lines of processes sharing a stderr never
interleave."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

import rrfp
from rrfp.lines import say

# Tools that run as a process of their own, with no rank beside them: their output may be
# tables and multi-line text, and nothing else writes between their lines.
SINGLE_PROCESS_TOOLS = {"sim", "gpu_check.py", "train/export_cli.py"}


class RawRecorder(io.RawIOBase):
    """The bytes layer under an unbuffered text stream (``python -u``): one entry per
    ``write(2)`` the process would make."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)


def _unbuffered() -> tuple[io.TextIOWrapper, RawRecorder]:
    raw = RawRecorder()
    return io.TextIOWrapper(raw, encoding="utf-8", write_through=True), raw


def test_say_is_one_write_where_print_is_two():
    stream, raw = _unbuffered()
    print("rank 3: a line", file=stream, flush=True)
    assert raw.writes == [b"rank 3: a line", b"\n"], "the premise: print splits a line on such a stream"
    raw.writes.clear()
    say("rank 3: a line", stream)
    assert raw.writes == [b"rank 3: a line\n"]


def test_a_rank_line_goes_out_in_one_write(monkeypatch):
    """A real call site: rank 0's warning about a statistics message it ignores."""
    from types import SimpleNamespace

    from rrfp.scheduler.tasks import Placement
    from rrfp.train.progress import Output
    from rrfp.train.report import Reporter

    stream, raw = _unbuffered()
    monkeypatch.setattr("sys.stderr", stream)
    args = SimpleNamespace(steps=3, microbatches=2, quiet=True, hint="bf", skip_nonfinite=False)
    rep = Reporter(args, 2, Placement(2, 1, "loop"), Output(3, stream=io.StringIO(), bar=False))
    rep.add({"kind": "stats", "step": 99, "busy": 0.5, "wall": 1.0, "peak": 1, "loss": None}, 1)
    assert raw.writes == [b"rrfp train: rank 0: ignored statistics message #1 from rank 1: step 99 outside 0..2\n"]


@pytest.mark.parametrize("method", ["step", "message"])
def test_rank_0_progress_lines_go_out_in_one_write(method):
    from rrfp.train.progress import Output

    stream, raw = _unbuffered()
    out = Output(3, stream=stream, bar=False)
    getattr(out, method)("step 1/3 loss 2.0")
    assert raw.writes == [b"step 1/3 loss 2.0\n"]


def test_no_print_where_ranks_write():
    """A ``print`` call anywhere in rrfp outside the single-process tools would split its
    line in two writes again: every line goes through rrfp.lines.say."""
    root = Path(rrfp.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in SINGLE_PROCESS_TOOLS or rel in SINGLE_PROCESS_TOOLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"print() where ranks write (use rrfp.lines.say): {found}"
    assert (root / "train" / "worker.py").is_file()  # the scan saw the rank's own code
