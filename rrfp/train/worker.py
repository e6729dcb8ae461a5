"""One rank of ``rrfp train``: build this rank's stages, run the steps, report.

Rank 0 prints one line per step (loss, tokens per second, each stage's bubble fraction) from
statistics every rank sends it as control messages, so reporting adds no barrier to a step.
The parts live beside this module: the held-out split (:mod:`rrfp.train.heldout`), the trace
(:mod:`rrfp.train.tracing`), how a failing rank ends (:mod:`rrfp.train.failures`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..data.batches import BatchSampler, make_microbatches
from ..data.text import load_samples
from ..lines import say
from ..model.gpt import count_tokens, lm_loss
from ..parallel.bootstrap import default_store, init_distributed
from ..parallel.clip import clip_grad_norm_
from ..parallel.train import replica_samples, reports, train_layout
from ..runtime.doors.pipeline import Pipeline
from ..runtime.engine.stage import PipelineStage
from ..runtime.features.recheck import recheck_steps
from ..scheduler.tasks import Placement
from . import device
from .accum import accumulated_step
from .early import SAMPLE_POOL, inflight_limits
from .failures import (GlobalRankNames, QuietAfterReaderLeft, PIPE_CLOSED, end_finished, flush_output, interrupted, lost_peer,
                       mark_reader_gone, named_globally, reader_gone, stop_quietly)
from .guard import check_finite, pause_for_test
from .heldout import eval_steps, evaluate, split_held_out
from .optim import lr_scheduler
from .precision import use_autocast
from .progress import Output
from .report import Reporter
from .tracing import record_output_bytes, record_saved_bytes, write_trace


TP_IMPL = "manual"
"""Hand-written column/row-parallel layers: cheaper per task than DTensor's here
(``benchmarks/bench_tp.py``, BENCHMARKS.md "Tensor parallelism")."""


def main(args: argparse.Namespace) -> int:
    """Run this rank of ``rrfp train`` under a launcher, then end the process
    (:func:`~rrfp.train.failures.end_finished`): 0 when the run finished,
    :data:`~rrfp.train.stop.PREEMPTED` when it stopped on SIGTERM after the checkpoint of the
    step in progress, or non-zero after one line on stderr (130: interrupted,
    :data:`PIPE_CLOSED`: the reader of rank 0's output went away)."""
    from .. import _pdeathsig

    _pdeathsig.die_with_parent()  # again: the API entry skips __main__ (already set: a no-op)
    import logging

    logging.getLogger("rrfp.transport").addFilter(QuietAfterReaderLeft())
    from .guard import configure_auth, write_error_file

    from .ckpt_lock import hold_in_rank

    try:
        lease = hold_in_rank(args)  # a plain torchrun job's: rrfp's launchers hold the folder already
        try:
            configure_auth(args)
            code = _main(args)
            flush_output()  # here: a reader gone meanwhile is the quiet stop below
        finally:
            if lease is not None:
                lease.release()  # before any exit below: they skip finalization
    except BrokenPipeError:
        # `rrfp train | head`: the reader is gone. Stop as Unix tools do, quietly, and tell the
        # other ranks (through the launcher's store) that this is no failure to report.
        stop_quietly()
    except KeyboardInterrupt:
        interrupted()
    except Exception as e:  # one line per rank, then a non-zero exit the launcher reports
        if reader_gone():
            os._exit(PIPE_CLOSED)
        rank = os.environ.get("RANK", "?")
        line = f"rrfp train: rank {rank}: error: {type(e).__name__}: {e}"
        say(line, sys.stderr)  # ranks share the launcher's stderr: one write (rrfp/lines.py)
        if rank.isdigit():
            write_error_file(e, int(rank), line)
        os._exit(1)
    end_finished(code)


def _main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if getattr(args, "port_range", None):
        from .._net import PORT_RANGE_ENV

        os.environ[PORT_RANGE_ENV] = args.port_range  # read where the transport binds (zmq_rendezvous.bind_in_range)
    init_distributed()
    layout = train_layout(args)  # this process's pp_rank in its pipeline, one per (dp_rank, tp_rank)
    from . import alive

    alive.start(layout.rank)  # rrfp node's /healthz: a beat one long task cannot hold up
    import logging

    for name in GlobalRankNames.LOGGERS:
        logging.getLogger(name).addFilter(GlobalRankNames(layout))
    place = Placement(layout.pp, args.virtual_stages, args.placement)
    data = _RankData(args, layout, place)
    metrics, metrics_server = start_metrics(args, layout.rank, data.stage_ids)
    run = _Run(args, layout, place, data, metrics)
    run.train()
    if args.trace:
        write_trace(args, layout.pp_rank, layout.pp, run.records, run.out_bytes or {}, run.step_log, run.saved_bytes)
    if run.stop.stopped_after is not None:
        # Stopped on SIGTERM, its checkpoint committed (Checkpointer.save ends with a barrier):
        # not a finished run, so no linger, and the code a restart rule matches.
        from .stop import PREEMPTED

        dist.destroy_process_group()
        if metrics_server is not None:
            metrics_server.close()
        return PREEMPTED
    return _finished(args, layout.rank, metrics_server, run.stop)


def _finished(args: argparse.Namespace, rank: int, metrics_server, stop) -> int:
    """A finished run's end on one rank: the process group destroyed and, with a metrics
    server, ``--metrics-linger`` served (under the ``rrfp train`` launcher once every rank has
    marked its training over); returns 0. ``stop``: the rank's
    :class:`~rrfp.train.stop.GracefulStop`."""
    from .linger import mark_finished

    if metrics_server is not None and args.metrics_linger > 0 and mark_finished(rank):
        dist.barrier()  # every rank marked: from the line below, a SIGTERM finds training over
        if rank == 0:
            say(f"rrfp train: training finished; serving the final metrics for {args.metrics_linger:g} s "
                "(--metrics-linger; SIGTERM or Ctrl-C ends it, exit 0)")
    dist.destroy_process_group()
    if metrics_server is not None:
        from ..obs.server import linger

        # A SIGTERM before linger's handler is in went to the graceful stop's: while some rank
        # had not yet marked (the launcher then asks a stop, not the end of a linger), or in
        # the last step. It ends the linger at once, which otherwise lasted its whole time.
        linger(args.metrics_linger, ended=lambda: stop.requested)
        metrics_server.close()
    return 0


class _RankData:
    """This rank's stages (built, sharded, checkpointed, autocast as the flags say) and, on the
    ranks holding the first or last stage, the batches of every step and the held-out split."""

    def __init__(self, args: argparse.Namespace, layout, place: Placement) -> None:
        n_stages = place.n_stages
        self.stage_ids = ids = place.stages_of(layout.pp_rank)
        self.first, self.last = 0 in ids, n_stages - 1 in ids
        self.sampler: BatchSampler | None = None
        self.batches: Callable[[int, int], Any] | None = None
        self.held_out: list = []
        self.tied = None
        if args.model == "multimodal":
            from .multimodal import DigitBatches, multimodal_stages

            modules = multimodal_stages(n_stages, ids, args.seed)
            if self.first or self.last:
                self.batches = DigitBatches(args.batch_size, args.seed).microbatches
        else:
            from .models import text_stages

            modules, self.tied = text_stages(args, n_stages, ids)
            if self.first or self.last:
                self._load_text(args, layout)
        self.stages = [PipelineStage(mod, s, n_stages) for mod, s in zip(modules, ids)]
        self._prepare(args, layout, n_stages)

    def _load_text(self, args: argparse.Namespace, layout) -> None:
        samples = load_samples(args.data, args.max_len, args.seed, limit=SAMPLE_POOL)
        samples, self.held_out = split_held_out(samples, args)
        sampler = self.sampler = BatchSampler(samples, args.batch_size * args.grad_accum, args.seed)
        self.batches = lambda k, m: make_microbatches(replica_samples(sampler.batch(k), layout), m)

    def _prepare(self, args: argparse.Namespace, layout, n_stages: int) -> None:
        if args.activation_checkpointing != "none":
            from ..model.checkpointing import apply_activation_checkpointing

            for st in self.stages:
                apply_activation_checkpointing(st.submod, args.activation_checkpointing)
        if layout.tp > 1:
            from ..model.tp import shard_gpt_stage

            for st in self.stages:
                shard_gpt_stage(st.submod, layout.tp_rank, layout.tp, layout.tp_group, TP_IMPL)
        if getattr(args, "dp_shard", "none") == "full":
            from ..parallel.train import dp_shard_mesh, shard_stage

            dev = device.resolve_device(args.device)  # sharded where it computes (CUDA: untested here)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            mesh = dp_shard_mesh(layout, dev.type)
            for st in self.stages:  # FSDP2's mixed precision stands for autocast under bf16
                st.submod.to(dev)
                st.device = dev
                shard_stage(st.submod, layout, args.precision, last=st.stage_index == n_stages - 1, mesh=mesh)
            return
        for st in self.stages:
            use_autocast(st.submod, args.precision, st.device.type, last=st.stage_index == n_stages - 1)


def _over(pipe, st) -> str | bool:
    """The hint this rank's step ran where it broke the memory budget
    (:func:`~rrfp.scheduler.memory.over_budget`), else False: rank 0's report says it once."""
    from ..scheduler.memory import over_budget

    return pipe.hint_name if over_budget(st.peak_bytes, st.peak_one, pipe.runtime.memory_budget) else False


def _pipeline(args: argparse.Namespace, layout, place: Placement, data: _RankData, record: bool):
    """This rank's :class:`Pipeline` and, under ``--hint auto``, its chooser
    (:class:`~rrfp.runtime.features.auto.AutoHint`), driven here per optimizer step."""
    pipe = Pipeline(
        data.stages, args.microbatches, lm_loss, inflight_limit=inflight_limits(args, layout.pp),
        hint=args.hint, placement=args.placement, loss_weight_fn=count_tokens, rank=layout.pp_rank,
        n_ranks=layout.pp, job=f"train-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}", watchdog=args.watchdog,
        record=record, deterministic=args.deterministic, backpressure=args.backpressure,
        transport=getattr(args, "transport", "zmq"),
        layout=layout if layout.dp * layout.tp > 1 else None,
        memory_budget=getattr(args, "memory_budget", None), tied=data.tied,
        auto_recheck=recheck_steps(getattr(args, "auto_recheck", None)),
        **device.pipeline_kwargs(args),
    )
    pipe.on_overrun = None  # rank 0's report says a broken memory budget once, for every rank
    chooser = pipe.auto
    if chooser is not None:
        pipe.drive_auto = False  # one choice per optimizer step (--grad-accum runs several pipeline steps)
        chooser.say = None  # rank 0's output says its lines (_Run), --quiet none: the summary only
    return pipe, chooser


class _Run:
    """One rank's training run: the steps, the optimizer, what each step reports, the
    evaluations, the checkpoints and a graceful stop."""

    def __init__(self, args: argparse.Namespace, layout, place: Placement, data: _RankData, metrics) -> None:
        from .flops import StepFlops, peak_tflops
        from .stepline import StepExtras

        self.args, self.layout, self.place, self.data, self.metrics = args, layout, place, data, metrics
        self.pipe, self.chooser = _pipeline(args, layout, place, data, args.trace is not None or metrics is not None)
        # profile.json's msg_bytes, measured on the forwards the run makes anyway (no extra forward).
        self.out_bytes = record_output_bytes(data.stages) if args.trace else None
        stages = data.stages
        self.params = [p for s in stages for p in s.submod.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        self.sched = lr_scheduler(self.opt, args.steps, args.warmup, args.lr_schedule, args.min_lr)
        self.reporter = Reporter(args, layout.pp, place, Output(args.steps, args.quiet, args.log_file)) \
            if layout.rank == 0 else None
        # The step line: lr, grad norm, TFLOP/s, MFU (rrfp/train/stepline.py, flops.py).
        self.step_flops = StepFlops([s.submod for s in stages], layout.tp)
        self.peak = peak_tflops(args.peak_tflops, stages[0].device)
        if self.reporter is not None:
            self.reporter.extras = StepExtras(args, stages[0].device, metrics)
            if self.chooser is not None and not args.quiet:
                # auto's lines above the progress bar (and in --log-file), not glued onto it.
                out = self.reporter.out
                self.chooser.say = lambda line: out.message(f"rrfp train: {line}")
        from .memory import RankMemory  # bytes by kind and the process's peak (rrfp/train/memory.py)

        self.memory = RankMemory([s.submod for s in stages], self.opt, self.pipe, stages[0].device)
        if self.reporter is not None:
            self.reporter.memory_sources = self.memory.sources()
        self.trace_range = getattr(args, "trace_range", None) or (1, args.steps)
        self.records: list = []
        self.step_log: list = []
        self.saved_bytes: dict[int, list[int]] = {}  # profile.json's act_bytes (tracing.record_saved_bytes)
        if metrics is not None:
            self.pipe.run(metrics.start_heartbeat())
        self._checkpoints(args, layout, stages)

    def _checkpoints(self, args: argparse.Namespace, layout, stages) -> None:
        """Checkpoints and graceful stop (rrfp/train/checkpoint.py, stop.py); resumes."""
        from .checkpoint import Checkpointer, nothing_to_do
        from .stop import GracefulStop

        sampler = self.data.sampler
        self.stop = GracefulStop(default_store(), layout.rank, dist.get_world_size(), timeout_s=args.watchdog,
                                 checkpoint=getattr(args, "checkpoint_dir", None) is not None)  # before loading: SIGTERM may come any time
        self.ckpt = Checkpointer(args, layout, stages, self.opt, n_samples=len(sampler.samples) if sampler else 0,
                                 schedule=self.sched, chooser=self.chooser)
        self.first = self.end = 0
        resume = self.ckpt.resume_path()
        if resume is not None:
            self.first = self.ckpt.load(resume)
            if layout.rank == 0:
                say(f"rrfp train: resumed from {resume} at step {self.first}")
                if (done := nothing_to_do(args, resume)) is not None:
                    say(done)  # under a launcher of one's own (torchrun, rrfp node)
        if self.reporter is not None:
            self.reporter.next_step = self.first
        if self.chooser is not None:
            if resume is not None:
                _keep_recorded_hint(self.chooser, args, resume)
            self.chooser.run_length(args.steps - self.first)

    # ------------------------------------------------------------ the run
    def train(self) -> None:
        """Every step from the first (0, or the checkpoint's), then the report's end.

        Raises:
            the step's error, its root cause named by global rank when a peer was lost.
        """
        pipe, reporter = self.pipe, self.reporter
        self.t_begin = self.last = time.perf_counter()
        try:
            for k in range(self.first, self.args.steps):
                if self.step(k):
                    break
            if reporter is not None:
                self._drain()
            self._stop_heartbeat()
            pipe.close()
        except Exception as e:
            named = self._fail(e)
            if named is not None:
                raise named from e
            raise
        except BaseException:
            self._stop_heartbeat()
            pipe.abort()
            raise
        finally:
            refused = {k: v for k, v in getattr(pipe.transport, "stats", {}).items() if k.startswith("rejected") and v}
            if refused:
                say(f"rrfp train: rank {self.layout.pp_rank}: refused "
                    f"{', '.join(f'{k}={v}' for k, v in sorted(refused.items()))}", sys.stderr)

    def step(self, k: int) -> bool:
        """Run training step ``k`` (0-based) and what follows it; True: stop after it."""
        args, data, chooser = self.args, self.data, self.chooser
        t_step = time.perf_counter()
        self.memory.begin_step()
        self.opt.zero_grad(set_to_none=True)
        mbs = data.batches(k, args.microbatches * args.grad_accum) if data.batches else None
        if chooser is not None:
            chooser.before_step(k - self.first)
        loss, st = accumulated_step(self.pipe, mbs, args.microbatches, args.grad_accum, data.first,
                                    data.last)  # --grad-accum (rrfp/train/accum.py)
        if chooser is not None:
            self.pipe.run(chooser.after_step(k - self.first, [st]))
        loss = self._optimize(k, loss)
        if args.trace and self.trace_range[0] <= k + 1 <= self.trace_range[1]:
            # Labelled with the training step (evaluations are pipeline steps too).
            self.records += [r if r.step == k else dataclasses.replace(r, step=k) for r in st.records]
            self.step_log.append([k, st.wall, st.busy])
            record_saved_bytes(self.pipe, args.microbatches, self.saved_bytes)
        self._publish(k, loss, st, mbs, t_step)
        if args.eval_every and ((k + 1) % args.eval_every == 0 or k + 1 == args.steps):
            self._evaluate(k)
        return self._after(k + 1)

    def _optimize(self, k: int, loss):
        """Clip, check, step the optimizer and the schedule; returns the loss to report (None:
        a non-finite step skipped under ``--skip-nonfinite``).

        Raises:
            the non-finite loss or gradient norm's error (:func:`~rrfp.train.guard.check_finite`).
        """
        from .stepline import grad_norm_share

        args, params, layout = self.args, self.params, self.layout
        self.lr, self.grad_sq, self.flops = self.opt.param_groups[0]["lr"], grad_norm_share(params, layout), \
            self.step_flops.take()
        if args.clip_grad is not None:
            clip_grad_norm_(params, args.clip_grad, layout)
        # This rank's own part (an FSDP2 shard's local tensor): a finiteness check, no collective.
        gnorm = float(torch.nn.utils.get_total_norm([getattr(p.grad, "_local_tensor", p.grad) for p in params
                                                     if p.grad is not None])) \
            if any(p.grad is not None for p in params) else 0.0
        poisoned = check_finite(k, layout.rank, None if loss is None else float(loss), gnorm)
        if poisoned is None:
            self.opt.step()
        elif getattr(args, "skip_nonfinite", False):
            if layout.rank == 0:
                say(f"rrfp train: skipped {poisoned}", sys.stderr)
            loss = None  # nothing of this step reaches the report
        else:
            raise poisoned
        self.sched.step()
        return loss

    def _publish(self, k: int, loss, st, mbs, t_step: float) -> None:
        """Step ``k``'s statistics: to the metrics, and to rank 0's report (sent, or added)."""
        from .stepline import rank_fields

        args, layout, pipe, metrics, reporter = self.args, self.layout, self.pipe, self.metrics, self.reporter
        meta = {"kind": "stats", "step": k, "busy": st.busy, "wall": st.wall, "peak": st.peak_mb_inflight,
                "loss": None if loss is None else float(loss), **rank_fields(self.lr, self.grad_sq, self.flops),
                "mem": self.memory.fields(st), "over": _over(pipe, st)}
        if metrics is not None:
            metrics.observe_memory(meta["mem"])
            metrics.observe(st, loss=meta["loss"], tokens=sum(mb.n_tokens for mb in mbs) if self.data.first else 0,
                            seconds=time.perf_counter() - t_step, transport=_transport_counts(pipe.transport),
                            runtime_rejected=pipe.runtime.inbox.rejected)
            tflops = self.flops / st.wall / 1e12 if st.wall > 0 else 0.0
            metrics.observe_rates(lr=self.lr, tflops=tflops, mfu=tflops / self.peak if self.peak else None)
        if reporter is None:
            if reports(layout):
                pipe.runtime.send_control(0, k, meta)
            return
        now = time.perf_counter()
        reporter.step_time[k], self.last = now - self.last, now
        reporter.tokens[k] = sum(mb.n_tokens for mb in (
            mbs if layout.dp == 1 else make_microbatches(self.data.sampler.batch(k), args.microbatches)))
        reporter.add(meta, 0)
        for msg in pipe.runtime.poll_control():
            reporter.add(msg.meta, msg.src)
        reporter.flush()

    def _evaluate(self, k: int) -> None:
        """The held-out loss after step ``k``, to rank 0's report."""
        data = self.data
        val = evaluate(self.pipe, data.held_out, self.args, data.first, data.last)
        if val is not None:
            ev = {"kind": "eval", "step": k + 1, "loss": val}
            if self.reporter is not None:
                self.reporter.add(ev, self.layout.pp_rank)
            else:
                self.pipe.runtime.send_control(0, k, ev)

    def _after(self, end: int) -> bool:
        """Checkpoint after step ``end`` (1-based) when due; True: a graceful stop was asked."""
        from .stop import PREEMPTED

        args, layout = self.args, self.layout
        self.end = end
        pause_for_test(default_store(), end, layout.rank, args.watchdog)  # off unless a test sets its env
        stopping = self.stop.after_step(end, args.steps)
        if self.ckpt.root is not None and (stopping or end == args.steps or (
                args.checkpoint_every and end % args.checkpoint_every == 0)):
            from .ckpt_verify import save_errors

            with save_errors(self.ckpt.root, end, layout.rank):  # a full disk: one line, not every rank's traceback
                path = self.ckpt.save(end)
            if layout.rank == 0:
                _after_step(self.reporter, end, f"rrfp train: checkpoint {path} committed after step {end}")
        if stopping and layout.pp_rank == 0:
            _after_step(self.reporter, end, f"rrfp train: stopped after step {end} on request (SIGTERM), "
                        f"the step in progress; exit {PREEMPTED}")
        return stopping

    def _drain(self) -> None:
        """Rank 0: wait for every step's and evaluation's statistics, then print the summary."""
        reporter, chooser, pipe = self.reporter, self.chooser, self.pipe
        n_evals = len([s for s in eval_steps(self.args) if self.first < s <= self.end])
        while reporter.next_step < self.end or len(reporter.evals) < n_evals:
            msg = pipe.run(pipe.runtime.control(timeout=self.args.watchdog))
            reporter.add(msg.meta, msg.src)
            reporter.flush()
        if chooser is not None:
            reporter.hint_detail = (f" (kept {chooser.chosen})" if chooser.chosen else
                                    f" (too short to choose: ran {chooser.strict})" if chooser.too_short else
                                    f" (still measuring: too few steps to choose; last ran {chooser.current})")
        reporter.summary(time.perf_counter() - self.t_begin)

    def _stop_heartbeat(self) -> None:
        if self.metrics is not None:
            self.metrics.stop_heartbeat()

    def _fail(self, e: Exception):
        """Abort the pipeline after ``e``; returns the root cause to raise instead, a
        :class:`~rrfp.transport.base.PeerLost` naming the global rank (None: raise ``e``)."""
        broken_pipe = isinstance(e, BrokenPipeError)
        if broken_pipe:
            mark_reader_gone()  # before abort(): the peers see the connection close next
        elif self.reporter is not None:
            self.reporter.flush_notes()
        self._stop_heartbeat()
        lost = None if broken_pipe else lost_peer(self.pipe, e, self.layout.pp_rank)
        self.pipe.abort()
        # The root cause, not what it broke (e.g. gloo's reset connection), by global rank.
        return None if broken_pipe else named_globally(lost or e, self.layout)


RECORDED_LAYOUT = ("stages", "virtual_stages", "placement", "tp", "dp", "dp_shard")
"""The flags a checkpoint's ``auto`` choice was measured under: a resume at another of them
measures and chooses anew."""


def _keep_recorded_hint(chooser, args: argparse.Namespace, resume) -> None:
    """Under ``--hint auto``, a resumed run keeps the hint the checkpoint's run chose
    (``rrfp.json``'s ``"hint"``, :meth:`AutoHint.adopt <rrfp.runtime.features.auto.AutoHint.adopt>`),
    when it was measured at this layout; every rank reads the same file, so all decide alike."""
    from .checkpoint import _DEFAULTS, read_meta

    meta = read_meta(resume)
    hint, written = meta.get("hint"), meta.get("args") or {}
    if not isinstance(hint, str) or not hint:
        return
    moved = [k for k in RECORDED_LAYOUT if written.get(k, _DEFAULTS.get(k)) != getattr(args, k, _DEFAULTS.get(k))]
    if moved:
        if chooser.say:
            chooser.say(f"hint auto: the checkpoint's choice {hint} was measured at another layout "
                        f"(--{moved[0].replace('_', '-')} {written.get(moved[0], _DEFAULTS.get(moved[0]))}); measuring anew")
        return
    chooser.adopt(hint, f"checkpoint {os.path.basename(os.fspath(resume))}")


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


def _transport_counts(transport) -> dict[str, int]:
    """The transport's counters for the metrics, with connections refused at the CURVE
    handshake (counted by the gatekeeper thread apart) among the refused messages."""
    stats = dict(transport.stats)
    stats["rejected"] = stats.get("rejected", 0) + stats.get("rejected_handshake", 0)
    return stats
