"""Prometheus metrics of the ranks and of the per-node daemon (prometheus-client).

Everything that accumulates is a counter in base units (seconds, bytes, messages, tokens), so
Prometheus computes any window's rate or ratio itself; gauges hold only instantaneous state.
A rank's idle share over a window is ``rate(rrfp_idle_seconds_total) / (rate(busy) +
rate(idle))``: there is no ``_fraction`` metric to mis-average. ``docs/operations.md`` lists the
metrics and the dashboard's queries.

Two ways to serve them:

* standalone (``rrfp train --metrics-port P``): each rank serves its own registry on port
  ``P + rank`` (:mod:`rrfp.obs.server`); a scrape sees whole steps only (the step's updates
  and the scrape take one lock);
* multiprocess (``PROMETHEUS_MULTIPROC_DIR`` set in the ranks' environment by ``rrfp node``):
  each rank writes its values to memory-mapped files in that folder, and the daemon serves
  them all from one endpoint (:func:`node_registry`). Gauges are merged over the processes
  of a rank (a restarted rank has a new pid) as :data:`GAUGE_MODES` says.

Memory (every rank, after each optimizer step; ``rrfp/train/memory.py``, ``rrfp/obs/memory.py``),
all in bytes, for dashboards and alerts:

* ``rrfp_memory_bytes{rank, kind}``: what the rank holds, by ``kind``: ``params``, ``grads``,
  ``optimizer`` (the optimizer's states), ``activations`` (the most held at once in the step)
  and ``gathered`` (FSDP2's unsharded parameters and gradients held within the step; 0 with
  replicated DP);
* ``rrfp_memory_peak_bytes{rank, what}``: the process's peak of its last step, ``what``:
  ``rss`` (peak resident set: ``VmHWM``, reset each step), ``cuda_allocated``,
  ``cuda_reserved`` (GPU ranks only);
* ``rrfp_memory_limit_bytes{rank}``: the limit the headroom is taken against (the GPU's
  memory, the cgroup's ``memory.max``, or the host's ``MemTotal``);
* ``rrfp_memory_headroom_bytes{rank}``: bytes left under that limit at the last step's peak
  (negative: past it). Alert when it stays small, e.g.
  ``min by (rank) (rrfp_memory_headroom_bytes) < 2 * 2^30`` (``docs/operations.md``).
"""

from __future__ import annotations

import asyncio
import glob
import os
import threading
import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from ..scheduler.tasks import KINDS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TASK_KINDS = tuple(KINDS)
DIRECTIONS = ("sent", "received")
REJECT_REASONS = ("decode", "routing")
"""``decode``: refused by the transport before delivery (malformed, oversized, unknown
sender); ``routing``: delivered but not for this rank's job, step or stages, a duplicate,
or past a backlog bound (the runtime's check)."""

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "gathered")
"""``kind`` label values of ``rrfp_memory_bytes`` (``rrfp.train.memory.KINDS`` is this tuple)."""
MEMORY_PEAKS = ("rss", "cuda_allocated", "cuda_reserved")
"""``what`` label values of ``rrfp_memory_peak_bytes``."""

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
"""Step-duration histogram buckets (seconds): a tiny CPU model's 10 ms steps to 5-minute steps."""

GAUGE_MODES = {
    "rrfp_loss": "mostrecent",
    "rrfp_peak_inflight_microbatches": "mostrecent",
    "rrfp_last_heartbeat_timestamp_seconds": "max",
    "rrfp_learning_rate": "mostrecent",
    "rrfp_grad_norm": "mostrecent",
    "rrfp_model_tflops": "mostrecent",
    "rrfp_mfu": "mostrecent",
    "rrfp_memory_bytes": "mostrecent",
    "rrfp_memory_peak_bytes": "mostrecent",
    "rrfp_memory_limit_bytes": "mostrecent",
    "rrfp_memory_headroom_bytes": "mostrecent",
}
"""Multiprocess merge of each gauge over the processes that wrote it under the same labels
(every rank writes its own ``rank`` label, so several processes share labels only when a rank
was restarted): loss and in-flight take the most recent write (the live process's); the
heartbeat takes the newest, so a dead rank's heartbeat ages until its replacement beats.
None is a ``live*`` mode: the files of finished ranks keep being served (the daemon's
``--metrics-linger``)."""

HEARTBEAT_INTERVAL = 1.0
"""Seconds between a rank's event-loop heartbeats."""

METRIC_NAMES = (
    "rrfp_busy_seconds_total",
    "rrfp_idle_seconds_total",
    "rrfp_steps_total",
    "rrfp_tasks_total",
    "rrfp_messages_total",
    "rrfp_message_bytes_total",
    "rrfp_rejected_messages_total",
    "rrfp_tokens_total",
    "rrfp_step_duration_seconds",
    "rrfp_peak_inflight_microbatches",
    "rrfp_loss",
    "rrfp_last_heartbeat_timestamp_seconds",
    "rrfp_restarts_total",
    "rrfp_learning_rate",
    "rrfp_grad_norm",
    "rrfp_model_tflops",
    "rrfp_mfu",
    "rrfp_memory_bytes",
    "rrfp_memory_peak_bytes",
    "rrfp_memory_limit_bytes",
    "rrfp_memory_headroom_bytes",
)
"""Every metric family this module defines, as exposed (counters with ``_total``; the
histogram also exposes ``_bucket``, ``_sum`` and ``_count``)."""


def multiprocess_dir() -> str | None:
    """The multiprocess folder from the environment, or None (standalone mode)."""
    return os.environ.get(MULTIPROC_ENV) or None


def _multiprocess_values() -> bool:
    # prometheus_client picks its value store when it is imported, from the environment then.
    from prometheus_client import values

    return values.ValueClass is not values.MutexValue


class RankMetrics:
    """The metrics of one pipeline rank, fed once per step.

    Args:
        rank: the pipeline rank (label ``rank``).
        stages: the stage indices this rank holds (its virtual stages), for the ``stage``
            label. ``rrfp_busy_seconds_total`` is split by the stage whose task ran;
            ``rrfp_idle_seconds_total`` belongs to the rank and is labelled with all of its
            stages joined by commas (``"1"``, or ``"1,5"`` with virtual stages).
        registry: where to register in standalone mode (default: a fresh one, :attr:`registry`).
            Ignored in multiprocess mode, where values go to the files the daemon serves.

    Attributes:
        registry: the registry to serve (None in multiprocess mode).
        lock: held while a step is recorded; a server holding it while it renders a scrape
            serves whole steps only.
    """

    def __init__(self, rank: int, stages: Iterable[int], registry: CollectorRegistry | None = None) -> None:
        self.rank = str(rank)
        self.stages = [str(s) for s in stages]
        if not self.stages:
            raise ValueError(f"rank {rank}: expected at least one stage")
        # ``*_created`` series (a counter's creation time) double every series for nothing
        # Prometheus' rate() uses; a process-wide switch in prometheus_client.
        disable_created_metrics()
        self.multiprocess = _multiprocess_values()
        r = None if self.multiprocess else (registry or CollectorRegistry())
        self.registry = r
        self.lock = threading.Lock()
        self._idle_stage = ",".join(self.stages)

        def gauge(name: str, doc: str, labels: list[str]) -> Gauge:  # its multiprocess mode by its name
            return Gauge(name, doc, labels, registry=r, multiprocess_mode=GAUGE_MODES[name])

        self.busy = Counter("rrfp_busy_seconds", "seconds the rank spent running tasks, by the task's stage",
                            ["rank", "stage"], registry=r)
        self.idle = Counter("rrfp_idle_seconds", "seconds of the rank's steps not spent running tasks (its bubble); "
                            "stage lists the rank's stages", ["rank", "stage"], registry=r)
        self.steps = Counter("rrfp_steps", "optimizer steps finished", ["rank"], registry=r)
        self.tasks = Counter("rrfp_tasks", "compute tasks run, by kind (F forward, B backward, I input-gradient, "
                             "W weight-gradient)", ["rank", "kind"], registry=r)
        self.messages = Counter("rrfp_messages", "transport messages, by direction", ["rank", "direction"], registry=r)
        self.bytes = Counter("rrfp_message_bytes", "transport wire bytes (headers included), by direction",
                             ["rank", "direction"], registry=r)
        self.rejected = Counter("rrfp_rejected_messages", "incoming messages refused, by reason (decode: by the "
                                "transport; routing: by the runtime)", ["rank", "reason"], registry=r)
        self.tokens = Counter("rrfp_tokens", "training tokens entering the pipeline (counted on the rank "
                              "holding stage 0)", ["rank"], registry=r)
        self.step_seconds = Histogram("rrfp_step_duration_seconds", "wall time of one training step on the rank "
                                      "(data, pipeline and optimizer)", ["rank"], buckets=STEP_BUCKETS, registry=r)
        self.inflight = gauge("rrfp_peak_inflight_microbatches", "most microbatches in flight at once on the rank "
                              "during its last step", ["rank"])
        self.loss = gauge("rrfp_loss", "loss of the last step (on the rank holding the last stage)", ["rank"])
        self.heartbeat = gauge("rrfp_last_heartbeat_timestamp_seconds", "unix time of the rank's last event-loop "
                               "heartbeat", ["rank"])
        # The step line's rates (rrfp/train/stepline.py, flops.py).
        self.lr = gauge("rrfp_learning_rate", "learning rate of the rank's last optimizer step", ["rank"])
        self.grad_norm = gauge("rrfp_grad_norm", "global gradient norm of the last step printed (set on rank 0)",
                               ["rank"])
        self.tflops = gauge("rrfp_model_tflops", "model TFLOP/s of the rank's last step (6N + 12LdT per position, "
                            "rrfp/train/flops.py)", ["rank"])
        self.mfu = gauge("rrfp_mfu", "model FLOPs utilisation of the rank's last step (0..1, against --peak-tflops "
                         "or the GPU's table entry; absent without a peak)", ["rank"])
        self.memory = gauge("rrfp_memory_bytes", "bytes the rank held at its last step, by kind: params, grads, "
                            "optimizer (states), activations (most held at once), gathered (FSDP2's unsharded "
                            "parameters and gradients within the step)", ["rank", "kind"])
        self.memory_peak = gauge("rrfp_memory_peak_bytes", "the rank process's peak bytes in its last step: rss "
                                 "(VmHWM reset per step), cuda_allocated, cuda_reserved", ["rank", "what"])
        self.memory_limit = gauge("rrfp_memory_limit_bytes", "the memory limit the headroom is taken against (GPU "
                                  "memory, cgroup memory.max, or host MemTotal)", ["rank"])
        self.memory_headroom = gauge("rrfp_memory_headroom_bytes", "bytes left under the limit at the rank's last "
                                     "step's peak (negative: past it)", ["rank"])
        # Every series exists from the start at 0, so a scrape before the first step is a
        # baseline and rate() sees the first increments.
        for s in self.stages:
            self.busy.labels(self.rank, s)
        self.idle.labels(self.rank, self._idle_stage)
        self.steps.labels(self.rank)
        for k in TASK_KINDS:
            self.tasks.labels(self.rank, k)
        for d in DIRECTIONS:
            self.messages.labels(self.rank, d)
            self.bytes.labels(self.rank, d)
        for why in REJECT_REASONS:
            self.rejected.labels(self.rank, why)
        self.tokens.labels(self.rank)
        self.step_seconds.labels(self.rank)
        self._seen: dict[str, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.beat()

    def observe(
        self,
        stats,
        *,
        loss: float | None = None,
        tokens: int = 0,
        seconds: float | None = None,
        transport: Mapping[str, int] | None = None,
        runtime_rejected: int = 0,
    ) -> None:
        """Record one finished step.

        Args:
            stats: the rank's :class:`~rrfp.runtime.engine.rank.StepStats` (``busy``, ``wall`` in
                seconds, ``peak_mb_inflight``, ``n_tasks``). With ``stats.records`` (the
                runtime's per-task records), busy seconds and tasks are split by stage and
                kind; without them, busy goes to the rank's first stage and tasks are not
                counted by kind.
            loss: the step's loss (the last stage's rank), else None.
            tokens: tokens this rank fed into the pipeline this step.
            seconds: the step's whole wall time in the training loop (default ``stats.wall``).
            transport: the transport's running totals (``Transport.stats``: messages_sent,
                bytes_sent, messages_received, bytes_received, rejected); counters advance by
                the change since the last call.
            runtime_rejected: the runtime's running total of refused messages.
        """
        with self.lock:
            records = getattr(stats, "records", None) or []
            if records:
                by_stage: dict[int, float] = {}
                by_kind: dict[str, int] = {}
                for rec in records:
                    task = rec.task
                    by_stage[task.stage] = by_stage.get(task.stage, 0.0) + (rec.end - rec.start)
                    by_kind[task.kind] = by_kind.get(task.kind, 0) + 1
                for s, secs in by_stage.items():
                    self.busy.labels(self.rank, str(s)).inc(secs)
                for kind, n in by_kind.items():
                    self.tasks.labels(self.rank, kind).inc(n)
            else:
                self.busy.labels(self.rank, self.stages[0]).inc(stats.busy)
            self.idle.labels(self.rank, self._idle_stage).inc(max(0.0, stats.wall - stats.busy))
            self.steps.labels(self.rank).inc()
            if tokens:
                self.tokens.labels(self.rank).inc(tokens)
            self.step_seconds.labels(self.rank).observe(stats.wall if seconds is None else seconds)
            self.inflight.labels(self.rank).set(stats.peak_mb_inflight)
            if loss is not None:
                self.loss.labels(self.rank).set(loss)
            totals = dict(transport or {})
            self._advance(self.messages.labels(self.rank, "sent"), "messages_sent", totals)
            self._advance(self.messages.labels(self.rank, "received"), "messages_received", totals)
            self._advance(self.bytes.labels(self.rank, "sent"), "bytes_sent", totals)
            self._advance(self.bytes.labels(self.rank, "received"), "bytes_received", totals)
            self._advance(self.rejected.labels(self.rank, "decode"), "rejected", totals)
            self._advance(self.rejected.labels(self.rank, "routing"), "runtime_rejected",
                          {"runtime_rejected": runtime_rejected})
            self.heartbeat.labels(self.rank).set(time.time())

    def observe_rates(self, *, lr: float | None = None, tflops: float | None = None, mfu: float | None = None) -> None:
        """Record the rank's learning rate, model TFLOP/s and MFU of its last step (None: unset)."""
        with self.lock:
            for gauge, value in ((self.lr, lr), (self.tflops, tflops), (self.mfu, mfu)):
                if value is not None:
                    gauge.labels(self.rank).set(value)

    def observe_memory(self, mem: Mapping[str, int | None]) -> None:
        """Record the rank's memory of its last step (:meth:`rrfp.train.memory.RankMemory.fields`:
        bytes by kind, the process's peaks, ``limit``, ``headroom``); a value that is None
        (not measured on this device) leaves its series unset."""
        with self.lock:
            for kind in MEMORY_KINDS:
                if mem.get(kind) is not None:
                    self.memory.labels(self.rank, kind).set(mem[kind])
            for what in MEMORY_PEAKS:
                if mem.get(what) is not None:
                    self.memory_peak.labels(self.rank, what).set(mem[what])
            if mem.get("limit") is not None:
                self.memory_limit.labels(self.rank).set(mem["limit"])
            if mem.get("headroom") is not None:
                self.memory_headroom.labels(self.rank).set(mem["headroom"])

    def observe_global(self, *, grad_norm: float) -> None:
        """Record a value of the whole job that rank 0 assembles (the global gradient norm)."""
        with self.lock:
            self.grad_norm.labels(self.rank).set(grad_norm)

    def _advance(self, child, key: str, totals: Mapping[str, int]) -> None:
        if key not in totals:
            return
        now = int(totals[key])
        delta = now - self._seen.get(key, 0)
        self._seen[key] = now
        if delta > 0:
            child.inc(delta)

    # ------------------------------------------------------------ heartbeat
    def beat(self) -> None:
        """Set the heartbeat gauge to now (unix seconds)."""
        self.heartbeat.labels(self.rank).set(time.time())

    async def start_heartbeat(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        """Beat every ``interval`` seconds from the running event loop (the rank's), for as
        long as that loop runs: a rank stuck outside its loop (a hung kernel, a deadlocked
        callback) stops beating, which ``/healthz`` reports and the RrfpRankSilent alert watches (liveness
        itself reads a thread's beat, rrfp/train/alive.py). Returns at once."""
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.beat()
            self._timer = loop.call_later(interval, tick)

        self.stop_heartbeat()
        tick()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat started by :meth:`start_heartbeat` (before its loop closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class NodeMetrics:
    """The daemon's own metrics: ``rrfp_restarts_total{node}`` (times the daemon restarted
    its group of ranks).

    Args:
        node: the node rank (label ``node``).
        registry: the registry the daemon serves (:func:`node_registry`); ignored when the
            daemon itself runs in multiprocess mode (its values then go to the folder's files,
            which that registry's collector reads).
    """

    def __init__(self, node: int, registry: CollectorRegistry | None) -> None:
        r = None if _multiprocess_values() else registry
        self.node = str(node)
        self.restarts = Counter("rrfp_restarts", "restarts of the node's group of ranks", ["node"], registry=r)
        self.restarts.labels(self.node)


def node_registry(path: str | os.PathLike) -> CollectorRegistry:
    """The registry a daemon serves for all its ranks: a
    :class:`~prometheus_client.multiprocess.MultiProcessCollector` over ``path``, the
    ``PROMETHEUS_MULTIPROC_DIR`` it sets in its ranks' environment (:func:`clear_multiprocess_dir`
    it before the first start, so a previous job's values are not served).

    Raises:
        ValueError: ``path`` is not a folder.
    """
    from prometheus_client.multiprocess import MultiProcessCollector

    if not os.path.isdir(path):
        raise ValueError(f"metrics folder {os.fspath(path)!r} is not a folder: expected the ranks' {MULTIPROC_ENV}")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.fspath(path))
    return registry


def clear_multiprocess_dir(path: str | os.PathLike) -> None:
    """Create ``path`` if needed and remove the value files of earlier processes from it."""
    os.makedirs(path, exist_ok=True)
    for f in glob.glob(os.path.join(os.fspath(path), "*.db")):
        os.remove(f)


def last_heartbeats(path: str | os.PathLike) -> dict[int, float]:
    """Each rank's last event-loop heartbeat (unix seconds) from the multiprocess folder
    ``path``, merged as :data:`GAUGE_MODES` says (the newest of a rank's processes). Ranks that
    have not started yet are absent. For ``/healthz``: age = ``time.time() - value``."""
    from prometheus_client.multiprocess import MultiProcessCollector

    files = glob.glob(os.path.join(os.fspath(path), "gauge_max_*.db"))
    beats: dict[int, float] = {}
    for family in MultiProcessCollector.merge(files, accumulate=False):
        if family.name != "rrfp_last_heartbeat_timestamp_seconds":
            continue
        for sample in family.samples:
            rank = int(sample.labels["rank"])
            beats[rank] = max(beats.get(rank, 0.0), sample.value)
    return beats
