"""What a simulated run is worth: bubbles, memory, the lower bound, and side-by-side tables.

Lower bound (RRFP "Bounds": the busiest stage's work plus unavoidable fill and drain), made
exact for any placement, cost model and communication delays, and computed from the run's own
task durations (a split and a full backward differ, so each run is bounded with its own).
For each rank ``r`` with first stage ``s0`` (its lowest stage):

- head: every task of ``r`` depends on a forward of ``s0`` (a backward needs its stage's
  forward; ``F(s, m)`` on a later stage of ``r`` needs ``F(s0, m)``). ``F(s0, m)`` cannot start
  before its activation went through stages ``0..s0-1``, none of which is on ``r``:
  ``head_r = min_m sum_{j<s0} (F(j, m) + msg(j -> j+1))`` over step 0's durations.
- work: ``r`` runs one task at a time, so its tasks fill ``work_r = sum of its durations`` and
  ``(steps - 1) * step_overhead`` more between its steps.
- tail: nothing of ``r`` depends on its last task, so that task is ``B(s0, m)`` for some ``m``
  (any other backward of ``r`` feeds ``B(s0, m)``, any forward feeds its own backward), and
  the gradient still has to go down stages ``s0-1..0``, none on ``r``:
  ``tail_r = min_m sum_{j<s0} (msg(j+1 -> j) + B(j, m))`` in the last step. With a split
  backward the last task can be a ``W``, which feeds nothing: ``tail_r = 0``.

``makespan >= head_r + work_r + tail_r`` for every rank. Also, every microbatch's dependency
chain ``F(0..S-1), then B/I(S-1..0), then the longest W after its I`` runs in sequence. The
bound is the largest of all these. For ``p`` ranks, ``m`` microbatches, equal stages
``(t_f, t_b)`` and no communication it is ``(m + p - 1)(t_f + t_b)``: the last rank's
``(p-1) t_f`` fill, ``m (t_f + t_b)`` work and ``(p-1) t_b`` drain, which GPipe and 1F1B reach.

Pure module: no torch.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .. import _json as strict_json
from ..scheduler.tasks import B, F, I, W, PipelineSpec, Task
from .engine import SimResult, TaskRecord

DelayFn = Callable[[int, int, int, Task], float]


def _durations(records: Iterable[TaskRecord]) -> dict[tuple[int, int, str, int], float]:
    return {(r.step, r.task[0], r.task[1], r.task[2]): r.end - r.start for r in records}


def lower_bound(
    spec: PipelineSpec,
    records: Sequence[TaskRecord],
    *,
    delay: DelayFn | None = None,
    steps: int = 1,
    step_overhead: float = 0.0,
) -> float:
    """A lower bound on the makespan of any schedule of ``spec`` whose tasks take the durations
    in ``records`` (derivation in the module docstring), in seconds.

    Args:
        records: every task of the run (``simulate(..., record=True)``).
        delay: the run's message delays; must be a pure function of its arguments (as
            :class:`~rrfp.sim.duration.CommModel` is). None: messages are free.
        steps: the run's step count; step_overhead: seconds between a rank's steps.

    Raises:
        ValueError: when ``records`` lacks a task of the run.
    """
    dur = _durations(records)
    place = spec.placement
    P, S, M = place.n_ranks, spec.n_stages, spec.n_microbatches
    bk = spec.backward_kind
    rank_of = [place.rank_of(s) for s in range(S)]
    expected = steps * len(spec.all_tasks())
    if len(dur) != expected:
        raise ValueError(f"lower bound: {len(dur)} task records for {expected} tasks ({steps} steps)")

    def msg(step: int, src_stage: int, dst_stage: int, task: Task) -> float:
        if delay is None or rank_of[src_stage] == rank_of[dst_stage]:
            return 0.0
        return delay(step, rank_of[src_stage], rank_of[dst_stage], task)

    last = steps - 1
    # fill[s][m]: earliest start of F(s, m) in step 0 by its forward chain alone.
    fill = [[0.0] * M for _ in range(S)]
    for s in range(1, S):
        for m in range(M):
            fill[s][m] = fill[s - 1][m] + dur[(0, s - 1, F, m)] + msg(0, s - 1, s, Task(s - 1, F, m))
    # drain[s][m]: time after B(s, m) ends until B(0, m) can end, last step.
    drain = [[0.0] * M for _ in range(S)]
    for s in range(1, S):
        for m in range(M):
            drain[s][m] = drain[s - 1][m] + msg(last, s, s - 1, Task(s, bk, m)) + dur[(last, s - 1, bk, m)]

    work = [0.0] * P
    for (_, s, _, _), d in dur.items():
        work[rank_of[s]] += d
    best = 0.0
    for r in range(P):
        s0 = min(s for s in range(S) if rank_of[s] == r)
        head = min(fill[s0])
        tail = 0.0 if spec.split_backward else min(drain[s0])
        best = max(best, head + work[r] + (steps - 1) * step_overhead + tail)
    for k in range(steps):
        for m in range(M):
            t = 0.0
            for s in range(S):
                t += dur[(k, s, F, m)] + (msg(k, s, s + 1, Task(s, F, m)) if s + 1 < S else 0.0)
            tail_w = 0.0
            for s in range(S - 1, -1, -1):
                t += dur[(k, s, bk, m)]
                if spec.split_backward:
                    tail_w = max(tail_w - dur[(k, s, bk, m)], dur[(k, s, W, m)])
                if s > 0:
                    c = msg(k, s, s - 1, Task(s, bk, m))
                    t += c
                    tail_w = max(0.0, tail_w - c)
            best = max(best, t + tail_w)
    return best


def peak_memory_by_rank(spec: PipelineSpec, records: Sequence[TaskRecord], act_bytes: Sequence[int]) -> list[int]:
    """Per rank, the most activation bytes held at once: ``act_bytes[s]`` from the end of
    ``F(s, m)`` to the end of its input backward (``B`` or ``I``), summed over the rank's
    stages and replayed in time order (exact, unlike the per-stage peaks summed)."""
    P = spec.placement.n_ranks
    events: list[list[tuple[float, int]]] = [[] for _ in range(P)]
    for rec in records:
        s, k, _ = rec.task
        if k == F:
            events[rec.rank].append((rec.end, act_bytes[s]))
        elif k in (B, I):
            events[rec.rank].append((rec.end, -act_bytes[s]))
    out = []
    for ev in events:
        ev.sort()
        cur = peak = 0
        for _, b in ev:
            cur += b
            peak = max(peak, cur)
        out.append(peak)
    return out


@dataclass
class RunSummary:
    """One simulated run, ready for a table.

    Attributes:
        hint: the hint text (``bf``, ``strict-1f1b``...).
        makespan: seconds.
        bubble: per rank, idle time / makespan.
        peak_inflight: per stage, the most microbatches held (forward done, backward not).
        peak_memory: per stage, ``peak_inflight * act_bytes`` (bytes).
        peak_memory_rank: per rank, the most activation bytes held at once (bytes).
        lower_bound: seconds (:func:`lower_bound`).
        speedup: baseline makespan / this makespan (None without a baseline).
        limit: the in-flight limit used (an int, or per rank).
    """

    hint: str
    makespan: float
    bubble: list[float]
    peak_inflight: list[int]
    peak_memory: list[int]
    peak_memory_rank: list[int]
    lower_bound: float
    speedup: float | None = None
    limit: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """makespan / lower bound (>= 1)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else math.inf

    @property
    def bubble_mean(self) -> float:
        return sum(self.bubble) / len(self.bubble)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["bubble_mean"] = self.bubble_mean
        return d


def summarize(
    hint: str,
    spec: PipelineSpec,
    result: SimResult,
    act_bytes: Sequence[int],
    *,
    delay: DelayFn | None = None,
    steps: int = 1,
    step_overhead: float = 0.0,
    limit: Any = None,
) -> RunSummary:
    """Collect a :class:`RunSummary` from a run made with ``record=True``."""
    lb = lower_bound(spec, result.records, delay=delay, steps=steps, step_overhead=step_overhead)
    held = result.peak_inflight_stage
    return RunSummary(
        hint=hint,
        makespan=result.makespan,
        bubble=result.bubble_fraction(),
        peak_inflight=list(held),
        peak_memory=[h * a for h, a in zip(held, act_bytes)],
        peak_memory_rank=peak_memory_by_rank(spec, result.records, act_bytes),
        lower_bound=lb,
        limit=limit,
    )


def set_speedups(rows: Sequence[RunSummary], baseline: RunSummary | None) -> None:
    """Fill each row's ``speedup`` = baseline makespan / its makespan."""
    for r in rows:
        r.speedup = baseline.makespan / r.makespan if baseline and r.makespan > 0 else None


_COLUMNS = (
    ("policy", lambda r, d: r.hint),
    ("makespan_s", lambda r, d: f"{r.makespan:.{d}f}"),
    ("speedup", lambda r, d: "" if r.speedup is None else f"{r.speedup:.3f}"),
    ("lower_bound_s", lambda r, d: f"{r.lower_bound:.{d}f}"),
    ("makespan/bound", lambda r, d: f"{r.ratio:.3f}"),
    ("bubble_mean", lambda r, d: f"{r.bubble_mean:.3f}"),
    ("bubble_max", lambda r, d: f"{max(r.bubble):.3f}"),
    ("peak_inflight_max", lambda r, d: str(max(r.peak_inflight))),
    ("peak_act_MiB_max", lambda r, d: f"{max(r.peak_memory_rank) / 2**20:.1f}"),
)


def seconds_decimals(values: Sequence[float], digits: int = 4) -> int:
    """Decimals that show the smallest positive finite value with ``digits`` significant
    digits (0 to 9), so one table's seconds all print with the same decimals."""
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if not pos:
        return digits - 1
    return min(9, max(0, digits - 1 - math.floor(math.log10(min(pos)))))


def table_rows(rows: Sequence[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of a side-by-side table (seconds with the same decimals in
    every row: :func:`seconds_decimals`)."""
    d = seconds_decimals([x for r in rows for x in (r.makespan, r.lower_bound)])
    return [c for c, _ in _COLUMNS], [[f(r, d) for _, f in _COLUMNS] for r in rows]


def format_text(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A fixed-width text table."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def format_markdown(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def format_csv(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """CSV text with a header row."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(cells)
    return buf.getvalue()


def to_json(rows: Sequence[RunSummary], config: dict[str, Any]) -> str:
    """JSON text: ``{"config": ..., "runs": [RunSummary as a dict, ...]}``."""
    # Strict JSON: an infinite bandwidth is "inf", not Infinity.
    return strict_json.dumps({"config": config, "runs": [r.to_dict() for r in rows]}, indent=1, default=str)


# Derivation, for one stage ``s`` on rank ``r`` with budget ``b_r``:
#
# - ``k``: the most microbatches whose stage-``s`` activations fit in ``b_r`` together (the
#   ``k`` smallest sizes sum to at most ``b_r``; at least 1: the ledger admits a lone
#   microbatch whatever its size). Other stages' bytes on ``r`` are ignored, which can only
#   raise ``k``, so the bound stays valid.
# - Microbatch ``m`` holds its stage-``s`` bytes from the start of ``F(s, m)`` at the
#   earliest until its *release*: the end of its input backward ``B``/``I`` of ``s`` or, when
#   the ledger keeps a split backward's bytes until ``W`` (``held_until_w``, the simulator's
#   rule, :mod:`rrfp.scheduler.memory`), of ``W(s, m)``. In between lies its round trip
#   ``RT(m)``: ``F(s..S-1, m)``, the activations' messages, ``B/I(S-1..s, m)``, the
#   gradients' messages, and ``W(s, m)`` when held until it.
# - Order the stage's forwards by start time, ``t_0 <= t_1 <= ...``. When ``F`` number ``j
#   >= k`` starts, at most ``k - 1`` others are held, so one of the forwards numbered ``j -
#   k`` or later was released before: ``t_j >= t_{j-k} + RT``. Chained from the last
#   forward, over ``n = floor((M - 1) / k)`` distinct microbatches: ``t_{M-1} >= head +``
#   the sum of the ``n`` smallest ``RT``, ``head`` being the earliest any ``F(s, m)`` can
#   start (its forward chain from stage 0). With ``k = 1`` the round trips are disjoint, so
#   the last one starts after all the others': ``head + sum(RT) - RT(m_last)``, and it
#   ends no earlier than its own round trip.
# - The microbatch started last still runs its whole chain from ``F(s, m)``: its round trip
#   up to stage ``S-1`` and back down to stage 0, plus ``W(0, m)`` with a split backward.
#
# With one stage per rank at 1F1B's budget the last rank holds one microbatch (``k = 1``):
# its ``F``, ``I`` and ``W`` (or ``F``, ``B``) run back to back, and with equal stages and free
# messages the bound reads ``(S - 1) F + (M - 1)(F + I + W) + F + I + (S - 1) I + W``:
# ``(M + S - 1)(F + B)`` with the full backward (strict 1F1B reaches it, so no full-backward
# hint can beat it there) and ``(S - 1)(F + I) + M (F + B)`` with the split. At ``I = W = F``
# the ceiling over strict 1F1B is 1.056x-1.070x for 4-32 ranks, not the 1.12x-1.15x of the
# memory-blind :func:`lower_bound`.
def memory_bound(
    spec: PipelineSpec,
    records: Sequence[TaskRecord],
    budgets: Sequence[int | None],
    act_bytes: Callable[[int, int, int], int],
    *,
    delay: DelayFn | None = None,
    held_until_w: bool = True,
) -> float:
    """A lower bound on the makespan of one step of any schedule of ``spec`` that keeps every
    rank's activation bytes within its budget (the memory-aware ceiling), in seconds; 0 when
    no budget binds. Never above a valid bound, so ``max(lower_bound, memory_bound)`` is one.

    The derivation is in the comment above this function.

    Args:
        records: every task of one step (``simulate(..., steps=1, record=True)``).
        budgets: per rank, bytes (None: no budget on that rank).
        act_bytes: ``act_bytes(step, stage, mb)``, what the ledger counts for ``F(stage, mb)``.
        delay: the run's message delays (a pure function, as for :func:`lower_bound`).
        held_until_w: a split backward's bytes stay held until ``W`` (the simulator's ledger).

    Raises:
        ValueError: records that are not exactly one step's tasks.
    """
    dur = _durations(records)
    place = spec.placement
    S, M = spec.n_stages, spec.n_microbatches
    if len(dur) != len(spec.all_tasks()) or any(k[0] != 0 for k in dur):
        raise ValueError(f"memory bound: {len(dur)} task records for the {len(spec.all_tasks())} tasks of one step")
    bk, split = spec.backward_kind, spec.split_backward
    rank_of = [place.rank_of(s) for s in range(S)]

    def msg(src: int, dst: int, task: Task) -> float:
        if delay is None or rank_of[src] == rank_of[dst]:
            return 0.0
        return delay(0, rank_of[src], rank_of[dst], task)

    pf, pu, pb, pd = _chain_sums(S, M, dur, bk, msg)
    best = 0.0
    for s in range(S):
        b = budgets[rank_of[s]]
        k = _fitting(sorted(act_bytes(0, s, m) for m in range(M)), b) if b is not None else M
        if k >= M:
            continue
        rts, chains, heads = [], [], []
        for m in range(M):
            f, u, bw, d = pf[m], pu[m], pb[m], pd[m]
            head = f[s] + u[s]
            trip = (f[S] - f[s]) + (u[S - 1] - u[s]) + (bw[S] - bw[s]) + (d[S - 1] - d[s])
            rest = bw[s] + d[s]
            w_s = dur[(0, s, W, m)] if split and held_until_w else 0.0
            heads.append(head)
            rts.append(trip + w_s)
            chains.append(trip + rest + (dur[(0, 0, W, m)] if split else 0.0))
        if k == 1:
            # One at a time: every other microbatch's round trip precedes the last one's.
            tail = min(max(c - rt, 0.0) for c, rt in zip(chains, rts))
            best = max(best, min(heads) + sum(rts) + tail)
        else:
            best = max(best, min(heads) + sum(sorted(rts)[:(M - 1) // k]) + min(chains))
    return best


def _fitting(sizes: Sequence[int], budget: int) -> int:
    """How many of ``sizes`` (ascending) fit in ``budget`` together; at least 1 (the ledger
    admits a lone microbatch whatever its size)."""
    k, total = 0, 0
    for x in sizes:
        if total + x > budget:
            break
        total += x
        k += 1
    return max(k, 1)


def _chain_sums(S: int, M: int, dur: dict, bk: str, msg: Callable[[int, int, Task], float]):
    """Per microbatch, prefix sums over stages (index ``j``: the sum over stages below ``j``)
    of the forwards, the activations' messages (``j -> j + 1``), the input backwards and the
    gradients' messages (``j + 1 -> j``), so each stage's chains cost O(1) in
    :func:`memory_bound`. Returns ``(pf, pu, pb, pd)``, each ``M`` lists."""
    from itertools import accumulate

    pf, pu, pb, pd = [], [], [], []
    for m in range(M):
        pf.append(list(accumulate((dur[(0, j, F, m)] for j in range(S)), initial=0.0)))
        pb.append(list(accumulate((dur[(0, j, bk, m)] for j in range(S)), initial=0.0)))
        pu.append(list(accumulate((msg(j, j + 1, Task(j, F, m)) for j in range(S - 1)), initial=0.0)))
        pd.append(list(accumulate((msg(j + 1, j, Task(j + 1, bk, m)) for j in range(S - 1)), initial=0.0)))
    return pf, pu, pb, pd
