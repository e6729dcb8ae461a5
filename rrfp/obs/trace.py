"""Timelines of pipeline runs: Chrome trace JSON (Perfetto, chrome://tracing) and Gantt PNGs.

Both take *records*: objects with ``rank``, ``step``, ``task``, ``start`` and ``end``
(:class:`rrfp.sim.engine.TaskRecord`; the runtime writes the same type from real runs, so
``rrfp train --trace DIR`` and ``rrfp simulate --trace DIR`` draw alike). ``task`` is a
:class:`~rrfp.scheduler.tasks.Task` (or its text, ``"2F0"``); ``start``/``end`` are seconds
from the run's start.

No torch. matplotlib is imported only by :func:`write_gantt_png`, through its object API and
the Agg canvas, so the caller's pyplot backend is left alone.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Protocol, Sequence

from ..scheduler.tasks import Task, parse_action

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
"""Colour per task kind (forward blue, full backward orange, input-gradient red,
weight-gradient green)."""

KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}


class RecordLike(Protocol):
    rank: int
    step: int
    task: Any
    start: float
    end: float


def _task(rec: RecordLike) -> Task:
    t = rec.task
    return parse_action(t) if isinstance(t, str) else Task(*t)


def chrome_trace_events(
    records: Iterable[RecordLike], *, rank_names: Mapping[int, str] | None = None
) -> list[dict[str, Any]]:
    """Chrome trace events: one complete ('X') event per task, ``pid`` = rank, ``ts``/``dur``
    in microseconds, plus process-name metadata so each rank is one labelled row.

    Raises:
        ValueError: a task whose text cannot be parsed.
    """
    events: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for rec in records:
        t = _task(rec)
        ranks.add(rec.rank)
        events.append({
            "name": str(t),
            "cat": t.kind,
            "ph": "X",
            "pid": rec.rank,
            "tid": 0,
            "ts": rec.start * 1e6,
            "dur": max(0.0, rec.end - rec.start) * 1e6,
            "args": {"stage": t.stage, "microbatch": t.mb, "kind": KIND_NAMES[t.kind], "step": rec.step},
        })
    names = dict(rank_names or {})
    for r in sorted(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": names.get(r, f"rank {r}")}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
    return events


def write_chrome_trace(
    records: Iterable[RecordLike],
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    rank_names: Mapping[int, str] | None = None,
) -> None:
    """Write a Chrome trace JSON (``{"traceEvents": [...]}``) that Perfetto and
    chrome://tracing open: one process row per rank, one slice per task named in PyTorch's
    action grammar (``"2F0"``), with stage, microbatch, kind and step as arguments.

    Args:
        metadata: free-form run description stored under ``"metadata"``.
        rank_names: row labels (default ``"rank <r>"``).

    Raises:
        OSError: the file cannot be written.
    """
    doc = {
        "traceEvents": chrome_trace_events(records, rank_names=rank_names),
        "displayTimeUnit": "ms",
        "metadata": dict(metadata or {}),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def bubble_fractions(records: Sequence[RecordLike], n_ranks: int | None = None) -> tuple[float, list[float]]:
    """``(makespan, per-rank idle share of it)`` from records alone: the makespan runs from the
    earliest start to the latest end; ranks are ``0..max rank`` unless ``n_ranks`` is given."""
    if not records:
        return 0.0, [0.0] * (n_ranks or 0)
    t0 = min(r.start for r in records)
    span = max(r.end for r in records) - t0
    P = n_ranks if n_ranks is not None else max(r.rank for r in records) + 1
    busy = [0.0] * P
    for r in records:
        busy[r.rank] += r.end - r.start
    return span, [1.0 - b / span if span > 0 else 0.0 for b in busy]


def write_gantt_png(
    records: Sequence[RecordLike],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    n_ranks: int | None = None,
    time_unit: str = "ms",
    label_tasks: bool | None = None,
    dpi: int = 110,
) -> list[tuple[str, float, float]]:
    """Draw a Gantt chart: one row per rank (rank 0 on top), one bar per task coloured by kind
    (:data:`COLORS`), bubbles visible as gaps. The title carries the makespan and the bubble
    fractions (each rank's up to 8 ranks, else mean and max).

    Args:
        title: first title line (e.g. the policy).
        n_ranks: rows to draw (default: highest rank in ``records`` + 1).
        time_unit: ``"s"``, ``"ms"`` or ``"us"`` for the x axis.
        label_tasks: write ``"<stage>F<mb>"``-style labels in the bars (default: when there are
            at most 400 tasks); a label that does not fit its bar is shortened to the
            microbatch, or dropped.

    Returns:
        the labels drawn, ``(text, left, right)`` in display pixels.

    Raises:
        ValueError: an unknown time unit.
        OSError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}.get(time_unit)
    if scale is None:
        raise ValueError(f"time unit {time_unit!r}: expected s, ms or us")
    span, bubbles = bubble_fractions(records, n_ranks)
    P = len(bubbles)
    t0 = min((r.start for r in records), default=0.0)
    label = label_tasks if label_tasks is not None else len(records) <= 400

    fig = Figure(figsize=(min(24, 8 + len(records) / 60), 1.2 + 0.35 * max(P, 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    texts = []
    for rec in records:
        t = _task(rec)
        x0, x1 = (rec.start - t0) * scale, (rec.end - t0) * scale
        bars.setdefault((rec.rank, t.kind), []).append((x0, x1 - x0))
        if label:
            texts.append((ax.text((x0 + x1) / 2, rec.rank, str(t), ha="center", va="center", fontsize=6,
                                  color="white", clip_on=True), x0, x1, str(t.mb)))
    for (rank, kind), spans in bars.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="none")
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in range(P)], fontsize=7 if P > 16 else 9)
    ax.set_xlim(0, span * scale if span > 0 else 1)
    ax.set_xlabel(f"time ({time_unit})")
    kinds = sorted({k for _, k in bars}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if P <= 8:
        bub = ", ".join(f"{b:.1%}" for b in bubbles)
    else:
        bub = f"mean {sum(bubbles) / P:.1%}, max {max(bubbles):.1%}"
    head = f"{title}\n" if title else ""
    ax.set_title(f"{head}makespan {span * scale:.4g} {time_unit}; idle per rank over the span shown: {bub}", fontsize=9)
    fig.tight_layout()
    drawn = _fit_labels(fig, ax, texts)
    fig.savefig(os.fspath(path), dpi=dpi)
    return drawn


def _fit_labels(fig, ax, texts) -> list[tuple[str, float, float]]:
    """Keep a task's label only inside its own bar: the full text (``"2F10"``) where it fits,
    else the microbatch alone (``"10"``, the colour gives the kind), else none. Tasks of one
    rank never overlap, so neither do the labels kept.

    Returns:
        ``(text, left, right)`` of each label kept, in display pixels.
    """
    renderer = fig.canvas.get_renderer()
    pad = 1.0  # pixels of bar left either side of a label
    drawn = []
    for text, x0, x1, short in texts:
        y = text.get_position()[1]
        left, right = ax.transData.transform([(x0, y), (x1, y)])[:, 0]
        for candidate in (text.get_text(), short):
            text.set_text(candidate)
            box = text.get_window_extent(renderer)
            if box.x0 >= left + pad and box.x1 <= right - pad:
                drawn.append((candidate, float(box.x0), float(box.x1)))
                break
        else:
            text.remove()
    return drawn
