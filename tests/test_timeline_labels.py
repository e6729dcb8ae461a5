"""The timeline PNG's task labels: each inside its own bar (full, shortened to the microbatch,
or dropped), so no two overlap, whatever the task durations."""

from __future__ import annotations

from rrfp.obs.trace import write_gantt_png
from rrfp.scheduler.tasks import F, B, Task, TaskRecord


def test_labels_of_short_tasks_never_overlap(tmp_path):
    # Rank 0: twelve back-to-back short forwards, each 1.3% of the span (a rule of "label
    # what is longer than 1.2% of the span" drew them as "0F10F20F3..."), then a long
    # backward; rank 1: one long forward.
    d = 0.0065
    recs = [TaskRecord(0, 0, Task(0, F, m), d * m, d * (m + 1)) for m in range(12)]
    recs += [TaskRecord(0, 0, Task(0, B, 0), d * 12, 0.5), TaskRecord(1, 0, Task(1, F, 0), 0.0, 0.5)]
    drawn = write_gantt_png(recs, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    texts = [t for t, _, _ in drawn]
    assert "0B0" in texts and "1F0" in texts  # long bars keep their full label
    assert len(drawn) < len(recs)  # some short ones had no room
    # No two labels overlap (they lie on two rows; compare within the one with many).
    spans = sorted((a, b) for t, a, b in drawn if t != "1F0")
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, spans
