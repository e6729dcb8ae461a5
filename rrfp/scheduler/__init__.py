"""The pure scheduler: tasks, dependency rules, the ready set, policies and guards, hints,
the arbiter, named schedules and their validation (RRFP §3-5, App. A, App. C). No torch, no
asyncio, no I/O (a CSV schedule file is the one thing it may read)."""

from .arbiter import Arbiter, SchedulingError
from .hints import DEFAULT_HINT, NOMINAL_DURATIONS, Hint, compile_policy, resolve_hint
from .policy import Policy
from .registry import HINTS, HintEntry, register
from .schedules import (
    SCHEDULES,
    Order,
    dump_order_csv,
    format_orders,
    gpipe,
    interleaved_1f1b,
    load_order_csv,
    looped_bfs,
    microbatches_per_round,
    one_f_one_b,
    one_f_one_b_limits,
    parse_orders,
    zb_h1,
    zb_v,
)
from .tasks import B, F, I, W, PipelineSpec, Placement, Task, TaskRecord, format_order, parse_action, parse_order
from .validate import ScheduleError, order_peak_inflight, validate_schedule

__all__ = [
    "Arbiter", "SchedulingError",
    "DEFAULT_HINT", "NOMINAL_DURATIONS", "Hint", "compile_policy", "resolve_hint",
    "Policy", "HINTS", "HintEntry", "register",
    "SCHEDULES", "Order", "dump_order_csv", "format_orders", "gpipe",
    "interleaved_1f1b", "load_order_csv", "looped_bfs", "microbatches_per_round", "one_f_one_b",
    "one_f_one_b_limits", "parse_orders", "zb_h1", "zb_v",
    "B", "F", "I", "W", "PipelineSpec", "Placement", "Task", "TaskRecord", "format_order", "parse_action",
    "parse_order",
    "ScheduleError", "order_peak_inflight", "validate_schedule",
]
