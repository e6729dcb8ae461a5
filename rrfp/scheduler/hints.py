"""Hints: a rank's ordered preference over its ready tasks (RRFP §4, App. A).

A hint is a name of the hint table (:data:`rrfp.scheduler.registry.HINTS`: the kind-ranking
*policies* ``bf``, ``bfw``, ``fb``..., which rank whatever is ready by kind; the named
schedules ``gpipe``, ``1f1b``, ``zb-v``...; the placement's orders ``split``, ``backfill``,
``wfloat``, ``ahead``; anything :func:`~rrfp.scheduler.registry.register` added), or a *total
order* per rank given by the user as text or a CSV file.

Any hint with a strict form runs in readiness mode (dispatch the best-ranked ready task, skip
unready ones) or, prefixed ``strict-``, in strict mode (the fixed-order baseline: run only the
order's next task, waiting for it). A policy in strict mode is first compiled into a total
order by running it with nominal durations (:func:`compile_policy`).

Hint text grammar (:func:`resolve_hint`)::

    [strict-]<name>            a name of the hint table (or an alias: PyTorch's schedule
                               names), e.g. "bf", "strict-zb-v", "Interleaved1F1B"
    backfill:<strict order>    conservative backfilling over another strict order
    [strict-]order:<orders>    per-rank orders inline, ranks separated by newlines or "|",
                               optionally labelled: "order:rank0: 0F0 0B0 | rank1: 1F0 1B0"
    [strict-]csv:<path>        a PyTorch compute-only schedule CSV (one row per rank)
    [strict-]<path>.csv        the same, recognised by the suffix

Pure module: no torch, no asyncio; only the CSV form reads a file.
"""

from __future__ import annotations

import dataclasses
import difflib

import heapq
from typing import Sequence, Union

from .arbiter import Arbiter
from .policy import Hint
from .registry import ALWAYS, COMPILE, HINTS, SPLIT, HintEntry, canonical, forms, lookup, placement_order
from .schedules import Order, load_order_csv, parse_orders
from .tasks import B, F, I, W, PipelineSpec, Placement
from .validate import ScheduleError, validate_schedule

STRICT_SPLIT = "split"
"""The placement's own fixed order (:func:`~rrfp.scheduler.policy.placement_schedule`: 1F1B,
interleaved 1F1B or ZB-V) with each backward split into ``I`` then ``W`` at once: same order,
same bytes, but the gradient leaves after ``I``. ``strict-split`` runs it strictly."""
BACKFILL = "backfill"
"""``backfill`` and ``backfill:<strict order>``: a strict order (default ``split``) with
conservative backfilling (:mod:`rrfp.scheduler.backfill`); always strict. The simulator's
"started" notices are instant; the runtime's travel on its control plane
(:mod:`rrfp.runtime.features.notices`)."""


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
    instant first, then idle ranks decide in rank order), so the result equals that
    simulation's per-rank dispatch order: one event model in two loops, since the simulator
    sits above this package (``tests/test_scheduler_properties.py`` checks both give the same
    orders over random shapes, durations, limits and backpressure). Any executed order respects
    every dependency, so the result always runs strictly.

    Args:
        spec: the pipeline's shape.
        hint: the policy and its backpressure (``hint.order`` is ignored).
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
    policy = Hint(hint.name, hint.policy, backpressure=hint.backpressure)  # the readiness run it stands for
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

    ``split_backward`` defaults to what the hint implies: its entry's backward form
    (:attr:`~rrfp.scheduler.registry.HintEntry.backward`: ``bfw``, ``zb-h1``, ``zb-v``, ``split``
    ... split); a user order splits when it holds ``I``/``W`` actions.
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
        ValueError: one line naming an unknown hint and listing the known forms
            (:func:`~rrfp.scheduler.registry.forms`), or a hint whose order does not fit the
            placement or microbatch count (``hint '<text>': <why>``).
        ScheduleError: (a ``ValueError``) a user order that is not a valid schedule, naming
            its first offending action.
        OSError: a CSV file that cannot be read.
    """
    if backpressure not in BACKPRESSURE:
        raise ValueError(f"backpressure {backpressure!r}: expected one of {', '.join(BACKPRESSURE)}")
    spec, hint, strict = _resolve(text, placement, n_microbatches, split_backward, inflight_limit, backpressure)
    return spec, dataclasses.replace(hint, backpressure=backpressure), strict


FORMS = ("name", BACKFILL, "order", "csv")
"""What hint text can be (:func:`hint_form`): a name of the hint table, ``backfill[:<order>]``,
``order:<orders>``, a CSV file."""


def hint_form(text: str) -> str | None:
    """Which of :data:`FORMS` hint text takes (``strict-`` and aliases allowed), without
    resolving it or reading a file; None: an unknown hint. The one reading of the grammar
    (module docstring): :func:`resolve_hint` and ``rrfp train``'s early checks use it."""
    name = canonical(text).removeprefix("strict-")
    if name == BACKFILL or name.startswith(BACKFILL + ":"):
        return BACKFILL
    if lookup(name) is not None:
        return "name"
    if name.startswith("order:"):
        return "order"
    if name.startswith("csv:") or name.endswith(".csv"):
        return "csv"
    return None


def unknown_hint(text: str) -> str:
    """The one-line error for hint text that :func:`hint_form` does not know, listing the
    forms (:func:`~rrfp.scheduler.registry.forms`)."""
    known = [n for n in HINTS] + [f"strict-{n}" for n in HINTS]
    near = difflib.get_close_matches(text, known, n=1)
    return f"unknown hint {text!r}{f' (did you mean {near[0]!r}?)' if near else ''}: expected one of {forms()}"


def _resolve(text, placement, n_microbatches, split_backward, inflight_limit, backpressure):
    form = hint_form(text)
    if form is None:
        raise ValueError(unknown_hint(text))
    text = canonical(text)
    strict = text.startswith("strict-")
    name = text[len("strict-"):] if strict else text
    if form == BACKFILL:
        return _backfill(text, name, placement, n_microbatches, split_backward, inflight_limit, backpressure)
    if form == "name":
        return _named(text, name, strict, lookup(name), placement, n_microbatches, split_backward, inflight_limit,
                      backpressure)
    if form == "order":
        orders = parse_orders(name[len("order:"):])
        label = "order"
    else:
        path = name[len("csv:"):] if name.startswith("csv:") else name
        orders = load_order_csv(path)
        label = path
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


def _named(text, name, strict, entry: HintEntry, placement, n_microbatches, split_backward, inflight_limit,
           backpressure):
    """A name of the hint table, in readiness or strict mode."""
    if strict and not entry.strict_forms:
        fixed = "; strict-split runs its order fixed" if entry.order is placement_order else ""
        raise ValueError(f"hint {text!r}: {name} has no strict form{fixed}")
    split = entry.backward == SPLIT if split_backward is None else split_backward
    if entry.split_only and not split:
        raise ValueError(f"hint {text!r}: {name} needs the split backward (I and W); drop the full-backward setting")
    spec = PipelineSpec(placement, n_microbatches, split)
    if entry.order is None:  # a policy: ranks whatever is ready
        hint = Hint(name, name, backpressure=backpressure)
        if strict and entry.strict == COMPILE:
            hint = Hint(name, name, order=compile_policy(spec, hint, inflight_limit))
        return spec, hint, strict
    try:
        order = entry.order(spec)
    except ValueError as e:  # named: a schedule's own message starts with its name
        raise ValueError(str(e) if str(e).startswith(name + " ") else f"hint {text!r}: {e}") from None
    if entry.check is not None and not strict:
        entry.check(name, spec, order, inflight_limit, backpressure)
    hint = Hint(name, name if entry.factory is not None else None, order=order, backpressure=backpressure)
    if strict:
        validate_schedule(spec, order)
    return spec, hint, strict or entry.strict == ALWAYS


def _backfill(text, name, placement, n_microbatches, split_backward, inflight_limit, backpressure):
    """``backfill`` (over ``split``) or ``backfill:<strict order>``: always strict."""
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
