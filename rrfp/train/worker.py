"""One rank of ``rrfp train``: build this rank's stages, run the steps, report.

Rank 0 prints one line per step (loss, tokens per second, each stage's bubble fraction) from
statistics every rank sends it as control messages, so reporting adds no barrier to a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.batches import BatchSampler, make_microbatches
from ..data.text import load_samples
from ..model.gpt import count_tokens, lm_loss
from ..parallel.clip import clip_grad_norm_
from ..parallel.train import replica_samples, reports, train_layout
from ..runtime.dist import init_distributed
from ..runtime.pipeline import Pipeline
from ..runtime.stage import PipelineStage
from .lines import say
from ..scheduler.tasks import Placement
from . import device
from .accum import accumulated_step
from .early import SAMPLE_POOL, inflight_limits
from .optim import lr_scheduler
from .precision import use_autocast
from .progress import Output
from .report import Reporter
from .guard import atomic_path, atomic_write_text, check_finite, pause_for_test


TP_IMPL = "manual"
"""Hand-written column/row-parallel layers: cheaper per task than DTensor's here
(``benchmarks/bench_tp.py``, BENCHMARKS.md "Tensor parallelism")."""

class _QuietAfterReaderLeft:
    """Drops the transport's lost-peer error records once rank 0's reader has gone: the peer
    stopped on purpose (`rrfp train | head`)."""

    def filter(self, record) -> bool:
        return record.levelno < 40 or not _reader_gone()


class _GlobalRankNames:
    """Rewords the transport's records (``"rank %d: ..."``, the rank numbered within its
    pipeline, as is any lost peer in them) to name global ranks with their coordinates, as
    every other report of a failure does."""

    LOGGERS = ("rrfp.transport", "rrfp.transport.zmq", "rrfp.transport.planes", "rrfp.transport.torch")

    def __init__(self, layout) -> None:
        self.layout = layout

    def name(self, pp_rank: int) -> str:
        from ..parallel.layout import ParallelLayout

        return ParallelLayout.name(self.layout.rank_at(pp_rank), self.layout.dp, self.layout.tp)

    def filter(self, record) -> bool:
        from ..transport.base import PeerLost

        args = record.args
        if isinstance(record.msg, str) and record.msg.startswith("rank %d: ") and isinstance(args, tuple) and args \
                and args[0] == self.layout.pp_rank:
            record.msg = "%s: " + record.msg.removeprefix("rank %d: ")
            record.args = (self.name(args[0]), *(f"{self.name(a.rank)} lost: {a.reason}" if isinstance(a, PeerLost)
                                                 else a for a in args[1:]))
        return True


def main(args: argparse.Namespace) -> int:
    from .. import _pdeathsig

    _pdeathsig.die_with_parent()  # again: the API entry skips __main__ (already set: a no-op)
    import logging

    logging.getLogger("rrfp.transport").addFilter(_QuietAfterReaderLeft())
    from .guard import configure_auth, write_error_file

    try:
        configure_auth(args)
        return _main(args)
    except BrokenPipeError:
        # `rrfp train | head`: the reader is gone. Stop as Unix tools do, quietly, and tell the
        # other ranks (through the launcher's store) that this is no failure to report.
        _stop_quietly()
    except KeyboardInterrupt:
        say(f"rrfp train: rank {os.environ.get('RANK', '?')}: interrupted", sys.stderr)
        os._exit(130)
    except Exception as e:  # one line per rank, then a non-zero exit the launcher reports
        if _reader_gone():
            os._exit(PIPE_CLOSED)
        rank = os.environ.get("RANK", "?")
        line = f"rrfp train: rank {rank}: error: {type(e).__name__}: {e}"
        say(line, sys.stderr)  # ranks share the launcher's stderr: one write (rrfp.train.lines)
        if rank.isdigit():
            write_error_file(e, int(rank), line)
        os._exit(1)


PIPE_CLOSED = 141
"""Exit code of a rank whose stdout reader went away (128 + SIGPIPE, as a shell reports it)."""
_PIPE_KEY = "rrfp/train/stdout-closed"


def _mark_reader_gone() -> None:
    try:
        from ..runtime.dist import default_store

        default_store().set(_PIPE_KEY, "1")
    except Exception:  # noqa: BLE001 - no store: the launcher still sees exit code 141
        pass


def _stop_quietly() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    _mark_reader_gone()
    os._exit(PIPE_CLOSED)


def _reader_gone() -> bool:
    """Whether rank 0's stdout reader went away (then a peer's loss is no error to report)."""
    try:
        from ..runtime.dist import default_store

        return default_store().check([_PIPE_KEY])
    except Exception:  # noqa: BLE001
        return False


def _main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    init_distributed()
    # rank: this process's pp_rank in its pipeline (one pipeline per (dp_rank, tp_rank)).
    layout = train_layout(args)
    import logging

    for name in _GlobalRankNames.LOGGERS:
        logging.getLogger(name).addFilter(_GlobalRankNames(layout))
    rank, n_ranks = layout.pp_rank, layout.pp
    place = Placement(n_ranks, args.virtual_stages, args.placement)
    n_stages = place.n_stages
    stage_ids = place.stages_of(rank)
    sampler = batches = tied = None
    held_out: list = []
    if args.model == "multimodal":
        from .multimodal import DigitBatches, multimodal_stages

        modules = multimodal_stages(n_stages, stage_ids, args.seed)
        if 0 in stage_ids or n_stages - 1 in stage_ids:
            batches = DigitBatches(args.batch_size, args.seed).microbatches
    else:
        from .models import text_stages

        modules, tied = text_stages(args, n_stages, stage_ids)
        if 0 in stage_ids or n_stages - 1 in stage_ids:
            samples = load_samples(args.data, args.max_len, args.seed, limit=SAMPLE_POOL)
            samples, held_out = split_held_out(samples, args)
            sampler = BatchSampler(samples, args.batch_size * args.grad_accum, args.seed)
            batches = lambda k, m: make_microbatches(replica_samples(sampler.batch(k), layout), m)  # noqa: E731
    stages = [PipelineStage(mod, s, n_stages) for mod, s in zip(modules, stage_ids)]
    if args.activation_checkpointing != "none":
        from ..model.checkpointing import apply_activation_checkpointing

        for st in stages:
            apply_activation_checkpointing(st.submod, args.activation_checkpointing)
    if layout.tp > 1:
        from ..model.tp import shard_gpt_stage

        for st in stages:
            shard_gpt_stage(st.submod, layout.tp_rank, layout.tp, layout.tp_group, TP_IMPL)
    for st in stages:
        use_autocast(st.submod, args.precision, st.device.type, last=st.stage_index == n_stages - 1)
    metrics, metrics_server = start_metrics(args, layout.rank, stage_ids)
    from .auto import AUTO, AutoHint

    pipe = Pipeline(
        stages, args.microbatches, lm_loss, inflight_limit=inflight_limits(args, n_ranks),
        hint=AutoHint.first_hint(place, args.microbatches) if args.hint == AUTO else args.hint,
        placement=args.placement, loss_weight_fn=count_tokens, rank=rank, n_ranks=n_ranks,
        job=f"train-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}", watchdog=args.watchdog,
        record=args.trace is not None or metrics is not None, deterministic=args.deterministic, backpressure=args.backpressure,
        transport=getattr(args, "transport", "zmq"),
        layout=layout if layout.dp * layout.tp > 1 else None,
        memory_budget=getattr(args, "memory_budget", None), tied=tied,
        **device.pipeline_kwargs(args),
    )
    chooser = None if args.hint != AUTO else AutoHint(
        pipe, inflight_limits(args, n_ranks), memory_budget=pipe.runtime.memory_budget, backpressure=args.backpressure,
        say=say, rank=layout.rank, same_backward=args.deterministic)
    # profile.json's act_bytes, measured on the forwards the run makes anyway (no extra forward).
    out_bytes = record_output_bytes(stages) if args.trace else None
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = lr_scheduler(opt, args.steps, args.warmup, args.lr_schedule, args.min_lr)
    reporter = Reporter(args, n_ranks, place, Output(args.steps, args.quiet, args.log_file)) if layout.rank == 0 else None
    # --- step line: lr, grad norm, TFLOP/s, MFU (rrfp/train/stepline.py, flops.py) ---
    from .flops import StepFlops, peak_tflops
    from .stepline import StepExtras, grad_norm_share, rank_fields

    step_flops, peak = StepFlops([s.submod for s in stages], layout.tp), peak_tflops(args.peak_tflops, stages[0].device)
    if reporter is not None:
        reporter.extras = StepExtras(args, stages[0].device, metrics)
    trace_lo, trace_hi = getattr(args, "trace_range", None) or (1, args.steps)
    records, step_log = [], []
    if metrics is not None:
        pipe.run(metrics.start_heartbeat())
    # --- checkpoints and graceful stop (rrfp/train/checkpoint.py, stop.py) ---
    from ..runtime.dist import default_store
    from .checkpoint import Checkpointer
    from .stop import GracefulStop

    stop = GracefulStop(default_store(), layout.rank, timeout_s=args.watchdog,  # before loading: SIGTERM may come any time
                        checkpoint=getattr(args, "checkpoint_dir", None) is not None)
    ckpt = Checkpointer(args, layout, stages, opt, n_samples=len(sampler.samples) if sampler else 0)
    first = end = 0
    resume = ckpt.resume_path()
    if resume is not None:
        first = ckpt.load(resume)
        if layout.rank == 0:
            say(f"rrfp train: resumed from {resume} at step {first}")
            from .checkpoint import nothing_to_do

            if (done := nothing_to_do(args, resume)) is not None:
                say(done)  # under a launcher of one's own (torchrun, rrfp node)
    if reporter is not None:
        reporter.next_step = first
    # --- end checkpoints ---
    t_begin = last = time.perf_counter()
    try:
        for k in range(first, args.steps):
            t_step = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            mbs = batches(k, args.microbatches * args.grad_accum) if batches else None
            if chooser is not None:
                chooser.before_step(k - first)
            loss, st = accumulated_step(pipe, mbs, args.microbatches, args.grad_accum, 0 in stage_ids,
                                        n_stages - 1 in stage_ids)  # --grad-accum (rrfp/train/accum.py)
            if chooser is not None:
                chooser.after_step(k - first, st)
            lr, grad_sq, flops = opt.param_groups[0]["lr"], grad_norm_share(params, layout), step_flops.take()
            if args.clip_grad is not None:
                clip_grad_norm_(params, args.clip_grad, layout)
            gnorm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])) \
                if any(p.grad is not None for p in params) else 0.0
            poisoned = check_finite(k, layout.rank, None if loss is None else float(loss), gnorm)
            if poisoned is None:
                opt.step()
            elif getattr(args, "skip_nonfinite", False):
                if layout.rank == 0:
                    say(f"rrfp train: skipped {poisoned}", sys.stderr)
                loss = None  # nothing of this step reaches the report
            else:
                raise poisoned
            sched.step()
            if args.trace and trace_lo <= k + 1 <= trace_hi:
                # Labelled with the training step (evaluations are pipeline steps too).
                records += [r if r.step == k else dataclasses.replace(r, step=k) for r in st.records]
                step_log.append([k, st.wall, st.busy])
            meta = {"kind": "stats", "step": k, "busy": st.busy, "wall": st.wall, "peak": st.peak_mb_inflight,
                    "loss": None if loss is None else float(loss), **rank_fields(lr, grad_sq, flops)}
            if metrics is not None:
                metrics.observe(st, loss=meta["loss"], tokens=sum(mb.n_tokens for mb in mbs) if 0 in stage_ids else 0,
                                seconds=time.perf_counter() - t_step, transport=_transport_counts(pipe.transport),
                                runtime_rejected=pipe.runtime.inbox.rejected)
                tflops = flops / st.wall / 1e12 if st.wall > 0 else 0.0
                metrics.observe_rates(lr=lr, tflops=tflops, mfu=tflops / peak if peak else None)
            if reporter is None:
                if reports(layout):
                    pipe.runtime.send_control(0, k, meta)
            else:
                now = time.perf_counter()
                reporter.step_time[k], last = now - last, now
                reporter.tokens[k] = sum(mb.n_tokens for mb in (
                    mbs if layout.dp == 1 else make_microbatches(sampler.batch(k), args.microbatches)))
                reporter.add(meta, 0)
                for msg in pipe.runtime.poll_control():
                    reporter.add(msg.meta, msg.src)
                reporter.flush()
            if args.eval_every and ((k + 1) % args.eval_every == 0 or k + 1 == args.steps):
                val = evaluate(pipe, held_out, args, 0 in stage_ids, n_stages - 1 in stage_ids)
                if val is not None:
                    ev = {"kind": "eval", "step": k + 1, "loss": val}
                    if reporter is not None:
                        reporter.add(ev, rank)
                    else:
                        pipe.runtime.send_control(0, k, ev)
            # --- checkpoints and graceful stop ---
            end = k + 1
            pause_for_test(default_store(), end, layout.rank, args.watchdog)  # off unless a test sets its env
            stopping = stop.after_step(end, args.steps)
            if ckpt.root is not None and (stopping or end == args.steps or (
                    args.checkpoint_every and end % args.checkpoint_every == 0)):
                path = ckpt.save(end)
                if layout.rank == 0:
                    _after_step(reporter, end, f"rrfp train: checkpoint {path} committed after step {end}")
            if stopping:
                if rank == 0:
                    _after_step(reporter, end, f"rrfp train: stopped after step {end} on request (SIGTERM)")
                break
            # --- end checkpoints ---
        if reporter is not None:
            n_evals = len([s for s in eval_steps(args) if first < s <= end])
            while reporter.next_step < end or len(reporter.evals) < n_evals:
                msg = pipe.run(pipe.runtime.control(timeout=args.watchdog))
                reporter.add(msg.meta, msg.src)
                reporter.flush()
            if chooser is not None:
                reporter.hint_detail = (f" (kept {chooser.chosen})" if chooser.chosen else
                                        f" (still measuring: too few steps to choose; last ran {chooser.current})")
            reporter.summary(time.perf_counter() - t_begin)
        if metrics is not None:
            metrics.stop_heartbeat()
        pipe.close()
    except Exception as e:
        if isinstance(e, BrokenPipeError):
            _mark_reader_gone()  # before abort(): the peers see the connection close next
        elif reporter is not None:
            reporter.flush_notes()
        if metrics is not None:
            metrics.stop_heartbeat()
        lost = None if isinstance(e, BrokenPipeError) else _lost_peer(pipe, e, rank)
        pipe.abort()
        # The root cause, not what it broke (e.g. gloo's reset connection), by global rank.
        named = None if isinstance(e, BrokenPipeError) else _named_globally(lost or e, layout)
        if named is not None:
            raise named from e
        raise
    except BaseException:
        if metrics is not None:
            metrics.stop_heartbeat()
        pipe.abort()
        raise
    finally:
        refused = {k: v for k, v in getattr(pipe.transport, "stats", {}).items() if k.startswith("rejected") and v}
        if refused:
            say(f"rrfp train: rank {rank}: refused {', '.join(f'{k}={v}' for k, v in sorted(refused.items()))}",
                sys.stderr)
    if args.trace:
        _write_trace(args, rank, n_ranks, records, out_bytes or {}, step_log)
    dist.destroy_process_group()
    if metrics_server is not None:
        from ..obs.server import linger

        linger(args.metrics_linger)
        metrics_server.close()
    return 0


def _after_step(reporter: Reporter | None, step: int, line: str) -> None:
    """Print ``line`` after the line of step ``step`` (rank 0 prints step lines as the ranks'
    statistics arrive, which can be later than this rank finishes the step)."""
    if reporter is not None:
        reporter.note(step, line)
    else:
        say(line)


def start_metrics(args: argparse.Namespace, rank: int, stage_ids: list[int]):
    """This rank's :class:`~rrfp.obs.metrics.RankMetrics` and, in standalone mode
    (``--metrics-port``), its server on port + rank (port 0: on a port the OS picks, printed
    as ``rrfp train: rank R: metrics on http://ADDR:PORT/metrics``); in multiprocess mode (the daemon set
    ``PROMETHEUS_MULTIPROC_DIR``) the daemon serves, so no server. ``(None, None)`` when
    neither asks for metrics."""
    from ..obs.metrics import multiprocess_dir

    if args.metrics_port is None and multiprocess_dir() is None:
        return None, None
    from ..obs.metrics import RankMetrics
    from ..obs.server import MetricsServer

    metrics = RankMetrics(rank, stage_ids)
    if metrics.registry is None or args.metrics_port is None:
        return metrics, None
    try:
        server = MetricsServer(metrics.registry, args.metrics_addr, args.metrics_port and args.metrics_port + rank,
                               lock=metrics.lock)
    except OSError as e:
        raise OSError(f"rank {rank}: {e}") from None
    if args.metrics_port == 0:
        host = f"[{server.addr}]" if ":" in server.addr else server.addr
        say(f"rrfp train: rank {rank}: metrics on http://{host}:{server.port}/metrics")
    return metrics, server


def eval_steps(args: argparse.Namespace) -> list[int]:
    """The steps (1-based) after which ``--eval-every`` evaluates: every N-th and the last."""
    if not args.eval_every:
        return []
    return sorted({*range(args.eval_every, args.steps + 1, args.eval_every), args.steps})


def split_held_out(samples: list, args: argparse.Namespace) -> tuple[list, list]:
    """``(train, held_out)``: with ``--eval-every``, the last ``--eval-batches`` x
    ``--batch-size`` samples of the (shuffled) pool are held out for validation.

    Raises:
        ValueError: fewer than a batch left to train on.
    """
    if not args.eval_every:
        return samples, []
    held = args.eval_batches * args.batch_size
    if len(samples) - held < args.batch_size:
        raise ValueError(f"holding out {held} of {len(samples)} samples leaves fewer than a batch to train on")
    return samples[:-held], samples[-held:]


def evaluate(pipe: Pipeline, held_out: list, args: argparse.Namespace, first: bool, last: bool) -> float | None:
    """The held-out split's loss (mean over its target tokens), forwards only; on the rank
    holding the last stage, else None."""
    total, tokens = 0.0, 0
    B = args.batch_size
    for b in range(args.eval_batches):
        mbs = make_microbatches(held_out[b * B:(b + 1) * B], args.microbatches) if held_out else None
        pipe.eval(
            microbatches=[(mb.tokens,) for mb in mbs] if first else None,
            targets=[mb.targets for mb in mbs] if last else None,
        )
        if last:
            n = sum(count_tokens(mb.targets) for mb in mbs)
            total += float(pipe.last_loss) * n
            tokens += n
    return total / tokens if last and tokens else None


def _lost_peer(pipe: Pipeline, exc: BaseException, rank: int):
    """The first peer the transport lost, when ``exc`` names none (a collective that failed
    because a peer died): the transport's loop runs only inside the pipeline's calls, so it
    is run until it notices. When ``exc`` says a peer's connection closed (gloo's "closed by
    peer"), a peer certainly went: the wait is bounded only by the transport's own worst case
    (its heartbeat timeout), not by a guess a loaded machine can outlast; otherwise 3 s."""
    from .guard import blamed_rank

    wait = getattr(pipe.transport, "wait_lost", None)
    if wait is None or blamed_rank(exc, rank) != rank:
        return None
    try:
        peer_gone = any(w in str(exc) for w in ("closed by peer", "reset by peer", "Broken pipe"))
        return pipe.run(wait(None if peer_gone else 3.0))
    except Exception:
        return None


def _named_globally(exc: BaseException, layout):
    """The :class:`~rrfp.transport.base.PeerLost` in ``exc``'s chain, whose ``rank`` is a
    pp_rank of this rank's pipeline (the transport's numbering), as a new ``PeerLost`` of
    the global rank, its message naming the coordinates (``rank 2 (pp 1, dp 0, tp 0) lost:
    ...``); None when the chain holds none."""
    from ..parallel.layout import ParallelLayout
    from ..transport.base import PeerLost

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and not isinstance(e, PeerLost) and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if not isinstance(e, PeerLost):
        return None
    rank = layout.rank_at(e.rank)
    named = PeerLost(rank, e.reason)
    named.args = (f"{ParallelLayout.name(rank, layout.dp, layout.tp)} lost: {e.reason}",)
    return named


def _transport_counts(transport) -> dict[str, int]:
    """The transport's counters for the metrics, with connections refused at the CURVE
    handshake (counted by the gatekeeper thread apart) among the refused messages."""
    stats = dict(transport.stats)
    stats["rejected"] = stats.get("rejected", 0) + stats.get("rejected_handshake", 0)
    return stats


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


def _write_trace(
    args: argparse.Namespace, rank: int, n_ranks: int, records: list, out_bytes: dict[int, list[int]],
    step_log: list | None = None,
) -> None:
    """Every rank writes its task records, output sizes (:func:`record_output_bytes`) and
    per-step ``[step, wall, busy]`` seconds (the runtime's bubble accounting, ``steps``);
    rank 0 merges them into a Chrome trace, a PNG timeline and a per-stage cost profile
    (``profile.json``, :func:`profile_from_records`) that ``rrfp simulate --costs`` reads."""
    out = Path(args.trace)
    out.mkdir(parents=True, exist_ok=True)
    part = out / f"records.rank{rank}.json"
    atomic_write_text(part, json.dumps({
        "records": [[r.rank, r.step, str(r.task), r.start, r.end] for r in records],
        "out_bytes": {str(s): v for s, v in out_bytes.items()},
        "steps": step_log or [],
    }))
    dist.barrier()
    if rank != 0:
        return
    from ..obs.trace import write_chrome_trace, write_gantt_png
    from ..runtime.rank import TaskRecord
    from ..scheduler.tasks import parse_action
    from ..sim.costs import save_profile

    merged, sizes = [], {}
    for r in range(n_ranks):
        part = json.loads((out / f"records.rank{r}.json").read_text())
        for rk, step, task, start, end in part["records"]:
            merged.append(TaskRecord(rk, step, parse_action(task), start, end))
        sizes.update({int(s): v for s, v in part["out_bytes"].items()})
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
        save_profile(profile_from_records(merged, n_ranks * args.virtual_stages, sizes), tmp,
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


def profile_from_records(records: list, n_stages: int, out_bytes: dict[int, list[int]] | None = None):
    """The measured per-stage costs as a :class:`~rrfp.sim.costs.CostModel` (``profile.json``).

    ``F``, ``B``, ``I``, ``W``: median seconds of each task kind per stage, over the steps
    after the first (which warms up). ``act_bytes`` (and ``msg_bytes``, which defaults to
    it): the median (low median: an observed size) over every traced forward of the bytes of
    the stage module's outputs, from ``out_bytes`` (:func:`record_output_bytes`; stage ->
    one size per forward). For a stage other than the last that is the activation message
    its forward sends; the gradient coming back has the same size. It is a lower bound on
    the memory one in-flight microbatch holds on the stage (autograd also keeps the stage's
    inner activations). The last stage's outputs are its logits. A stage without sizes
    gets 0.

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
        sizes = (out_bytes or {}).get(s)
        med["act_bytes"] = statistics.median_low(sizes) if sizes else 0
        stages.append(StageCost.from_mapping({k: med.get(k) for k in ("F", "B", "I", "W", "act_bytes")}, f"stage {s}"))
    return CostModel(tuple(stages))
