"""rrfp.obs.trace: Chrome trace JSON and Gantt PNGs from task records."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from rrfp.obs.trace import bubble_fractions, chrome_trace_events, write_chrome_trace, write_gantt_png
from rrfp.scheduler import Placement, resolve_hint
from rrfp.sim.engine import simulate


def _run(hint="bfw", p=3, m=4):
    spec, h, strict = resolve_hint(hint, Placement(p), m)
    return simulate(spec, h, lambda s, r, t: 0.001 * (1 + (t.kind == "F")), strict=strict)


def test_chrome_trace_has_one_process_per_rank(tmp_path) -> None:
    res = _run()
    path = tmp_path / "t.json"
    write_chrome_trace(res.records, path, metadata={"hint": "bfw"})
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.records) == 3 * 4 * 3
    assert {e["pid"] for e in xs} == {0, 1, 2}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    rec = res.records[0]
    first = xs[0]
    assert first["ts"] == pytest.approx(rec.start * 1e6) and first["dur"] == pytest.approx((rec.end - rec.start) * 1e6)
    assert first["name"] == str(rec.task) and first["cat"] == rec.task.kind
    assert set(first["args"]) == {"stage", "microbatch", "kind", "step"}
    assert doc["metadata"] == {"hint": "bfw"}


@dataclass
class RuntimeRecord:  # what a real run may hand over: the task as text
    rank: int
    step: int
    task: str
    start: float
    end: float


def test_record_like_objects_with_text_tasks() -> None:
    ev = chrome_trace_events([RuntimeRecord(1, 0, "2F0", 0.5, 0.75)])
    x = [e for e in ev if e["ph"] == "X"][0]
    assert (x["pid"], x["name"], x["args"]["stage"], x["args"]["microbatch"]) == (1, "2F0", 2, 0)
    assert x["ts"] == 500000.0 and x["dur"] == 250000.0


def test_bubble_fractions_from_records() -> None:
    res = _run("strict-1f1b", 3, 5)
    span, bub = bubble_fractions(res.records)
    assert span == pytest.approx(res.makespan)
    assert bub == pytest.approx(res.bubble_fraction())
    assert bubble_fractions([], 2) == (0.0, [0.0, 0.0])


def test_gantt_png_is_written(tmp_path) -> None:
    res = _run()
    path = tmp_path / "g.png"
    write_gantt_png(res.records, path, title="bfw", n_ranks=4)  # an extra, idle rank row
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="time unit"):
        write_gantt_png(res.records, path, time_unit="h")
