"""``rrfp train``'s flags checked without torch: every value and combination (degrees, batch
and microbatches, model, hint, in-flight limit, memory budget, paths, ports, checkpoints),
run by :func:`rrfp.cli.main` right after parsing, so that a bad flag answers in a fraction of
a second instead of after torch's import (seconds; minutes on a loaded machine). The few
checks that need torch follow in :func:`rrfp.train.cli.validate`.

Nothing here imports torch, transformers or the runtime's tensor code; ``tests/test_cli_early.py``
runs each refused case in a child process and checks that torch was not loaded.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
from pathlib import Path

from .._launch_env import in_launched_worker
from .._paths import output_file_problem
from .._secret import read_secret_file
from ..errors import UsageError
from ..plugins import load as load_plugins
from ..runtime.doors.config import DEFAULT_INFLIGHT_LIMIT
from ..runtime.doors.names import hint_text, unknown_door_hint
from ..scheduler.hints import hint_form
from ..sim.auto import AUTO

DEFAULT_STAGES = 4
"""Pipeline degree without ``--pp`` outside a torchrun job."""

SAMPLE_POOL = 8192
"""Samples loaded for training: a fixed pool (not tied to --steps, so the first batches of a
run do not depend on how long it runs); the sampler reshuffles it every epoch."""

POSITIVE = ("stages", "virtual_stages", "microbatches", "batch_size", "steps", "max_len", "threads", "dp", "tp")
"""Integer flags that must be at least 1."""

MAX_STEPS = 10**9
"""More steps than any run makes (a typo's 10**22 would start the ranks and run for ever)."""


def flag(dest: str) -> str:
    """The flag that sets ``dest`` as users spell it (``stages`` is ``--pp``)."""
    return "--pp" if dest == "stages" else "--" + dest.replace("_", "-")


def inflight_limits(args: argparse.Namespace, n_ranks: int) -> list[int] | None:
    """Every rank's in-flight limit from ``--inflight-limit`` (all ranks get the whole list: a
    strict policy is compiled from it, and every rank must compile the same orders). None:
    not given; :func:`rrfp.runtime.doors.config.plan` then decides, the one rule for both front
    doors (a schedule used as a hint, and ``auto``'s candidates, keep the schedule's own peak
    unless ``--memory-budget`` is given)."""
    text = getattr(args, "inflight_limit", None)
    if text is None:
        return None
    if text == "1f1b":
        return [n_ranks - r for r in range(n_ranks)]
    return [int(text)] * n_ranks


def hint_problem(text: str, default: str | None) -> str | None:
    """Why ``text`` cannot name a hint (None: it can): not a name of the hint table (rrfp's,
    a ``--plugin``'s or PyTorch's, optionally ``strict-``), ``backfill:``, ``order:`` or a CSV
    file (:func:`rrfp.scheduler.hints.hint_form`). The parser's default is always accepted."""
    if text == default or hint_form(hint_text(text)) is not None:
        return None
    return f"--hint={text!r}: {unknown_door_hint(text)}"


def port_problem(addr: str, first: int, n: int, what: str) -> str | None:
    """Why ports ``first .. first + n - 1`` on ``addr`` cannot be listened on (one is taken),
    or None. Bound with ``SO_REUSEADDR`` as the metrics servers are, so a port that only
    lingers in TIME_WAIT counts as free."""
    for port in range(first, first + n):
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as e:
            rank = f" (rank {port - first}'s endpoint)" if n > 1 else ""
            return (f"{what}: port {port}{rank} on {addr} is not free ({e.strerror or e}): expected "
                    f"{'free ports' if n > 1 else 'a free port'}, or 0 for ports the OS picks")
    return None


def check(args: argparse.Namespace) -> str | None:
    """The first problem in ``rrfp train``'s flags found without torch, as one line, or None.
    Reads ``--config`` first; the checked namespace is kept for :func:`rrfp.train.cli.run`."""
    try:
        if getattr(args, "config", None) is not None:
            from .config import apply_config

            checked = apply_config(args)
        else:
            checked = args
        check_flags(checked)
    except UsageError as e:
        return str(e)
    args.early = checked
    return None


def check_flags(args: argparse.Namespace) -> None:
    """Check every flag that needs no torch; fills ``args.stages`` (:func:`resolve_stages`),
    ``args.trace_range`` and marks ``args.checked_early``.

    Raises:
        UsageError: one line naming the bad value and what was expected.
    """
    load_plugins(getattr(args, "plugin", None))  # first: the hints it registers are names below
    resolve_stages(args)
    for name in POSITIVE:
        v = getattr(args, name)
        if v < 1:
            raise UsageError(f"{flag(name)}={v}: expected a positive integer")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps={args.steps}: expected at most {MAX_STEPS}")
    _check_model(args)
    if args.microbatches > args.batch_size:
        raise UsageError(f"--microbatches={args.microbatches} exceeds --batch-size={args.batch_size}: "
                         "each microbatch needs at least one sample")
    _check_layout(args)
    _check_schedule(args)
    _check_numbers(args)
    _check_job_flags(args)
    _check_outputs(args)
    args.checked_early = True


def resolve_stages(args: argparse.Namespace) -> None:
    """``--pp``: inside a torchrun job, the world size over ``--dp x --tp`` (an explicit
    value must agree), else :data:`DEFAULT_STAGES`.

    Raises:
        UsageError: ``--pp`` x ``--dp`` x ``--tp`` that differs from the job's world size,
            or a world size that ``--dp x --tp`` does not divide.
    """
    if in_launched_worker():
        world = int(os.environ["WORLD_SIZE"])
        dp, tp = getattr(args, "dp", 1) or 1, getattr(args, "tp", 1) or 1
        if args.stages is not None and args.stages * dp * tp != world:
            layout = f" x --dp={dp} x --tp={tp}" if dp * tp > 1 else ""
            raise UsageError(
                f"--pp={args.stages}{layout} but this torchrun job has {world} processes (world size): "
                f"drop --pp or launch {args.stages * dp * tp} processes" + ("" if layout else " per pipeline")
            )
        if world % (dp * tp):
            raise UsageError(f"world size {world} is not a multiple of --dp={dp} x --tp={tp}")
        args.stages = world // (dp * tp)
    elif args.stages is None:
        args.stages = DEFAULT_STAGES


def _check_model(args: argparse.Namespace) -> None:
    """``--model`` names a model with a layer for every stage."""
    from ..model.spec import GPT_PRESETS, MULTIMODAL
    from .models import check_flags as check_model_flags, hf_layers, is_hf

    if args.model not in GPT_PRESETS and args.model != "multimodal" and not is_hf(args.model):
        raise UsageError(f"--model={args.model!r}: expected one of {', '.join(GPT_PRESETS)}, multimodal, "
                         "hf:<name> or hf:<folder>")
    if is_hf(args.model):
        n_layer = hf_layers(args)
    elif args.model == "multimodal":
        if args.data is not None:
            raise UsageError("--data with --model multimodal: the multimodal workload reads scikit-learn's digits, not text")
        n_layer = MULTIMODAL.n_units  # the encoder and each decoder block
    else:
        n_layer = GPT_PRESETS[args.model].n_layer
    n_stages = args.stages * args.virtual_stages
    if n_stages > n_layer:
        raise UsageError(f"--pp={args.stages} x --virtual-stages={args.virtual_stages} = {n_stages} stages exceeds "
                         f"the {n_layer} layers of model {args.model!r}: each stage needs at least one layer")
    check_model_flags(args)
    if args.model != "multimodal" and args.batch_size > SAMPLE_POOL:
        raise UsageError(f"--batch-size={args.batch_size}: expected at most {SAMPLE_POOL} (the samples a run loads)")


def _check_layout(args: argparse.Namespace) -> None:
    """--dp / --tp against the model and the batch."""
    from ..model.spec import GPT_PRESETS

    if args.model == "multimodal":
        if args.dp * args.tp > 1 or args.eval_every:
            raise UsageError("--model multimodal: expected --dp 1 --tp 1 and no --eval-every "
                             "(data and tensor parallelism and evaluation cover the GPT models)")
        return
    cfg = GPT_PRESETS.get(args.model)  # None: hf:<model>, whose --tp is checked with the model
    if args.tp > 1 and cfg is not None and (cfg.n_head % args.tp or cfg.ff_width % args.tp):
        raise UsageError(f"--tp={args.tp}: expected a divisor of the {cfg.n_head} attention heads of model {args.model!r}")
    _check_dp_shard(args)
    if args.microbatches * args.dp > args.batch_size:
        raise UsageError(f"--microbatches={args.microbatches} x --dp={args.dp} exceeds --batch-size={args.batch_size}: "
                         "each replica's microbatches need at least one sample")
    if args.trace is not None and args.dp * args.tp > 1:
        raise UsageError(f"--trace records one pipeline: expected --dp 1 --tp 1 with it (got --dp {args.dp} --tp {args.tp})")


def _check_dp_shard(args: argparse.Namespace) -> None:
    """--dp-shard against --dp, --precision and --deterministic (rrfp/parallel/sharded.py)."""
    shard = getattr(args, "dp_shard", "none")
    if shard == "optimizer":
        raise UsageError("--dp-shard optimizer: not available: under FSDP2 the replicated parameters would sit beside "
                         "their shards (more bytes than full) for the same one all-gather and reduce-scatter per step "
                         "that full makes; expected none or full")
    if shard == "full" and args.dp < 2:
        raise UsageError(f"--dp-shard full shards each stage over the DP replicas: expected --dp 2 or more (got --dp {args.dp})")
    if shard == "full" and args.deterministic and getattr(args, "precision", "fp32") == "bf16":
        raise UsageError("--dp-shard full --precision bf16 with --deterministic: FSDP2 accumulates bf16 gradients in "
                         "fp32 in its own order; expected fp32, or no --deterministic")


def _check_schedule(args: argparse.Namespace) -> None:
    """Memory budget, in-flight limit and hint (a strict hint is compiled here, under the
    limits the ranks will use)."""
    from ..scheduler.hints import resolve_hint
    from ..scheduler.memory import budget_bytes
    from ..scheduler.tasks import Placement

    if getattr(args, "memory_budget", None) is not None:
        try:
            budget_bytes(args.memory_budget)
        except ValueError as e:
            raise UsageError(f"--memory-budget={args.memory_budget!r}: {e}") from None
    if args.inflight_limit not in (None, "1f1b"):
        try:
            limit = int(args.inflight_limit)
        except ValueError:
            limit = 0
        if limit < 1:
            raise UsageError(f"--inflight-limit={args.inflight_limit!r}: expected a positive integer or '1f1b'")
    parser = getattr(args, "_parser", None)
    if (problem := hint_problem(args.hint, parser.get_default("hint") if parser is not None else AUTO)):
        raise UsageError(problem)
    hint = hint_text(args.hint)
    # The scheduler's own message names no flags; say which ones this command takes.
    if hint.removeprefix("strict-") == "zb-v" and (args.virtual_stages != 2 or (args.placement != "v" and args.stages > 1)):
        v = args.virtual_stages
        raise UsageError(f"--hint={args.hint!r} needs --virtual-stages 2 --placement v "
                         f"(got {v} virtual stage{'s' if v != 1 else ''}, {args.placement} placement)")
    limits = inflight_limits(args, args.stages) or [DEFAULT_INFLIGHT_LIMIT] * args.stages
    try:
        resolve_hint(hint if args.hint != AUTO else "bf", Placement(args.stages, args.virtual_stages, args.placement),
                     args.microbatches, inflight_limit=limits, backpressure=args.backpressure)
    except ValueError as e:
        raise UsageError(f"--hint={args.hint!r}: {e}") from None
    except OSError as e:  # a CSV hint's file: missing, a folder, unreadable (as rrfp simulate says it)
        raise UsageError(f"--hint={args.hint!r}: cannot read {e.filename or args.hint}: {e.strerror or e}") from None


def _check_numbers(args: argparse.Namespace) -> None:
    """Learning rate, watchdog, threads, lengths, launch-ahead, step-line and accumulation flags."""
    from .accum import check_flags as check_accum_flags
    from .stepline import check_flags as check_step_line_flags

    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr={args.lr}: expected a finite, positive learning rate")
    if not (math.isfinite(args.watchdog) and args.watchdog > 0):
        raise UsageError(f"--watchdog={args.watchdog}: expected a positive number of seconds")
    if args.threads > 4 * (os.cpu_count() or 1):
        raise UsageError(f"--threads={args.threads}: expected at most {4 * (os.cpu_count() or 1)} on this machine")
    if args.max_len > 65536:
        raise UsageError(f"--max-len={args.max_len}: expected at most 65536 tokens")
    if args.launch_ahead not in (1, 2):
        raise UsageError(f"--launch-ahead={args.launch_ahead}: expected 1 or 2")
    if args.executor == "cuda" and args.device == "cpu":
        raise UsageError("--executor cuda: needs --device cuda (this run computes on the cpu)")
    if (problem := check_step_line_flags(args)) is not None:
        raise UsageError(problem)
    check_accum_flags(args)


def parse_trace_steps(text: str | None, steps: int) -> tuple[int, int] | None:
    """``A:B`` -> ``(A, B)`` (1-based, inclusive; ``A:`` runs to the last step).

    Raises:
        UsageError: malformed text or a range outside ``1..steps``.
    """
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a else 1
        hi = int(b) if b else steps
        if not sep:
            hi = lo
    except ValueError:
        raise UsageError(f"--trace-steps={text!r}: expected A:B, two step numbers (e.g. 5:8)") from None
    if not 1 <= lo <= hi <= steps:
        raise UsageError(f"--trace-steps={text!r}: expected 1 <= A <= B <= --steps={steps}")
    return lo, hi


def _check_job_flags(args: argparse.Namespace) -> None:
    """Evaluation, learning-rate schedule, clipping and trace-range flags."""
    if args.eval_every < 0:
        raise UsageError(f"--eval-every={args.eval_every}: expected 0 (never) or a positive number of steps")
    if args.eval_batches < 1:
        raise UsageError(f"--eval-batches={args.eval_batches}: expected a positive integer")
    if not 0 <= args.warmup <= args.steps:
        raise UsageError(f"--warmup={args.warmup}: expected 0..{args.steps} (--steps)")
    if not (math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        raise UsageError(f"--min-lr={args.min_lr}: expected 0 <= min-lr <= --lr={args.lr}")
    if args.clip_grad is not None and not (math.isfinite(args.clip_grad) and args.clip_grad > 0):
        raise UsageError(f"--clip-grad={args.clip_grad}: expected a positive, finite norm")
    if args.trace_steps is not None and args.trace is None:
        raise UsageError(f"--trace-steps={args.trace_steps!r} needs --trace DIR")
    args.trace_range = parse_trace_steps(args.trace_steps, args.steps)


EMPTY_REFUSED = (("--checkpoint-dir", "a folder path"), ("--trace", "a folder path"),
                 ("--job-secret-file", "a file path"),
                 ("--port-range", "LO-HI, two ports 1..65535 with LO <= HI (e.g. 29500-29599)"))
"""Flags whose empty value is refused (``--log-file`` and the others checked by their own rule
say the same their way)."""


def _check_outputs(args: argparse.Namespace) -> None:
    """Files and folders the run writes or reads, and the metrics ports, before any rank starts."""
    from ..obs.server import check_flags as check_metrics_flags
    from .checkpoint import check_flags as check_checkpoint_flags
    from .guard import check_writable_dir

    # An empty value (an unset shell variable) would read as no flag below: a run without
    # what it was asked for.
    for name, expected in EMPTY_REFUSED:
        if getattr(args, name[2:].replace("-", "_"), None) == "":
            raise UsageError(f"{name}='': expected {expected}")
    for name in ("--log-file", "--loss-file"):  # rank 0 writes both
        path = getattr(args, name[2:].replace("-", "_"), None)
        if path is not None and (problem := output_file_problem(path)):
            raise UsageError(f"{name}={path!r}: {problem}")
    if args.trace is not None and (problem := check_writable_dir(args.trace, "--trace")) is not None:
        raise UsageError(problem)
    n_ranks = args.stages * args.dp * args.tp
    if (problem := check_metrics_flags(args, n_ports=n_ranks, allow_any_port=True)):
        raise UsageError(problem)
    if args.metrics_port and not in_launched_worker():
        # The ranks bind these only after torch loads and every process started; a port taken
        # now is found now. (A rank itself does not probe: its peers may have bound theirs.)
        if (problem := port_problem(args.metrics_addr, args.metrics_port, n_ranks, f"--metrics-port={args.metrics_port}")):
            raise UsageError(problem)
    if (problem := check_checkpoint_flags(args)):
        raise UsageError(problem)
    if getattr(args, "job_secret_file", None):
        try:
            read_secret_file(args.job_secret_file)
        except ValueError as e:
            raise UsageError(f"--job-secret-file: {e}") from None
    for path in args.data or []:
        if not path or not Path(path).exists():
            raise UsageError(f"--data: data path {path!r} does not exist")
        if not (Path(path).is_file() or Path(path).is_dir()):
            raise UsageError(f"--data: data path {path!r} is not a regular file or folder")
