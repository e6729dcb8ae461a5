"""What a pipeline is asked to do, in one record: :class:`RuntimeConfig`, and the plan both
front doors derive from it (:func:`plan`): placement, hint, in-flight limits, memory budget.

:class:`~rrfp.runtime.doors.pipeline.Pipeline` and :class:`~rrfp.runtime.doors.local.LocalPipeline` take
every field of :class:`RuntimeConfig` as a keyword argument (or a whole ``config=``), so a new
runtime knob is one field here plus where the runtime reads it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from ...scheduler.hints import Hint, hint_form, resolve_hint
from ...scheduler.memory import budget_bytes
from ...scheduler.tasks import PipelineSpec, Placement
from ...scheduler.validate import order_limits
from ...sim.auto import AUTO, auto_first_hint
from ..features.recheck import RECHECK_EVERY, check_recheck
from .names import hint_text, unknown_door_hint

DEFAULT_INFLIGHT_LIMIT = 32
DEFAULT_WATCHDOG_S = 300.0


@dataclasses.dataclass
class RuntimeConfig:
    """Every runtime setting of a pipeline, with one default each (both front doors).

    Attributes:
        hint: ``auto`` (the default: measure this job's steps, then keep the fastest of the
            candidate policies, never one measured slower than the placement's strict
            schedule; :class:`~rrfp.runtime.features.auto.AutoHint`), or any name of the hint
            table (:data:`rrfp.scheduler.registry.HINTS`: ``bf``, ``bfw-mem``, ``backfill``, a
            schedule such as ``1f1b``..., and any hint registered in this process; PyTorch's
            schedule names and classes too: ``"1F1B"``, ``Schedule1F1B``), ``strict-<name>``
            for the fixed-order baseline (RRFP §4), ``order:...`` or a CSV file.
        inflight_limit: the in-flight limit (RRFP §6); a sequence gives one per rank. None:
            a schedule used as a hint, and ``auto``'s candidates, keep the (placement's
            strict) schedule's own peak in flight per rank (1F1B: ``p - r``;
            :func:`schedule_limits`; a schedule used as a hint also holds at most its
            order's activations per virtual stage, see :func:`plan`) unless
            ``memory_budget`` is set; otherwise 32.
        placement: ``loop`` or ``v`` for virtual stages.
        backpressure: with virtual stages, ``admission`` or ``completion-order`` (RRFP App. C.2).
        memory_budget: activation bytes per rank (``64MiB``, ``1.5GB``, an int; None: none).
        loss_weight_fn: ``fn(target) -> float`` weighting microbatch losses; None: the
            microbatch's samples (dim 0 of its target).
        watchdog: seconds without progress before :class:`~rrfp.errors.WatchdogTimeout`
            (0 disables).
        record: keep per-task timestamps in ``last_stats`` (for traces).
        task_delay: ``fn(step, rank, task) -> seconds`` of injected delay (experiments).
        deterministic: accumulate weight gradients in microbatch order (bitwise reproducible).
        device: where the stages compute (``"cpu"``, ``"cuda:1"``); None: where they are.
        executor: ``auto``, ``inline``, ``thread`` or ``cuda`` (:mod:`rrfp.runtime.engine.executor`).
        launch_ahead: the CUDA executor's launch-ahead window, 1 or 2 tasks.
        transport: a :class:`~rrfp.transport.base.Transport`, or a name of
            :mod:`rrfp.transport.registry` (``zmq``, ``torch``, or one registered); None: ZeroMQ
            through torch.distributed's store. In-process pipelines take only the name of an
            in-process one (``fake``, the default, ``fake-plane``, ``fake-nccl``, ...).
        layout: a :class:`~rrfp.parallel.layout.ParallelLayout` or a torch ``DeviceMesh`` whose
            dimensions are named from ``pp``, ``dp``, ``tp`` (any order and subset).
        tied: parameters shared by stages, ``{name: {stage_index: parameter name}}`` (stage
            -1: the last): their gradients are summed over the owning stages each step.
        tp_exchange: how TP ranks all-gather their proposals: ``control`` or ``gloo``.
        job: job id in every message key and store entry (None: one per pipeline).
        auto_recheck: under ``hint="auto"``, steps between re-checks (one more trial round
            each; a switch needs a hint measured faster than the kept one beyond
            :func:`~rrfp.sim.trial.margin`, the 1% tie or the trial steps' spread); 0: never,
            the first choice is kept throughout.
    """

    hint: Any = AUTO
    inflight_limit: int | Sequence[int] | None = None
    placement: str = "loop"
    backpressure: str = "admission"
    memory_budget: int | str | None = None
    loss_weight_fn: Callable[[Any], float] | None = None
    watchdog: float = DEFAULT_WATCHDOG_S
    record: bool = False
    task_delay: Callable | None = None
    deterministic: bool = False
    device: Any = None
    executor: str = "auto"
    launch_ahead: int = 1
    transport: Any = None
    layout: Any = None
    tied: Any = None
    tp_exchange: str = "control"
    job: str | None = None
    auto_recheck: int = RECHECK_EVERY

    @classmethod
    def merge(cls, config: "RuntimeConfig | None", options: Mapping[str, Any]) -> "RuntimeConfig":
        """``config`` (default: all defaults) with ``options`` (field name -> value) set.

        Raises:
            TypeError: an option that is not a field, naming it and the fields.
        """
        base = config if config is not None else cls()
        if not isinstance(base, RuntimeConfig):
            raise TypeError(f"config={config!r}: expected a RuntimeConfig")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(options) - names)
        if bad:
            raise TypeError(f"unknown option {bad[0]!r}: expected one of {', '.join(sorted(names))}")
        return dataclasses.replace(base, **options)


@dataclasses.dataclass
class Plan:
    """What a config resolves to for one pipeline shape (every rank derives the same plan).

    Attributes:
        placement: which rank holds which stage; spec: the pipeline's shape.
        hint, strict: the resolved hint and whether it is followed strictly (under ``auto``,
            the first step's: the placement's strict schedule, :func:`~rrfp.sim.auto.auto_first_hint`).
        limits: the in-flight limit of each rank.
        budget: the memory budget in bytes (None: none).
        auto: the hint is ``auto`` (the front door chooses on its steps).
    """

    placement: Placement
    spec: PipelineSpec
    hint: Hint
    strict: bool
    limits: list[int]
    budget: int | None
    auto: bool = False


def inflight_limits(inflight_limit: int | Sequence[int], n_ranks: int) -> list[int]:
    """One in-flight limit per rank.

    Raises:
        ValueError: for a limit that is not an integer >= 1, or a list of the wrong length.
    """
    def one(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if one(inflight_limit):
        return [inflight_limit] * n_ranks  # type: ignore[list-item]
    if not isinstance(inflight_limit, (list, tuple)):
        raise ValueError(f"inflight_limit={inflight_limit!r}: expected an integer >= 1 or a list of {n_ranks}, "
                         f"one per rank")
    if len(inflight_limit) != n_ranks:
        raise ValueError(f"inflight_limit={list(inflight_limit)!r}: {len(inflight_limit)} limits for {n_ranks} "
                         f"ranks; expected one integer >= 1 per rank")
    bad = [x for x in inflight_limit if not one(x)]
    if bad:
        raise ValueError(f"inflight_limit={list(inflight_limit)!r}: {bad[0]!r} is not an integer >= 1; "
                         f"expected one integer >= 1 per rank")
    return list(inflight_limit)


def schedule_limits(spec: PipelineSpec, hint: Hint) -> list[int]:
    """Per rank, the in-flight limit that holds a schedule used as a hint to that schedule's
    own peak (GPipe: the microbatch count; 1F1B: ``p - r``), as the rank's guard counts under
    the hint's backpressure (:func:`rrfp.scheduler.validate.order_limits`)."""
    return order_limits(spec, hint.order, hint.backpressure)


def plan(config: RuntimeConfig, n_ranks: int, n_virtual: int, n_microbatches: int) -> Plan:
    """Resolve ``config`` for ``n_ranks`` ranks of ``n_virtual`` stages each.

    The one rule for limits left unset: a schedule used as a hint keeps its own peak in flight
    (:func:`schedule_limits`) and holds at most what its order holds on every virtual stage
    at once (each forward waits for the backwards the order puts before it:
    :class:`~rrfp.scheduler.guards.OrderPeak`, so its activation bytes never exceed the
    schedule's own), and ``auto``'s candidates keep the placement's strict schedule's peak in
    flight, so that trying a policy never holds more activations than the fixed schedule
    does; with a ``memory_budget`` (or a policy) the limit is :data:`DEFAULT_INFLIGHT_LIMIT`.
    ``rrfp train`` resolves its flags through here too.

    Raises:
        ValueError: an unknown hint, placement, backpressure or budget, bad limits, a negative
            or NaN watchdog, a non-bool ``deterministic``, an ``auto_recheck`` that is not an
            integer >= 0, or a schedule that does not fit the
            shape (one line naming the value).
        TypeError: a hint that is neither text nor a class.
    """
    if isinstance(config.watchdog, bool) or not isinstance(config.watchdog, (int, float)) \
            or math.isnan(config.watchdog) or config.watchdog < 0:
        raise ValueError(f"watchdog={config.watchdog!r}: expected seconds >= 0 (0 disables the watchdog)")
    if not isinstance(config.deterministic, bool):
        raise ValueError(f"deterministic={config.deterministic!r}: expected True or False")
    check_recheck(config.auto_recheck)
    place = Placement(n_ranks, n_virtual, config.placement)
    given = config.inflight_limit is not None
    limits = inflight_limits(config.inflight_limit if given else DEFAULT_INFLIGHT_LIMIT, n_ranks)
    text = AUTO if config.hint is None else hint_text(config.hint)  # None: the default
    auto = text == AUTO
    budget = budget_bytes(config.memory_budget)
    if auto:
        text = auto_first_hint(place, n_microbatches)
        if not given and budget is None:  # the strict schedule's own peak, as that schedule used as a hint
            sched = resolve_hint(text.removeprefix("strict-"), place, n_microbatches, inflight_limit=limits,
                                 backpressure=config.backpressure)
            limits = schedule_limits(sched[0], sched[1])
    if hint_form(text) is None:  # the scheduler's own line would not offer auto, the default here
        raise ValueError(unknown_door_hint(text))
    spec, hint, strict = resolve_hint(text, place, n_microbatches, inflight_limit=limits,
                                      backpressure=config.backpressure)
    if not auto and not given and budget is None and hint.order is not None and not strict:
        limits = schedule_limits(spec, hint)
        # The count limits alone let virtual stages hold another mix than the order ever does
        # (more of a larger stage): each forward also waits for the order's earlier backwards.
        hint = dataclasses.replace(hint, held_to_order=True)
    return Plan(place, spec, hint, strict, limits, budget, auto)
