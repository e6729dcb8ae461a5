"""Cost of the per-rank Prometheus metrics: recording one step and rendering one scrape.

    python benchmarks/bench_metrics.py [--microbatches 8] [--repeat 20000]

Prints microseconds per recorded step (a rank with one stage running F and B for every
microbatch, i.e. 2 x microbatches task records) and per rendered scrape. Compare the first
with the step time `rrfp train` prints to get the share of a step spent on metrics.
"""

from __future__ import annotations

import argparse
import timeit
from types import SimpleNamespace

from prometheus_client import generate_latest

from rrfp.obs.metrics import RankMetrics
from rrfp.scheduler.tasks import parse_action


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20000)
    a = p.parse_args()
    m = RankMetrics(1, [1])
    recs = [SimpleNamespace(task=parse_action(f"1{k}{i}"), start=0.0, end=0.001)
            for i in range(a.microbatches) for k in "FB"]
    st = SimpleNamespace(busy=0.016, wall=0.02, peak_mb_inflight=4, records=recs)
    totals = {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0, "bytes_received": 0, "rejected": 0}

    def step() -> None:
        for k in totals:
            totals[k] += 1
        m.observe(st, loss=1.0, tokens=100, seconds=0.02, transport=totals, runtime_rejected=0)

    t_step = timeit.timeit(step, number=a.repeat) / a.repeat
    n_scrape = max(1, a.repeat // 20)
    t_scrape = timeit.timeit(lambda: generate_latest(m.registry), number=n_scrape) / n_scrape
    print(f"record one step ({len(recs)} task records): {t_step * 1e6:.1f} us; render one scrape: {t_scrape * 1e6:.1f} us")


if __name__ == "__main__":
    main()
