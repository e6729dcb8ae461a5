"""rrfp's benchmarks: rrfp against PyTorch's own pipelining, and micro-benchmarks of the runtime.

One entry point regenerates ``BENCHMARKS.md``::

    python benchmarks/run_all.py --out BENCHMARKS.md        # or: rrfp bench --all --out BENCHMARKS.md
    python benchmarks/run_all.py --quick                      # CI smoke run, a few minutes

Modules:

- :mod:`benchmarks.harness`: the pieces every system shares: the jitter wrapper around a stage
  module (seeded delays in forward and backward), the activation-memory meter, per-rank
  compute timers and statistics.
- :mod:`benchmarks.launcher`: the rank processes (forked from one starter that imported torch
  once; timeouts, no strays).
- :mod:`benchmarks.compare`: one set of rank processes runs rrfp's rows and PyTorch's
  ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` side by
  side, alternating per round, checking that every system's gradients are equal.
- :mod:`benchmarks.systems`, :mod:`benchmarks.settings`: the rows (rrfp hints at a memory
  budget, PyTorch's classes, the zero-bubble schedules at their own memory) and the settings.
- :mod:`benchmarks.sim_pred`, :mod:`benchmarks.report_peers`: the simulator's prediction of a
  row with the run's own injected delays; the zero-bubble and many-rank sections and targets.
- :mod:`benchmarks.micro`: arbiter decision time, runtime overhead per task, transport latency
  and throughput.
- :mod:`benchmarks.report`: the machine description and the Markdown tables.
"""
