"""``rrfp train``: validate flags, then launch one process per rank unless already inside a
launched job.

The same command is the per-rank entry point: ``torchrun --nproc-per-node 4 -m rrfp train``
(or ``rrfp node``, through torch's elastic agent) runs each rank directly, and plain
``rrfp train`` forks its ranks from a zygote that imported torch once (rrfp/train/zygote.py),
giving each the environment torchrun's agent would.
"""

from __future__ import annotations

import argparse
import signal
import os
import sys

from ..errors import UsageError
from ..plugins import add_flag as add_plugin_flag
from ..scheduler.registry import forms as hint_forms
from ..runtime.features.recheck import RECHECK_EVERY, recheck_steps
from ..sim.auto import AUTO
from ..lines import say
from ..transport import registry as transports
from .early import DEFAULT_STAGES, SAMPLE_POOL, check_flags
from .linger import FINISHED_ENV, all_finished
from .stop import PREEMPTED

DEFAULTS = dict(
    stages=DEFAULT_STAGES,
    virtual_stages=1,
    microbatches=8,
    batch_size=32,
    steps=40,
    model="tiny",
    max_len=128,
    lr=3e-3,
    seed=0,
    hint=AUTO,
    inflight_limit=None,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT on real text with the readiness-driven pipeline runtime",
        description="Train a GPT-style language model split into pipeline stages, one process per "
        "pipeline rank, on real text (default: this Python's standard-library sources).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--pp", "--stages", dest="stages", type=int, default=None, metavar="N",
                   help=f"pipeline degree: pipeline ranks (processes); without it, the world size under torchrun, else {DEFAULTS['stages']}")
    p.add_argument("--virtual-stages", type=int, default=DEFAULTS["virtual_stages"], help="virtual stages per rank")
    p.add_argument("--placement", choices=["loop", "v"], default="loop", help="virtual-stage placement")
    p.add_argument("--transport", choices=transports.names(transports.PROCESS), default="zmq",
                   help=f"how tensors travel between ranks (rrfp/transport/registry.py): {transports.help_text(transports.PROCESS)}")
    add_port_flag(p)
    p.add_argument("--microbatches", type=int, default=DEFAULTS["microbatches"], help="microbatches per step")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="samples per step")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--hint", default=DEFAULTS["hint"], help="auto (measure this job's costs, simulate and try the "
                   "candidates, keep the fastest: rrfp/runtime/features/auto.py), or one of " + hint_forms()
                   + "; PyTorch's schedule names too (Interleaved1F1B...), and the hints a --plugin registers")
    add_plugin_flag(p)
    p.add_argument("--auto-recheck", default=str(RECHECK_EVERY), metavar="N|off",
                   help="with --hint auto: steps between re-checks (one more trial round each; a switch needs a hint "
                   "measured faster than the kept one beyond the tie); off: keep the first choice")
    p.add_argument("--inflight-limit", default=DEFAULTS["inflight_limit"], metavar="L",
                   help="in-flight limit: an integer, or '1f1b' for p - rank; without it, 32, except that a schedule "
                   "used as a hint (1f1b, gpipe, PyTorch's 1F1B...), and auto's candidates, keep that schedule's own peak unless --memory-budget is given")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="activation bytes per rank (64MiB, 1.5GB, bytes): a microbatch is admitted only if its "
                   "measured-size estimate fits (README: Memory budget)")
    p.add_argument("--backpressure", choices=["admission", "completion-order"], default="admission",
                   help="with virtual stages: what a rank does at the in-flight limit (see README)")
    p.add_argument("--model", default=DEFAULTS["model"], help="model preset: tiny (4 layers), small (8), medium (12), or multimodal (an image encoder + 3 decoder "
                   "blocks on scikit-learn's digits, 0-6 images and a caption per sample), hf:<name> or hf:<folder>; --pp x --virtual-stages "
                   "must not exceed its layers")
    p.add_argument("--max-len", type=int, default=DEFAULTS["max_len"], help="longest sample, in tokens (bytes)")
    p.add_argument("--data", nargs="+", metavar="PATH", default=None, help="text files or folders; without --data, the Python standard library's sources")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed for weights and data order")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="AdamW learning rate")
    p.add_argument("--deterministic", action="store_true", help="accumulate weight gradients in microbatch order: bitwise reproducible runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--trace", metavar="DIR", default=None, help="write to DIR: trace.json (Chrome trace, open in Perfetto), timeline.png, "
                   "profile.json (per-stage costs for rrfp simulate --costs) and records.rank*.json (each rank's tasks)")
    p.add_argument("--watchdog", type=float, default=60.0, help="seconds a rank may wait, or one task run, before the rank fails naming it")
    from ..obs.server import add_flags as add_metrics_flags

    add_metrics_flags(p, "serve Prometheus metrics on this port + rank (each rank its own endpoint, /metrics; "
                      "0: each rank on a port the OS picks, printed)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    # Parallel layout (rrfp/parallel): one pipeline per (dp, tp) coordinate.
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree: pipelines that each take 1/dp of the batch")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: ranks that share each stage's attention and MLP")
    add_dp_shard_flag(p)
    from . import device

    device.add_flags(p)
    add_job_flags(p)
    from .checkpoint import add_flags as add_checkpoint_flags

    add_checkpoint_flags(p)
    add_security_flags(p)
    # Step line, activation checkpointing, gradient accumulation (rrfp/train/stepline.py, models.py, accum.py).
    from .accum import add_flags as add_accum_flags
    from .models import add_flags as add_model_flags
    from .stepline import add_flags as add_step_line_flags

    add_step_line_flags(p)
    add_model_flags(p)
    add_accum_flags(p)
    p.add_argument("--loss-file", metavar="PATH", default=None,
                   help="rank 0 writes every step's loss here at the end, one line '<step> <float.hex>' "
                   "(exact: two runs compare bit for bit)")
    p.set_defaults(func=run, _parser=p)


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """The job secret, the unauthenticated mode and poisoned steps (README: Security)."""
    p.add_argument("--job-secret-file", metavar="PATH", default=None,
                   help="file holding the job secret (e.g. a mounted Kubernetes Secret); else RRFP_JOB_SECRET; "
                   "on one machine rrfp train makes one per run")
    p.add_argument("--insecure", action="store_true",
                   help="allow ranks to bind a non-loopback address without a job secret (no authentication)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradient norm is NaN/inf instead of stopping the run")


def add_dp_shard_flag(p: argparse.ArgumentParser) -> None:
    """``--dp-shard`` (rrfp/parallel/sharded.py)."""
    p.add_argument("--dp-shard", choices=("none", "optimizer", "full"), default="none",
                   help="with --dp: none (each replica holds whole parameters, gradients and AdamW states), full "
                   "(FSDP2 fully_shard of each block and stage over the DP ranks: gathered once per step, gradients "
                   "reduce-scattered; --precision bf16 computes in bf16 and reduces in fp32), optimizer (refused: "
                   "under FSDP2 it would hold more bytes than full for the same communication)")


def add_port_flag(p: argparse.ArgumentParser) -> None:
    """``--port-range``: where the ranks' ZeroMQ sockets bind (rrfp/transport/zmq_rendezvous.py)."""
    p.add_argument("--port-range", default=None, metavar="LO-HI",
                   help="ports the ranks' ZeroMQ sockets bind, e.g. 29500-29599: each rank the first free one "
                   "(a firewall or NetworkPolicy can then name them; docs/operations.md); without it, env "
                   "RRFP_PORT_RANGE, else a port the OS picks")


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """Evaluation, learning-rate schedule, clipping, precision, output and config flags."""
    from .precision import PRECISIONS

    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps (and after the last), the validation loss on the held-out split; 0: never")
    p.add_argument("--eval-batches", type=int, default=2, help="held-out batches (of --batch-size samples) per evaluation")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="after warm-up: constant, or cosine decay to --min-lr at the last step")
    p.add_argument("--warmup", type=int, default=0, metavar="STEPS", help="linear learning-rate warm-up steps")
    p.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of a cosine schedule")
    p.add_argument("--clip-grad", type=float, default=None, metavar="MAX",
                   help="clip the global gradient norm (across all stages) to MAX")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="bf16: forwards under torch.autocast (parameters and gradients stay float32)")
    p.add_argument("--log-file", default=None, metavar="PATH", help="also write every printed line here")
    p.add_argument("--trace-steps", default=None, metavar="A:B",
                   help="with --trace: record steps A..B (1-based, inclusive); without it, every step, "
                   "the timeline showing the last 3")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read flags from a TOML file (keys are flag names: steps = 100); the command line wins")


def validate(args: argparse.Namespace) -> None:
    """Check every flag before any process starts: the checks that need no torch
    (:func:`rrfp.train.early.check_flags`, unless :func:`rrfp.cli.main` ran them already),
    then the few that do (a CUDA device, the job secret's format, enough samples in ``--data``).

    Raises:
        UsageError: one line naming the bad value and what was expected.
    """
    if not getattr(args, "checked_early", False):
        check_flags(args)
    recheck_every(args)
    from . import device

    device.validate(args)
    if getattr(args, "job_secret_file", None):
        from ..transport.auth import JobAuth

        try:
            JobAuth.from_file(args.job_secret_file)
        except ValueError as e:
            raise UsageError(f"--job-secret-file: {e}") from None
    else:
        from ..transport.auth import ENV_SECRET, JobAuth

        if os.environ.get(ENV_SECRET):
            try:
                JobAuth(os.environ[ENV_SECRET])
            except ValueError as e:
                raise UsageError(f"{ENV_SECRET}: {e}") from None
    if args.data:
        _check_samples(args)
    from .._net import parse_port_range

    spec, what = port_range(args)
    if spec:
        try:
            parse_port_range(spec, what)
        except ValueError as e:
            raise UsageError(str(e)) from None


def port_range(args: argparse.Namespace) -> tuple[str | None, str]:
    """The ZeroMQ port range the ranks will bind in (``--port-range``, else
    ``RRFP_PORT_RANGE``) and where it came from, for an error line."""
    from .._net import PORT_RANGE_ENV

    if getattr(args, "port_range", None):
        return args.port_range, "--port-range"
    return os.environ.get(PORT_RANGE_ENV) or None, PORT_RANGE_ENV


def recheck_every(args: argparse.Namespace) -> int:
    """``--auto-recheck`` as steps between ``auto``'s re-checks
    (:func:`~rrfp.runtime.features.recheck.recheck_steps`; 0: ``off``).

    Raises:
        UsageError: neither ``off`` nor an integer >= 0, or other than the default with a hint
            other than ``auto``.
    """
    from ..runtime.doors.names import hint_text

    text = getattr(args, "auto_recheck", None)
    try:
        every = recheck_steps(text)
    except ValueError as e:
        raise UsageError(f"--auto-recheck={text!r}: {e}") from None
    if every != RECHECK_EVERY and hint_text(args.hint) != AUTO:
        raise UsageError(f"--auto-recheck={text!r} applies to --hint auto only; this run has --hint {args.hint}")
    return every


def _check_samples(args: argparse.Namespace) -> None:
    """Enough samples in ``--data`` for a batch (and the held-out split): the ranks would load
    the same samples, and finding too few here saves starting them."""
    from ..data.text import load_samples

    try:
        n = len(load_samples(args.data, args.max_len, args.seed, limit=SAMPLE_POOL))
    except (ValueError, OSError) as e:
        raise UsageError(f"--data: {e}") from None
    if n < args.batch_size:
        raise UsageError(
            f"--batch-size={args.batch_size} exceeds the {n} samples in --data "
            f"{' '.join(args.data)}: use a smaller batch or more text"
        )
    held = args.eval_batches * args.batch_size if args.eval_every else 0
    if held and n - held < args.batch_size:
        raise UsageError(
            f"--eval-every holds out {held} of the {n} samples in --data (--eval-batches={args.eval_batches} "
            f"x --batch-size={args.batch_size}), leaving fewer than a batch to train on: use more text"
        )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "early", None) is not None:
        args = args.early  # --config read and the torch-free checks run (rrfp.train.early.check)
    elif args.config is not None:
        from .config import apply_config

        args = apply_config(args)
    validate(args)
    from .._launch_env import in_launched_worker

    if in_launched_worker():
        from .worker import main as worker_main

        return worker_main(args)
    from .checkpoint import nothing_to_do

    if (done := nothing_to_do(args)) is not None:
        say(done)  # the run is complete already: starting ranks would change nothing
        return 0
    from .._net import port_range_problem

    spec, what = port_range(args)
    if problem := port_range_problem(spec, args.stages * args.dp * args.tp, what):  # all ranks on this host
        raise UsageError(problem)
    import uuid

    from .ckpt_lock import FolderInUse, hold
    from .zygote import LauncherSignals

    # From here to the last line, a signal waits for the job to start (no lease, folder or
    # secret half made) and stops it then; one that comes once its end is decided waits out the
    # cleanup (LauncherSignals).
    with LauncherSignals():
        try:
            lease = hold(args, f"train-{uuid.uuid4().hex[:12]}")  # each launch is a job of its own
        except FolderInUse as e:
            raise UsageError(str(e)) from None
        try:
            return launch(args)
        finally:
            if lease is not None:
                lease.release()


def launch(args: argparse.Namespace) -> int:
    """Start ``stages x dp x tp`` ranks on this machine, forked from a zygote that imported
    torch once (:mod:`rrfp.train.zygote`); the exit code of ``rrfp train``: 0 when the run
    finished, :data:`~rrfp.train.stop.PREEMPTED` when a SIGTERM stopped it (the launcher's
    :class:`~rrfp.train.stop.StopForwarder` asks the ranks to end the step in progress),
    1 with one line naming the rank that failed first, :data:`PIPE_CLOSED`, or 128 + another
    signal that stopped the run."""
    from .._secret import in_memory_supported, private_secret_file
    from ..transport.auth import ENV_SECRET, JobAuth

    world = args.stages * args.dp * args.tp
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before the zygote loads OpenMP
    env = dict(os.environ)
    argv = getattr(args, "argv", None) or ["train"]
    # One secret per run, never in argv nor in the ranks' environment (/proc/<pid>/environ shows
    # a process's first one for its whole life). Linux: it reaches each rank in memory through
    # the zygote's socket and lives there only (rrfp/_secret.py), so that no exit of the
    # launcher, SIGKILL included, leaves it behind. Elsewhere a --job-secret-file only this user
    # can read, deleted when the run ends. A --job-secret-file or a secret in the environment is kept.
    secret = remove_secret = None
    if not getattr(args, "job_secret_file", None) and not env.get(ENV_SECRET):
        if in_memory_supported():
            secret = JobAuth.generate()
        else:
            secret_file, remove_secret = private_secret_file(JobAuth.generate())
            argv = [*argv, "--job-secret-file", secret_file]
    checkpoint_dir = getattr(args, "checkpoint_dir", None)
    try:
        return _launch_local(argv, world, env, args, checkpoint_dir, secret)
    finally:
        if remove_secret is not None:
            remove_secret()


def _launch_local(argv: list[str], world: int, env: dict[str, str], args: argparse.Namespace,
                  checkpoint_dir: str | None, secret: str | None = None) -> int:
    """:func:`launch` once the secret is settled: ``world`` ranks of ``rrfp ARGV`` forked from
    the zygote with ``env`` (and ``secret``, :class:`~rrfp.train.zygote.LocalJob`), the
    launcher's signals handled (:class:`~rrfp.train.zygote.LauncherSignals`: :func:`run`'s)."""
    import tempfile

    from .stop import STOP_FILE_ENV, StopForwarder
    from .zygote import LocalJob, Signalled

    with tempfile.TemporaryDirectory(prefix="rrfp-train-") as folder:
        finished = None
        if getattr(args, "metrics_linger", 0) > 0:
            env[FINISHED_ENV] = finished = os.path.join(folder, "finished")
            os.mkdir(finished)
        then = ", commit a checkpoint" if checkpoint_dir else ""
        env[STOP_FILE_ENV] = os.path.join(folder, "stop-requested")
        with LocalJob(argv, world, env, folder, secret) as job:
            stop = None
            try:
                try:  # a signal before the forwarder is in raises Signalled once the job starts
                    stop = StopForwarder(env[STOP_FILE_ENV], f"rrfp train: SIGTERM: asking the ranks to end the "
                                         f"step in progress{then} and exit {PREEMPTED}", children=job.running,
                                         finished=finished and (lambda: all_finished(finished, world)),
                                         raises=Signalled)
                    job.signals.forwarder = stop  # the launcher's handler passes SIGTERM to it
                    job.signals.open()  # a signal that came meanwhile raises here
                    job.start()
                    failures = job.wait()
                finally:
                    if stop is not None:
                        stop.ended = True  # from here a SIGTERM only marks the run's end as asked
                    job.signals.end()  # and no other signal cuts the stop or the last line short
            except Signalled as e:
                job.stop(e.sigval)
                name = signal.Signals(e.sigval).name
                if finished is not None and all_finished(finished, world):
                    say(f"rrfp train: {name} ended --metrics-linger; training had finished")
                    return 0
                if job.procs and all(p.exitcode == 0 for p in job.procs):
                    # Every rank had exited 0 when the signal came (after wait() saw the last
                    # end, before the launch was marked ended): the run finished.
                    from .stop import finished_line

                    say(finished_line("rrfp train", name, checkpoint_dir))
                    return 0
                say(f"rrfp train: stopped by {name}; the ranks were stopped too", sys.stderr)
                return 128 + int(e.sigval)
            except RuntimeError as e:  # the store's process could not start
                say(f"rrfp train: error: {e}", sys.stderr)
                return 1
            return _outcome(failures, job.signalled, (args.dp, args.tp), stop.requested, checkpoint_dir)


def _outcome(failures: dict, signalled: set[int], degrees: tuple[int, int], stopped: bool,
             checkpoint_dir: str | None) -> int:
    """The launcher's last line and exit code from its ranks' ends (``failures``: the ranks
    that exited non-zero, :class:`~rrfp.train.zygote.Failure`); ``stopped``: a SIGTERM asked
    the ranks to stop."""
    from .stop import finished_line, stopped_line

    if any(f.exitcode == PIPE_CLOSED for f in failures.values()):
        return PIPE_CLOSED  # `rrfp train | head`: the reader left; nothing failed
    if stopped and failures:
        line, clean = stopped_line("rrfp train", "on SIGTERM", failures, checkpoint_dir)
        say(line, None if clean else sys.stderr)
        return PREEMPTED
    if failures:
        say(f"rrfp train: error: {describe_failures(failures, signalled, degrees)}", sys.stderr)
        return 1
    if stopped:
        say(finished_line("rrfp train", "SIGTERM", checkpoint_dir))
    return 0


PIPE_CLOSED = 141
"""A rank's exit code when rank 0's stdout reader went away (128 + SIGPIPE)."""


class _NoPipeClosedErrors:
    """Drops the agent's error record for a rank that stopped because its reader left or on a
    SIGTERM stop (:data:`~rrfp.train.stop.PREEMPTED`), and its note that it stops the others
    (the one-line summary says so)."""

    def filter(self, record) -> bool:
        text = record.getMessage()
        return not any(f"exitcode: {code})" in text for code in (PIPE_CLOSED, PREEMPTED)) \
            and "closing signal SIGTERM" not in text


def _quiet_launcher_logs(recorder=None) -> None:
    """Hide torchrun's agent chatter; ``recorder`` (a :class:`~rrfp.train.guard.LauncherSignals`)
    is installed first, so it still sees the "closing signal" records that are hidden."""
    import logging

    # torchrun's agent logs every rendezvous detail at INFO; users want the job's own lines.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    # A logger stops at its first filter that drops a record: the recorder must come before
    # the filter that hides the agent's "closing signal" lines, or it never learns which
    # ranks the launcher stopped (and blames rank 0 for an outside SIGTERM).
    for f in [f for f in api.filters if isinstance(f, _NoPipeClosedErrors)]:
        api.removeFilter(f)
    if recorder is not None:
        api.addFilter(recorder)
    api.addFilter(_NoPipeClosedErrors())


def describe_failures(failures: dict, launcher_signalled: set[int] | None = None,
                      degrees: tuple[int, int] | None = None) -> str:
    """One line naming the rank that went first (:func:`rrfp.train.guard.root_cause`: the
    ranks' own blame records, then a signal other than the launcher's SIGTERM, then the
    earliest failure), with its own message when it left one. ``degrees``: the job's
    ``(dp, tp)``; with it the rank is named with its coordinates, ``rank 2 (pp 1, dp 0, tp 0)``."""
    import signal as _signal

    from .guard import root_cause

    rank = root_cause(failures, launcher_signalled)
    first = failures.get(rank)
    if degrees is None:
        who = f"rank {rank}"
    else:
        from ..parallel.layout import ParallelLayout

        who = ParallelLayout.name(rank, *degrees)
    if first is None:
        what = f"{who} was lost"
    elif first.exitcode < 0 and launcher_signalled is not None and getattr(first, "pid", None) in launcher_signalled:
        # Blamed by others, then stopped by the launcher before it could say why itself.
        said = [f.message for r, f in sorted(failures.items()) if r != rank and isinstance(f.message, str)
                and ((getattr(f, "error_file_data", None) or {}).get("rrfp") or {}).get("blame") == rank]
        what = f"{who} failed first (stopped by the launcher before it exited)"
        if said:
            what += f": {said[0].split(': error: ', 1)[-1]}"
    elif first.exitcode < 0:
        what = f"{who} died ({_signal.Signals(-first.exitcode).name})"
    else:
        what = f"{who} failed (exit code {first.exitcode})"
        msg = ((getattr(first, "error_file_data", None) or {}).get("rrfp") or {}) and first.message
        if isinstance(msg, str) and msg:
            what += f": {msg.removeprefix(f'rrfp train: rank {rank}: error: ')}"
    others = sorted(r for r in failures if r != rank)
    plural = "s" if len(others) > 1 else ""
    tail = f"; rank{plural} {', '.join(map(str, others))} stopped too" if others else ""
    return what + tail
