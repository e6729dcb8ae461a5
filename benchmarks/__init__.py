"""rrfp's benchmarks: rrfp against PyTorch's own pipelining, and micro-benchmarks of the runtime.

One entry point regenerates ``BENCHMARKS.md``::

    python benchmarks/run_all.py --out BENCHMARKS.md        # or: rrfp bench --all --out BENCHMARKS.md
    python benchmarks/run_all.py --quick                      # CI smoke run, well under a minute

Modules:

- :mod:`benchmarks.harness`: the pieces every system shares: the jitter wrapper around a stage
  module (seeded delays in forward and backward), the activation-memory meter, per-rank
  compute timers, statistics, and the multi-process launcher (timeouts, no strays).
- :mod:`benchmarks.compare`: one set of rank processes runs rrfp (``bf``, ``bfw``,
  ``strict-1f1b``, ``bf`` at 1F1B's in-flight limits) and PyTorch's ``ScheduleGPipe``,
  ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` side by side,
  alternating per round, checking that every system's gradients are equal.
- :mod:`benchmarks.micro`: arbiter decision time, runtime overhead per task, transport latency
  and throughput.
- :mod:`benchmarks.report`: the machine description and the Markdown tables.
"""
