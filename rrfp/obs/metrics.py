"""Prometheus metrics of one rank (prometheus-client), scraped by Prometheus from each daemon."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class RankMetrics:
    """Per-rank gauges and counters, served on ``port`` (``/metrics``).

    Metrics (label ``rank``): ``rrfp_steps_total``, ``rrfp_tasks_total``,
    ``rrfp_step_seconds`` (last step's wall time), ``rrfp_bubble_fraction`` (last step's idle
    share, 0..1), ``rrfp_peak_inflight`` (last step's peak in-flight count), ``rrfp_loss``
    (last step's loss, on the rank holding the last stage).
    """

    def __init__(self, rank: int, port: int | None = None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.rank = str(rank)
        r = self.registry
        self.steps = Counter("rrfp_steps", "optimizer steps finished", ["rank"], registry=r)
        self.tasks = Counter("rrfp_tasks", "compute tasks run", ["rank"], registry=r)
        self.step_seconds = Gauge("rrfp_step_seconds", "wall time of the last step (s)", ["rank"], registry=r)
        self.bubble = Gauge("rrfp_bubble_fraction", "idle share of the last step (0..1)", ["rank"], registry=r)
        self.peak = Gauge("rrfp_peak_inflight", "peak in-flight count of the last step", ["rank"], registry=r)
        self.loss = Gauge("rrfp_loss", "loss of the last step", ["rank"], registry=r)
        if port is not None:
            try:
                start_http_server(port, registry=self.registry)
            except OSError as e:
                raise OSError(f"rank {rank}: cannot serve metrics on port {port}: {e.strerror or e}") from None

    def observe(self, stats, loss: float | None) -> None:
        """Record one step's :class:`~rrfp.runtime.rank.StepStats`."""
        self.steps.labels(self.rank).inc()
        self.tasks.labels(self.rank).inc(stats.n_tasks)
        self.step_seconds.labels(self.rank).set(stats.wall)
        self.bubble.labels(self.rank).set(stats.bubble)
        self.peak.labels(self.rank).set(stats.peak_inflight)
        if loss is not None:
            self.loss.labels(self.rank).set(loss)
