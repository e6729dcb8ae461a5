"""Named schedules compiled to per-rank total orders, and their text and CSV forms.

An order is a list of :class:`~rrfp.scheduler.tasks.Task` per rank (``Order``, indexed by rank).
Run strictly it is the fixed-order baseline; run in readiness mode it is a hint (RRFP §4: "any
total order is also a valid hint"). One generator per schedule is the single source of truth;
where ``torch.distributed.pipelining`` has the same schedule, the generator reproduces that
class's per-rank compute actions (communication actions aside), which the tests check.

============================  ==========================  ==========================================
name                          placement                   PyTorch class (compute actions)
============================  ==========================  ==========================================
``gpipe``                     any                         ``ScheduleGPipe`` (V = 1)
``looped-bfs``                any                         ``ScheduleLoopedBFS``
``1f1b``                      V = 1                       ``Schedule1F1B``
``interleaved-1f1b``          ``loop``, any V             ``ScheduleInterleaved1F1B``
``zb-h1``                     V = 1, split backward       ``ScheduleInterleavedZeroBubble`` (V = 1)
``zb-v``                      ``v``, V = 2, split         ``ScheduleZBVZeroBubble``
``dualpipev``                 ``v``, V = 2, split         ``ScheduleDualPipeV`` (full ``B`` as ``I W``)
============================  ==========================  ==========================================

Text forms: one rank's order is PyTorch's action grammar separated by spaces (``"0F0 0F1 0B0"``);
a whole schedule is one line per rank, optionally labelled ``rank<r>:`` (:func:`format_orders`,
:func:`parse_orders`); the CSV form is one row per rank, one action per cell, exactly what
``PipelineScheduleMulti._dump_csv`` writes for a compute-only schedule (:func:`dump_order_csv`,
:func:`load_order_csv`).

Pure module: no torch, no asyncio; :func:`load_order_csv` is the only function that may read a
file, and only when given a path.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import Callable, Sequence, Union

from .tasks import B, F, I, W, PipelineSpec, Task, parse_action, parse_order

Order = list[list[Task]]  # per rank


# ----------------------------------------------------------------- backward forms
def _expand_backward(spec: PipelineSpec, order: list[Task]) -> list[Task]:
    """In split-backward mode a full ``B`` becomes ``I`` followed at once by ``W``."""
    if not spec.split_backward:
        return order
    out: list[Task] = []
    for t in order:
        if t.kind == B:
            out += [Task(t.stage, I, t.mb), Task(t.stage, W, t.mb)]
        else:
            out.append(t)
    return out


def _merge_backward(spec: PipelineSpec, order: list[Task]) -> list[Task]:
    """Without a split backward, a zero-bubble order's ``I`` becomes a full ``B`` and its ``W``
    disappears (the weight gradient is computed with the input gradient)."""
    if spec.split_backward:
        return order
    return [Task(t.stage, B, t.mb) if t.kind == I else t for t in order if t.kind != W]


def _need_one_stage_per_rank(spec: PipelineSpec, name: str, instead: str) -> None:
    if spec.placement.n_virtual != 1:
        raise ValueError(
            f"schedule {name} takes 1 virtual stage per rank, got {spec.placement.n_virtual}: "
            f"use {instead}"
        )


# ----------------------------------------------------------------- generators
def gpipe(spec: PipelineSpec) -> Order:
    """GPipe: every forward, then every backward, microbatches in ascending order.

    With virtual stages, a rank runs its stages' forwards in pipeline order and their
    backwards in reverse pipeline order. Equals ``torch.distributed.pipelining.ScheduleGPipe``
    for one stage per rank (GPipe, Huang et al. 2019).

    Returns:
        ``Order``: per rank, ``2 * V * M`` tasks (``3 * V * M`` with a split backward, each
        ``B`` becoming ``I`` then ``W``).
    """
    orders = []
    M = spec.n_microbatches
    for r in range(spec.placement.n_ranks):
        stages = spec.placement.stages_of(r)
        order = [Task(s, F, m) for s in stages for m in range(M)]
        order += [Task(s, B, m) for s in reversed(stages) for m in range(M)]
        orders.append(_expand_backward(spec, order))
    return orders


def looped_bfs(spec: PipelineSpec) -> Order:
    """Breadth-first looped pipeline, as ``torch.distributed.pipelining.ScheduleLoopedBFS``
    (Lamy-Poirier 2023, arXiv 2211.05953): all forwards stage by stage in pipeline order,
    then all backwards in reverse stage order, each stage's microbatches in *descending* order
    (PyTorch's choice; the last forward's activation is the first one consumed).

    Returns:
        ``Order``, as :func:`gpipe`.
    """
    orders = []
    M = spec.n_microbatches
    for r in range(spec.placement.n_ranks):
        stages = spec.placement.stages_of(r)
        order = [Task(s, F, m) for s in stages for m in range(M)]
        order += [Task(s, B, m) for s in reversed(stages) for m in reversed(range(M))]
        orders.append(_expand_backward(spec, order))
    return orders


def one_f_one_b(spec: PipelineSpec) -> Order:
    """1F1B (PipeDream-Flush) as ``torch.distributed.pipelining.Schedule1F1B`` executes it:
    rank ``r`` of ``p`` runs ``min(M, p - r)`` warm-up forwards, then alternates one backward
    and one forward, then drains the remaining backwards. Unlike PyTorch, ``M < p`` is allowed.

    Raises:
        ValueError: with virtual stages (use ``interleaved-1f1b``).
    """
    _need_one_stage_per_rank(spec, "1f1b", "interleaved-1f1b")
    p, M = spec.placement.n_ranks, spec.n_microbatches
    orders = []
    for r in range(p):
        warm = min(M, p - r)
        order = [Task(r, F, m) for m in range(warm)]
        for i in range(M - warm):
            order += [Task(r, B, i), Task(r, F, warm + i)]
        order += [Task(r, B, m) for m in range(M - warm, M)]
        orders.append(_expand_backward(spec, order))
    return orders


def one_f_one_b_limits(n_ranks: int) -> list[int]:
    """The most microbatches 1F1B keeps in flight on each rank (``p - r``): the in-flight limit
    that matches 1F1B's activation memory."""
    return [n_ranks - r for r in range(n_ranks)]


def microbatches_per_round(n_ranks: int, n_microbatches: int) -> int:
    """PyTorch's "flexible" round size for interleaved schedules: ``M // max(1, M // p)``.

    Raises:
        ValueError: when ``M`` is not a multiple of the number of rounds ``max(1, M // p)``
            (PyTorch refuses the same shapes, e.g. ``p = 4, M = 9``).
    """
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        ok = [m for m in range(n_microbatches - 3, n_microbatches + 4)
              if m > 0 and m % max(1, m // n_ranks) == 0]
        raise ValueError(
            f"{n_microbatches} microbatches on {n_ranks} ranks: interleaved schedules need a "
            f"multiple of the number of rounds max(1, M // ranks) = {rounds} "
            f"(nearby valid counts: {', '.join(map(str, ok))})"
        )
    return n_microbatches // rounds


def _interleaved_rank_order(spec: PipelineSpec, rank: int, zero_bubble: bool) -> list[Task]:
    # Mirrors torch.distributed.pipelining.schedules._get_1f1b_rank_ops with its warm-up
    # formula (_get_warmup_ops); "op" counts forward slots, each stage's microbatches are issued
    # in ascending order, and the stage of a slot follows the round-robin over rounds.
    p, V, M = spec.placement.n_ranks, spec.placement.n_virtual, spec.n_microbatches
    mpr = microbatches_per_round(p, M) if V > 1 else M
    factor = 1 if zero_bubble else 2
    warmup = min((V - 1) * mpr + factor * (p - 1 - rank), M * V)
    steady = M * V - warmup
    bk = I if zero_bubble else B

    def f_stage(op: int) -> int:
        return ((op // mpr) % V) * p + rank

    def b_stage(op: int) -> int:
        return (V - 1 - ((op - warmup) // mpr) % V) * p + rank

    next_mb = {F: [0] * V, bk: [0] * V, W: [0] * V}

    def take(kind: str, stage: int) -> Task:
        v = stage // p
        m = next_mb[kind][v]
        next_mb[kind][v] += 1
        return Task(stage, kind, m)

    order: list[Task] = []
    backward_ops: list[int] = []
    n_w = 0
    for op in range(M * V + warmup):
        if op < warmup + steady:
            order.append(take(F, f_stage(op)))
            if op < warmup:
                continue
        order.append(take(bk, b_stage(op)))
        backward_ops.append(op)
        # ZB-H1: rank r holds back its first r weight gradients to fill the cool-down bubble.
        if zero_bubble and op - warmup >= rank:
            order.append(take(W, b_stage(backward_ops[n_w])))
            n_w += 1
    if zero_bubble:
        order += [take(W, b_stage(op)) for op in backward_ops[n_w:]]
    return order


def interleaved_1f1b(spec: PipelineSpec) -> Order:
    """Interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473) as
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B``: ``loop`` placement, ``V`` virtual
    stages per rank, microbatches issued in rounds of ``M // max(1, M // p)`` (PyTorch's
    relaxation of ``M % p == 0``); rank ``r`` warms up with
    ``min((V - 1) * round + 2 * (p - 1 - r), V * M)`` forwards, then runs one forward and one
    backward per slot (forward first), then drains.

    With ``V = 1`` any ``M`` is accepted (the round size then changes nothing; PyTorch still
    refuses the counts it refuses for ``V > 1``).

    Raises:
        ValueError: for the ``v`` placement with ``V > 1``, or, with ``V > 1``, a microbatch
            count PyTorch refuses (see :func:`microbatches_per_round`).
    """
    if spec.placement.kind != "loop" and spec.placement.n_virtual > 1:
        raise ValueError("schedule interleaved-1f1b needs the loop placement (stage s on rank s % ranks)")
    return [
        _expand_backward(spec, _interleaved_rank_order(spec, r, zero_bubble=False))
        for r in range(spec.placement.n_ranks)
    ]


def zb_h1(spec: PipelineSpec) -> Order:
    """Zero-bubble ZB-H1 (Qi et al. 2024, arXiv 2401.10241 §3): 1F1B's memory with split
    backward, rank ``r`` deferring its first ``r`` weight gradients ``W`` to fill the cool-down.
    Equals ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` with one stage per rank
    (which is the paper's H1 order: ``p - r`` warm-up forwards, then F, I[, W] per slot), for
    any ``M`` (PyTorch rejects some ``M`` that only matter with virtual stages).

    Without a split backward each ``I`` becomes a full ``B`` and ``W`` is dropped (plain 1F1B).

    Raises:
        ValueError: with virtual stages.
    """
    _need_one_stage_per_rank(spec, "zb-h1", "zb-v or interleaved-1f1b")
    return [
        _merge_backward(spec, _interleaved_rank_order(spec, r, zero_bubble=True))
        for r in range(spec.placement.n_ranks)
    ]


def zb_v(spec: PipelineSpec) -> Order:
    """Zero-bubble ZB-V (Qi et al. 2024, arXiv 2401.10241 §6) as
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble``: two virtual stages per rank in the
    ``v`` placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``), split backward. PyTorch
    builds the order for ``max(M, 2p - 1)`` microbatches and drops the extra ones; so do we.

    Without a split backward each ``I`` becomes a full ``B`` and ``W`` is dropped.

    Raises:
        ValueError: unless the placement is ``v`` with exactly 2 virtual stages per rank.
    """
    pl = _need_v_pair(spec, "zb-v")
    p, M = pl.n_ranks, spec.n_microbatches
    n = max(2 * p - 1, M)
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o: list[Task] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - r) - 1):
            o.append(Task(s0, F, f0)); f0 += 1
        for _ in range(r):
            o.append(Task(s1, F, f1)); f1 += 1
            o.append(Task(s0, F, f0)); f0 += 1
        for _ in range(p - r):
            o.append(Task(s1, F, f1)); f1 += 1
            o += [Task(s1, I, b1), Task(s1, W, b1)]; b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                o.append(Task(s0, F, f0)); f0 += 1
            o += [Task(s0, I, b0), Task(s0, W, b0)]; b0 += 1
            o.append(Task(s1, F, f1)); f1 += 1
            o += [Task(s1, I, b1), Task(s1, W, b1)]; b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            o.append(Task(s0, I, b0)); b0 += 1
            o.append(Task(s1, I, b1)); b1 += 1
        for _ in range(p - r):
            o.append(Task(s0, I, b0)); b0 += 1
            o.append(Task(s0, W, w0)); w0 += 1
        o += [Task(s1, W, m) for m in range(w1, b1)]
        o += [Task(s0, W, m) for m in range(w0, b0)]
        orders.append(_merge_backward(spec, [t for t in o if t.mb < M]))
    return orders


SCHEDULES: dict[str, Callable[[PipelineSpec], Order]] = {
    "gpipe": gpipe,
    "looped-bfs": looped_bfs,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
}
"""Named schedule generators: ``name -> (spec -> Order)``; each is a hint of the hint table
(:mod:`rrfp.scheduler.registry`, which holds its default backward form)."""



# ----------------------------------------------------------------- text forms
def format_orders(orders: Sequence[Sequence[Task]]) -> str:
    """Multi-line text of a whole schedule, one ``rank<r>: <actions>`` line per rank; the
    inverse of :func:`parse_orders`."""
    return "\n".join(f"rank{r}: {' '.join(map(str, o))}" for r, o in enumerate(orders))


_RANK_LABEL = re.compile(r"^\s*(?:rank\s*)?(\d+)\s*:(.*)$", re.IGNORECASE | re.DOTALL)


def parse_orders(text: Union[str, Sequence[str]]) -> Order:
    """Parse per-rank orders written in PyTorch's action grammar.

    ``text`` is either a list of strings, one per rank (``["0F0 0B0", "1F0 1B0"]``), or one
    string with one rank per line or per ``|``-separated part. A part may carry a label
    ``rank<r>:`` (or ``<r>:``); labelled parts may come in any order but must name ranks
    ``0..p-1`` once each. Within a rank, whitespace and commas separate actions. Blank lines
    are ignored.

    Returns:
        ``Order``: per rank, the tasks in the given order.

    Raises:
        ValueError: naming the offending action or label.
    """
    parts = list(text) if not isinstance(text, str) else re.split(r"[\n|]", text)
    labelled: dict[int, list[Task]] = {}
    plain: list[list[Task]] = []
    for part in parts:
        if not part.strip():
            if not isinstance(text, str):  # an explicit empty rank in a list stays a rank
                plain.append([])
            continue
        m = _RANK_LABEL.match(part)
        if m:
            r = int(m.group(1))
            if r in labelled:
                raise ValueError(f"rank {r} is given twice")
            labelled[r] = parse_order(m.group(2))
        else:
            plain.append(parse_order(part))
    if labelled and plain:
        raise ValueError("mix of labelled (rank<r>:) and unlabelled rank orders")
    if labelled:
        # The first gap, found without listing every rank up to a huge label.
        first_missing = next((r for r in range(len(labelled) + 1) if r not in labelled), None)
        if first_missing is not None and first_missing < max(labelled):
            raise ValueError(
                f"no order given for rank {first_missing} (labels name ranks {sorted(labelled)[:8]}"
                f"{'...' if len(labelled) > 8 else ''})"
            )
        return [labelled[r] for r in range(len(labelled))]
    return plain


# torch's non-compute actions (communication, FSDP, gradient reduction): the runtime moves
# messages by itself, so a compute+comms CSV loads as its compute actions.
_NON_COMPUTE = re.compile(r"^\d+(?:UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def _csv_cell(cell: str, rank: int, col: int) -> list[Task]:
    cell = cell.strip()
    if not cell or _NON_COMPUTE.match(cell):
        return []
    m = _OVERLAP.match(cell)
    subs = m.group(1).split(";") if m else [cell]
    try:
        return [parse_action(s) for s in subs if s.strip()]
    except ValueError as e:
        raise ValueError(f"CSV row {rank} (rank {rank}), cell {col}: {e}") from None


def load_order_csv(path_or_text: Union[str, os.PathLike]) -> Order:
    """Load per-rank orders from PyTorch's schedule CSV (``PipelineScheduleMulti._dump_csv`` /
    ``_load_csv``, compute-only format): row ``r`` is rank ``r``'s actions, one per cell, such
    as ``0F0``. Empty cells (PyTorch's idle slots) are skipped, as are communication and FSDP
    actions (``SEND_F``, ``UNSHARD``, ``REDUCE_GRAD``...); an ``(a;b)OVERLAP_F_B`` cell counts
    as ``a`` then ``b``. Trailing empty rows are dropped.

    ``path_or_text`` is CSV text when it is a ``str`` containing a newline or a comma;
    otherwise (a ``str`` or ``os.PathLike``) it is the path of a file to read.

    Returns:
        ``Order``: one list of tasks per row.

    Raises:
        ValueError: naming the row and cell of an unparsable action.
        OSError: when the file cannot be read.
    """
    if isinstance(path_or_text, str) and ("\n" in path_or_text or "," in path_or_text):
        text = path_or_text
    else:
        with open(path_or_text, newline="") as f:
            text = f.read()
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    return [[t for c, cell in enumerate(row) for t in _csv_cell(cell, r, c)] for r, row in enumerate(rows)]


def dump_order_csv(orders: Sequence[Sequence[Task]]) -> str:
    """CSV text of per-rank orders in PyTorch's compute-only format (one row per rank), which
    ``PipelineScheduleMulti._load_csv`` and :func:`load_order_csv` read back."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for o in orders:
        writer.writerow([str(t) for t in o])
    return buf.getvalue()


# ----------------------------------------------------------------- DualPipeV
def _need_v_pair(spec: PipelineSpec, name: str):
    """The placement, if it is ``v`` with exactly 2 virtual stages per rank (any kind with one
    rank); else a one-line ``ValueError`` naming schedule ``name``."""
    pl = spec.placement
    if pl.n_virtual != 2 or (pl.kind != "v" and pl.n_ranks > 1):
        raise ValueError(
            f"{name} needs 2 virtual stages per rank in the v placement (got {pl.n_virtual} virtual "
            f"stage{'s' if pl.n_virtual != 1 else ''}, {pl.kind} placement)"
        )
    return pl


def dualpipev(spec: PipelineSpec) -> Order:
    """DualPipeV (DeepSeek-V3, arXiv 2412.19437 §3.2.1, in its "cut-in-half" V form) as
    ``torch.distributed.pipelining.ScheduleDualPipeV`` orders it: two virtual stages per rank
    in the ``v`` placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``). Rank ``r`` runs
    ``2(p - r - 1)`` forwards of its first stage, ``r + 1`` pairs of forwards on both, then
    zero-bubble ``I``/``W``/``F`` on its second stage, then the main phase of a forward on one
    stage beside a backward on the other (PyTorch's ``OVERLAP_F_B``: here the forward, then the
    backward), and drains with full backwards turning into ``I`` (weight gradients deferred to
    the end) halfway through.

    PyTorch mixes full backwards ``B`` and split ``I``/``W`` in one rank's list; an rrfp order
    has one form, so with a split backward (the default) each full ``B`` becomes ``I`` followed
    at once by ``W`` (the same work in the same place), and without it each ``I`` becomes ``B``
    and ``W`` is dropped. PyTorch refuses fewer microbatches than stages (``M < 2p``); here the
    order is built for ``max(M, 2p)`` and the extra microbatches are dropped, as :func:`zb_v`
    does (removing whole microbatches keeps a strict order deadlock-free).

    Returns:
        ``Order``: per rank, ``6 M`` tasks with a split backward, ``4 M`` without.

    Raises:
        ValueError: unless the placement is ``v`` with exactly 2 virtual stages per rank.
    """
    pl = _need_v_pair(spec, "dualpipev")
    p, M = pl.n_ranks, spec.n_microbatches
    n = max(M, 2 * p)
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o: list[Task] = []
        nxt: dict[tuple[int, str], int] = {}  # (stage, F or backward) -> next microbatch
        weights: list[Task] = []  # W of each I so far, oldest first

        def add(stage: int, kind: str) -> None:
            key = (stage, F if kind == F else B)
            m = nxt.get(key, 0)
            nxt[key] = m + 1
            o.append(Task(stage, kind, m))
            if kind == I:
                weights.append(Task(stage, W, m))

        def add_w() -> None:
            if weights:
                o.append(weights.pop(0))

        for _ in range(2 * (p - r - 1)):
            add(s0, F)
        for _ in range(r + 1):
            add(s0, F); add(s1, F)
        for _ in range(p - r - 1):
            add(s1, I); add_w(); add(s1, F)
        for i in range(n - 2 * p + r + 1):
            # The last rank's first pair runs unoverlapped in PyTorch; the order is the same.
            add(s0, F); add(s1, B)
            add(s1, F); add(s0, B)
        for _ in range(p - r - 1):
            add(s1, B)
            add(s1, F); add(s0, B)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(s1, I if split else B)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(s0, I if split else B)
        for _ in range(p - r - 1):
            add_w()
            add(s0, I if split else B)
        for _ in range(r + 1):
            add_w()
        kept = [t for t in o if t.mb < M]
        if spec.split_backward:
            kept = [x for t in kept for x in ([Task(t.stage, I, t.mb), Task(t.stage, W, t.mb)] if t.kind == B else [t])]
        orders.append(_merge_backward(spec, kept))
    return orders


SCHEDULES["dualpipev"] = dualpipev
