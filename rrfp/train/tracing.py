"""What ``rrfp train --trace`` writes: each rank's task records and output sizes, merged by
rank 0 into a Chrome trace, a PNG timeline and a per-stage cost profile (``profile.json``) that
``rrfp simulate --costs`` reads."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..lines import say
from ..runtime.engine.stage import PipelineStage
from .guard import atomic_path, atomic_write_text


def record_output_bytes(stages: list[PipelineStage]) -> dict[int, list[int]]:
    """Record, for every forward of each stage, the bytes of its module's outputs.

    A forward hook on each stage's module (no change to the runtime, no extra forward) adds
    one integer per forward to the returned lists, keyed by global stage index. For a stage
    other than the last, the outputs are exactly the activation message its forward sends
    to the next stage (without the message header); the last stage's are its logits, which
    stay on the rank.
    """
    sizes: dict[int, list[int]] = {}
    for st in stages:
        seen = sizes.setdefault(st.stage_index, [])

        def hook(_module, _inputs, output, seen=seen) -> None:
            outs = output if isinstance(output, (tuple, list)) else (output,)
            seen.append(sum(t.nbytes for t in outs if isinstance(t, torch.Tensor)))

        st.submod.register_forward_hook(hook)
    return sizes


def record_saved_bytes(pipe, microbatches: int, into: dict[int, list[int]]) -> None:
    """After a step, add to ``into`` (global stage index -> bytes, one per forward) what each
    forward of this process's stages saved for its backward: the runtime's own measurement
    (:class:`~rrfp.runtime.engine.memory.ForwardSizer`, the figures the memory budget admits by
    and the memory line's ``activations`` peak adds up). A runtime without a sizer (none asked
    to measure) adds nothing; so does a microbatch whose forward did not run.

    Args:
        pipe: the rank's :class:`~rrfp.runtime.doors.pipeline.Pipeline` (its ``runtimes``).
        microbatches: microbatches per pipeline step (with ``--grad-accum``, the sizer holds
            the step's last pipeline step).
    """
    for rt in pipe.runtimes:
        if rt.sizer is None:
            continue
        for s in rt.stages:
            into.setdefault(s, []).extend(b for m in range(microbatches) if (b := rt.sizer(s, m)))


def write_trace(
    args: argparse.Namespace, rank: int, n_ranks: int, records: list, out_bytes: dict[int, list[int]],
    step_log: list | None = None, saved_bytes: dict[int, list[int]] | None = None,
) -> None:
    """Every rank writes its task records, output sizes (:func:`record_output_bytes`), the
    bytes each forward saved for its backward (:func:`record_saved_bytes`) and
    per-step ``[step, wall, busy]`` seconds (the runtime's bubble accounting, ``steps``);
    rank 0 merges them into a Chrome trace, a PNG timeline and a per-stage cost profile
    (``profile.json``, :func:`profile_from_records`) that ``rrfp simulate --costs`` reads."""
    out = Path(args.trace)
    out.mkdir(parents=True, exist_ok=True)
    part = out / f"records.rank{rank}.json"
    atomic_write_text(part, json.dumps({
        "records": [[r.rank, r.step, str(r.task), r.start, r.end] for r in records],
        "out_bytes": {str(s): v for s, v in out_bytes.items()},
        "saved_bytes": {str(s): v for s, v in (saved_bytes or {}).items()},
        "steps": step_log or [],
    }))
    dist.barrier()
    if rank != 0:
        return
    from ..obs.trace import write_chrome_trace, write_gantt_png
    from ..runtime.engine.rank import TaskRecord
    from ..scheduler.tasks import parse_action
    from ..sim.costs import save_profile

    merged, sizes, saved = [], {}, {}
    for r in range(n_ranks):
        part = json.loads((out / f"records.rank{r}.json").read_text())
        for rk, step, task, start, end in part["records"]:
            merged.append(TaskRecord(rk, step, parse_action(task), start, end))
        sizes.update({int(s): v for s, v in part["out_bytes"].items()})
        saved.update({int(s): v for s, v in part.get("saved_bytes", {}).items()})
    t0 = min(r.start for r in merged)
    merged = [dataclasses.replace(r, start=r.start - t0, end=r.end - t0) for r in merged]
    with atomic_path(out / "trace.json") as tmp:
        write_chrome_trace(merged, tmp)
    shown = timeline_steps(sorted({r.step for r in merged}))
    with atomic_path(out / "timeline.png") as tmp:
        write_gantt_png([r for r in merged if r.step in shown], tmp, n_ranks=n_ranks,
                        title=f"rrfp train, hint {args.hint}, step{'s' if len(shown) > 1 else ''} "
                        f"{min(shown) + 1}-{max(shown) + 1} of {args.steps}")
    with atomic_path(out / "profile.json") as tmp:
        save_profile(profile_from_records(merged, n_ranks * args.virtual_stages, sizes, saved), tmp,
                     meta={"source": "rrfp train", "model": args.model, "microbatches": args.microbatches,
                           "batch_size": args.batch_size, "max_len": args.max_len, "hint": args.hint})
    say(f"trace: {out / 'trace.json'} (open in Perfetto), timeline {out / 'timeline.png'}, "
        f"costs {out / 'profile.json'}")


TIMELINE_STEPS = 3
"""Steps a timeline PNG shows at most: more turn the bars into an unreadable barcode."""


def timeline_steps(recorded: list[int]) -> set[int]:
    """The steps (0-based) the timeline PNG draws: the last :data:`TIMELINE_STEPS` recorded
    (the first step warms up; ``--trace-steps`` picks others)."""
    return set(recorded[-TIMELINE_STEPS:])


def profile_from_records(records: list, n_stages: int, out_bytes: dict[int, list[int]] | None = None,
                         saved_bytes: dict[int, list[int]] | None = None):
    """The measured per-stage costs as a :class:`~rrfp.sim.costs.CostModel` (``profile.json``).

    ``F``, ``B``, ``I``, ``W``: median seconds of each task kind per stage, over the steps
    after the first (which warms up). Sizes are low medians (an observed size) over every
    traced forward of the stage. ``act_bytes``: what one forward saved for its backward, the
    memory one in-flight microbatch holds on the stage, from ``saved_bytes``
    (:func:`record_saved_bytes`; stage -> one size per forward). ``msg_bytes``: the bytes of
    the stage module's outputs, from ``out_bytes`` (:func:`record_output_bytes`): for a stage
    other than the last the activation message its forward sends (the gradient coming back
    has the same size); the last stage's are its logits. A stage without saved sizes gets
    ``act_bytes`` 0; one without output sizes, ``msg_bytes`` = ``act_bytes`` (the format's
    default).

    Raises:
        ValueError: a stage with no forward or no backward record.
    """
    import statistics

    from ..sim.costs import CostModel, StageCost

    first_step = min(r.step for r in records)
    steady = [r for r in records if r.step > first_step] or records
    stages = []
    for s in range(n_stages):
        by_kind: dict[str, list[float]] = {}
        for r in steady:
            if r.task.stage == s:
                by_kind.setdefault(r.task.kind, []).append(r.end - r.start)
        med = {k: statistics.median(v) for k, v in by_kind.items()}
        saved, sent = (saved_bytes or {}).get(s), (out_bytes or {}).get(s)
        med["act_bytes"] = statistics.median_low(saved) if saved else 0
        med["msg_bytes"] = statistics.median_low(sent) if sent else None
        stages.append(StageCost.from_mapping({k: med.get(k) for k in ("F", "B", "I", "W", "act_bytes", "msg_bytes")},
                                             f"stage {s}"))
    return CostModel(tuple(stages))
