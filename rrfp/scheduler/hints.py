"""Hints: a rank's ordered preference over its ready tasks (RRFP §4, App. A).

A hint is either a *policy* (``bf``, ``bfw``, ``bfw-alt``, ``fb``, ``b-priority``,
``f-priority``, the depth-first ``-df`` variants and the memory-aware ``bfw-mem``: the
kind-ranking policies registered in :mod:`rrfp.scheduler.policy`), which ranks whatever is
ready by kind, or a *total order* per rank: compiled from a named schedule
(:data:`~rrfp.scheduler.schedules.SCHEDULES`: ``gpipe``, ``looped-bfs``, ``1f1b``,
``interleaved-1f1b``, ``zb-h1``, ``zb-v``) or given by the user as text or a CSV file.

Any hint runs in readiness mode (dispatch the best-ranked ready task, skip unready ones) or,
prefixed ``strict-``, in strict mode (the fixed-order baseline: run only the order's next task,
waiting for it). A policy in strict mode is first compiled into a total order by running it
with nominal durations (:func:`compile_policy`).

Hint text grammar (:func:`resolve_hint`)::

    [strict-]<name>            a policy or named schedule, e.g. "bf", "strict-zb-v"
    wfloat, ahead              the placement's split order with floating W (no strict form;
                               :mod:`rrfp.scheduler.wfloat`)
    [strict-]order:<orders>    per-rank orders inline, ranks separated by newlines or "|",
                               optionally labelled: "order:rank0: 0F0 0B0 | rank1: 1F0 1B0"
    [strict-]csv:<path>        a PyTorch compute-only schedule CSV (one row per rank)
    [strict-]<path>.csv        the same, recognised by the suffix

Pure module: no torch, no asyncio; only the CSV form reads a file.
"""

from __future__ import annotations

import dataclasses

import heapq
from typing import Sequence, Union

from . import wfloat as _wfloat  # noqa: F401  (registers the w-float policies)
from .arbiter import Arbiter
from .policy import KIND_POLICIES, Hint, placement_schedule
from .schedules import SCHEDULES, SPLIT_BACKWARD_DEFAULT, Order, load_order_csv, parse_orders
from .tasks import B, F, I, W, PipelineSpec, Placement
from .validate import ScheduleError, validate_schedule

POLICIES = {name: (p.first, p.alternate, p.split) for name, p in KIND_POLICIES.items()}
"""The kind-ranking policies (:data:`rrfp.scheduler.policy.KIND_POLICIES`), name ->
``(kind the first round prefers, alternates?, split backward?)``."""
HINT_NAMES = tuple(POLICIES) + tuple(SCHEDULES)

STRICT_SPLIT = "split"
"""The placement's own fixed order (:func:`~rrfp.scheduler.policy.placement_schedule`: 1F1B,
interleaved 1F1B or ZB-V) with each backward split into ``I`` then ``W`` at once: same order,
same bytes, but the gradient leaves after ``I``. ``strict-split`` runs it strictly."""
BACKFILL = "backfill"
"""``backfill`` and ``backfill:<strict order>``: a strict order (default ``split``) with
conservative backfilling (:mod:`rrfp.scheduler.backfill`); always strict. The simulator's
"started" notices are instant; the runtime's travel on its control plane
(:mod:`rrfp.runtime.features.notices`)."""
WFLOAT = "wfloat"
"""The placement's split order (as ``split``) whose ``W`` tasks float later
(:class:`~rrfp.scheduler.wfloat.WFloat`): forwards and input backwards keep the order, a
pending ``W`` runs while the order's next other task waits for its input or for bytes. No
strict form; the runtime and the simulator run it alike (it needs no notices)."""
AHEAD = "ahead"
"""``wfloat`` that also runs later ready tasks of the order while the planned one waits,
within the order's own byte profile (:class:`~rrfp.scheduler.wfloat.OrderAhead`)."""
FLOATING = {WFLOAT: "w-float", AHEAD: "order-ahead"}
"""Hint name -> the registered policy it runs over the placement's split order."""
ORDER_HINTS = (STRICT_SPLIT, BACKFILL, WFLOAT, AHEAD)
"""Hint names beside :data:`HINT_NAMES` whose order depends on the placement."""


DEFAULT_HINT = "bf"
"""The policy the simulator (``rrfp simulate`` without ``--hints``) and
``benchmarks/bench_sim.py`` run when none is given: RRFP's BF, which needs no split backward.
``rrfp train``, ``Pipeline`` and ``LocalPipeline`` default to ``auto`` instead
(:mod:`rrfp.runtime.features.auto`), which measures the job and keeps the fastest candidate, never one
measured slower than the strict schedule."""


NOMINAL_DURATIONS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
"""Task durations (arbitrary units) used to compile a policy into a strict order."""


BACKPRESSURE = ("admission", "completion-order")
"""``admission`` (default): at the limit a rank admits no new microbatch (no forward on its
first virtual stage) but keeps running every other ready task; the limit counts microbatches
in flight on the rank. ``completion-order``: RRFP App. C.2, the deterministic
microbatch-by-microbatch completion order while the count of activations held is at the
limit (bound ``limit + V``); it serializes deep interleaved pipelines (docs/scheduling.md)."""


def compile_policy(
    spec: PipelineSpec,
    hint: Hint,
    inflight_limit: Union[int, Sequence[int]] = 32,
    durations: dict[str, float] | None = None,
) -> Order:
    """Compile a policy hint into per-rank total orders: the order in which each rank
    dispatches its tasks when the policy runs in readiness mode with fixed durations
    (default :data:`NOMINAL_DURATIONS`: ``F = 1``, ``B = 2``, ``I = W = 1``) and no
    communication time. Ties resolve as in :func:`rrfp.sim.engine.simulate` (all events of an
    instant first, then idle ranks decide), so the result equals that simulation's per-rank
    order. Any executed order respects every dependency, so the result always runs strictly.

    Args:
        spec: the pipeline's shape.
        hint: the policy (``hint.order`` is ignored).
        inflight_limit: one in-flight limit for every rank, or one per rank.
        durations: seconds (any unit) per task kind.

    Returns:
        ``Order``: per rank, all of its tasks.

    Raises:
        ValueError: for a bad limit (from the arbiter).
        RuntimeError: if the policy cannot finish (a bug in the arbiter).
    """
    P = spec.placement.n_ranks
    limits = [inflight_limit] * P if isinstance(inflight_limit, int) else list(inflight_limit)
    if len(limits) != P:
        raise ValueError(f"{len(limits)} in-flight limits given for {P} ranks")
    dur = NOMINAL_DURATIONS if durations is None else durations
    policy = Hint(hint.name, hint.policy)
    arbs = [Arbiter(spec, r, policy, inflight_limit=limits[r]) for r in range(P)]
    orders: Order = [[] for _ in range(P)]
    events: list[tuple[float, int, int]] = []  # (end time, seq, rank)
    seq = 0

    def dispatch(r: int, now: float) -> None:
        nonlocal seq
        if arbs[r].running is not None:
            return
        t = arbs[r].next()
        if t is not None:
            orders[r].append(t)
            seq += 1
            heapq.heappush(events, (now + dur[t.kind], seq, r))

    for r in range(P):
        dispatch(r, 0.0)
    while events:
        now = events[0][0]
        touched: set[int] = set()
        while events and events[0][0] == now:
            _, _, r = heapq.heappop(events)
            t = arbs[r].running
            arbs[r].complete(t)
            touched.add(r)
            c = spec.consumer(t)
            if c is not None:
                dst = spec.placement.rank_of(c.stage)
                arbs[dst].mark_input(c.stage, c.mb, c.kind != F)
                touched.add(dst)
        for r in sorted(touched):
            dispatch(r, now)
    stuck = [r for r in range(P) if not arbs[r].finished]
    if stuck:
        raise RuntimeError(
            f"policy {hint.name!r} cannot finish: "
            + "; ".join(f"rank {r} waits for {arbs[r].waiting_for()}" for r in stuck[:4])
        )
    return orders


def _forms() -> str:
    names = ", ".join(HINT_NAMES + (STRICT_SPLIT,))
    names += f", {', '.join(FLOATING)} (no strict form)"
    return (f"{names} (each also as strict-<name>), backfill, backfill:<strict order>, "
            "order:<per-rank orders>, csv:<path> or <path>.csv")


def resolve_hint(
    text: str,
    placement: Placement,
    n_microbatches: int,
    split_backward: bool | None = None,
    *,
    inflight_limit: Union[int, Sequence[int]] = 32,
    backpressure: str = "admission",
) -> tuple[PipelineSpec, Hint, bool]:
    """Turn hint text (``"bf"``, ``"strict-1f1b"``, ``"order:..."``, ``"sched.csv"``; grammar in
    the module docstring) into ``(spec, hint, strict)``.

    ``split_backward`` defaults to what the hint implies: ``bfw``, ``zb-h1`` and ``zb-v`` split;
    a user order splits when it holds ``I``/``W`` actions; the rest do not.
    A strict policy (``strict-bf``...) is compiled with :func:`compile_policy` under
    ``inflight_limit``. Strict orders are checked with
    :func:`~rrfp.scheduler.validate.validate_schedule`; user orders in readiness mode only need
    to hold each of their rank's tasks once.

    Args:
        text: the hint text.
        placement: which rank holds which stage.
        n_microbatches: microbatches per step (``>= 1``).
        split_backward: force the split (``I`` + ``W``) or full (``B``) backward.
        inflight_limit: the in-flight limit a strict policy is compiled under (one, or one
            per rank); readiness mode takes its limit from the arbiter instead.
        backpressure: one of :data:`BACKPRESSURE`.

    Raises:
        ValueError: one line naming an unknown hint and listing the known forms, or a named
            schedule that does not fit the placement or microbatch count.
        ScheduleError: (a ``ValueError``) a user order that is not a valid schedule, naming
            its first offending action.
        OSError: a CSV file that cannot be read.
    """
    if backpressure not in BACKPRESSURE:
        raise ValueError(f"backpressure {backpressure!r}: expected one of {', '.join(BACKPRESSURE)}")
    spec, hint, strict = _resolve(text, placement, n_microbatches, split_backward, inflight_limit, backpressure)
    return spec, dataclasses.replace(hint, backpressure=backpressure), strict


def _resolve(text, placement, n_microbatches, split_backward, inflight_limit, backpressure):
    strict = text.startswith("strict-")
    name = text[len("strict-"):] if strict else text
    if name == BACKFILL or name.startswith(BACKFILL + ":"):
        base = STRICT_SPLIT if name == BACKFILL else name[len(BACKFILL) + 1:]
        base = base[len("strict-"):] if base.startswith("strict-") else base
        if not base or base == BACKFILL or base.startswith(BACKFILL + ":"):
            raise ValueError(f"hint {text!r}: expected backfill or backfill:<strict order>, e.g. backfill:1f1b")
        try:
            spec, hint, _ = _resolve("strict-" + base, placement, n_microbatches, split_backward, inflight_limit,
                                     backpressure)
        except ValueError as e:
            # The inner message names "strict-<base>", a hint the user did not type.
            raise ValueError(f"hint {text!r}: its strict order {base!r} does not resolve: {e}") from None
        return spec, dataclasses.replace(hint, name=name, backfill=True), True
    if name in FLOATING:
        if strict:
            raise ValueError(f"hint {text!r}: {name} floats its W tasks, so it has no strict form; use strict-split")
        spec, hint, _ = _resolve(STRICT_SPLIT, placement, n_microbatches, split_backward, inflight_limit, backpressure)
        if not spec.split_backward:
            raise ValueError(f"hint {text!r}: {name} needs the split backward (I and W); drop the full-backward setting")
        if FLOATING[name] == _wfloat.WFloat.name:  # ahead runs later tasks: no such limit
            _wfloat.check_limits(name, spec, hint.order, inflight_limit, backpressure)
        return spec, Hint(name, FLOATING[name], order=hint.order, backpressure=backpressure), False
    if name == STRICT_SPLIT:
        sched = placement_schedule(placement.n_virtual, placement.kind)
        if sched is None:
            raise ValueError(f"hint {text!r}: the {placement.kind} placement with {placement.n_virtual} virtual "
                             "stages has no fixed order (1f1b: 1, interleaved-1f1b: loop, zb-v: v with 2)")
        spec = PipelineSpec(placement, n_microbatches, True if split_backward is None else split_backward)
        hint = Hint(name, order=SCHEDULES[sched](spec))
        if strict:
            validate_schedule(spec, hint.order)
        return spec, hint, strict
    if name in POLICIES:
        split = KIND_POLICIES[name].split
        spec = PipelineSpec(placement, n_microbatches, split if split_backward is None else split_backward)
        hint = Hint(name, name, backpressure=backpressure)
        if strict:
            hint = Hint(name, name, order=compile_policy(spec, hint, inflight_limit))
        return spec, hint, strict
    if name in SCHEDULES:
        split = SPLIT_BACKWARD_DEFAULT[name] if split_backward is None else split_backward
        spec = PipelineSpec(placement, n_microbatches, split)
        hint = Hint(name, order=SCHEDULES[name](spec))
        if strict:
            validate_schedule(spec, hint.order)
        return spec, hint, strict
    if name.startswith("order:"):
        orders = parse_orders(name[len("order:"):])
        label = "order"
    elif name.startswith("csv:") or name.endswith(".csv"):
        path = name[len("csv:"):] if name.startswith("csv:") else name
        orders = load_order_csv(path)
        label = path
    else:
        raise ValueError(f"unknown hint {text!r}: expected one of {_forms()}")
    if split_backward is None:
        kinds = {t.kind for o in orders for t in o}
        if B in kinds and kinds & {I, W}:
            first_b = next(t for o in orders for t in o if t.kind == B)
            raise ScheduleError(
                f"hint {label!r}: action {first_b} is a full backward but the order also has "
                "split I/W actions; use one form",
                action=first_b,
            )
        split_backward = bool(kinds & {I, W})
    spec = PipelineSpec(placement, n_microbatches, split_backward)
    validate_schedule(spec, orders, strict=strict)
    return spec, Hint(label, order=orders), strict
