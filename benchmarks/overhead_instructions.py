"""Runtime overhead per task in instructions, which the machine's load does not change.

:func:`benchmarks.micro.local_overhead`'s pipeline (``LocalPipeline``, 4 ranks x 64
microbatches of do-nothing stages, ``bf``, messages through the codec, inline executor) and its
hand-run reference (:func:`benchmarks.micro.sequential_runner`, the same tasks with no runtime),
each run under valgrind's callgrind twice, with ``lo`` and ``hi`` timed steps after 3 warm-up
steps: instructions per task = (count at ``hi`` - count at ``lo``) / ((hi - lo) x 512 tasks), so
imports, construction and warm-up cancel. The pipeline's count is taken inside the event loop's
``run_until_complete`` only (callgrind's ``--toggle-collect``), which leaves out the import's
noise; the reference has no loop and is counted whole.

Usage (valgrind on the PATH; 4 runs under callgrind side by side, about 3 minutes of CPU each)::

    python -m benchmarks.overhead_instructions            # prints K instructions/task and the ratio
    python -m benchmarks.overhead_instructions --lo 2 --hi 6
    python -m benchmarks.overhead_instructions --loop asyncio   # the pipeline on asyncio's own loop
    python -m benchmarks.overhead_instructions --bytecodes 30   # no valgrind: where the bytecodes go

``--bytecodes N`` is the profile to read first (seconds, no valgrind, and as load-independent):
the Python bytecodes and calls per task of the pipeline's 2 steps after the warm-up, counted
with ``sys.settrace``'s opcode events, and the ``N`` functions that execute the most.

``--loop asyncio`` runs the pipeline on asyncio's event loop instead of uvloop's (the runtime's
choice where uvloop is installed, :func:`rrfp.runtime.doors.front.new_event_loop`); its loop is
Python, with no C function to toggle on, so that run is counted whole, as the reference is (the
difference of the two runs cancels the rest).

Figures (issue 33, the per-task cost; 2026-12-05, ``lo`` 1, ``hi`` 3): see the module's
docstring in :mod:`benchmarks.micro` (``local_overhead``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

M, P, WARMUP = 64, 4, 3
TOGGLE = "__pyx_pw_6uvloop_4loop_4Loop_45run_until_complete"  # uvloop's Loop.run_until_complete


def child(what: str, steps: int, loop: str = "uvloop") -> None:
    """Warm up, then run ``steps`` timed steps of ``what`` (``pipe`` or ``ref``); the pipeline
    on ``loop`` (``uvloop`` or ``asyncio``)."""
    import logging

    import torch

    from benchmarks.micro import Scale, scalar_loss, sequential_runner

    torch.manual_seed(0)
    if what == "ref":
        ref, _, _ = sequential_runner(P, M)
        for _ in range(WARMUP + steps):
            ref()
        return
    from rrfp.runtime.doors import local
    from rrfp.runtime.doors.local import LocalPipeline

    if loop == "asyncio":
        import asyncio

        local.new_event_loop = asyncio.new_event_loop
    logging.getLogger("rrfp").setLevel(logging.CRITICAL)  # closing logs each rank's peers as lost
    x, y = torch.ones(M, 1), torch.ones(M, 1)
    with LocalPipeline([Scale() for _ in range(P)], M, scalar_loss, hint="bf", encode=True, watchdog=60) as pipe:
        for _ in range(WARMUP + steps):
            pipe.step(x, target=y)


def bytecodes(top: int, steps: int = 2) -> None:
    """Print the bytecodes and Python calls per task of ``steps`` pipeline steps after the
    warm-up, and the ``top`` functions by bytecodes per task (``file:line name``)."""
    import collections
    import logging

    import torch

    from benchmarks.micro import Scale, scalar_loss
    from rrfp.runtime.doors.local import LocalPipeline

    ops: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def where(frame) -> tuple:
        co = frame.f_code
        return co.co_filename.rsplit("/", 1)[-1], co.co_firstlineno, co.co_name

    def trace(frame, event, arg):
        if event == "opcode":
            ops[where(frame)] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[where(frame)] += 1
        return trace

    torch.manual_seed(0)
    logging.getLogger("rrfp").setLevel(logging.CRITICAL)
    x, y = torch.ones(M, 1), torch.ones(M, 1)
    with LocalPipeline([Scale() for _ in range(P)], M, scalar_loss, hint="bf", encode=True, watchdog=60) as pipe:
        for _ in range(WARMUP):
            pipe.step(x, target=y)
        sys.settrace(trace)
        try:
            for _ in range(steps):
                pipe.step(x, target=y)
        finally:
            sys.settrace(None)
    n = steps * 2 * P * M
    print(f"pipeline: {sum(ops.values()) / n:.1f} bytecodes and {sum(calls.values()) / n:.1f} Python calls per task")
    for k, v in ops.most_common(top):
        print(f"{v / n:8.2f} bytecodes {calls[k] / n:5.2f} calls  {k[0]}:{k[1]} {k[2]}")


def count(what: str, steps: int, loop: str = "uvloop") -> int:
    """Instructions callgrind counted for one child run."""
    toggle = ["--collect-atstart=no", f"--toggle-collect={TOGGLE}"] if what == "pipe" and loop == "uvloop" else []
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *toggle, sys.executable,
                          "-m", "benchmarks.overhead_instructions", "--child", what, str(steps), "--loop", loop],
                         capture_output=True, text=True, check=True)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise RuntimeError(f"no instruction count from callgrind for {what} {steps}: {out.stderr[-500:]}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lo", type=int, default=1, help="timed steps of the shorter run (default 1)")
    ap.add_argument("--hi", type=int, default=3, help="timed steps of the longer run (default 3)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the pipeline's event loop (default uvloop, the runtime's)")
    ap.add_argument("--bytecodes", type=int, metavar="N",
                    help="no callgrind: print bytecodes per task and the N functions that execute the most")
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]), a.loop)
        return 0
    if a.bytecodes is not None:
        if a.bytecodes < 0:
            print(f"--bytecodes {a.bytecodes}: expected a count of functions to list (>= 0)", file=sys.stderr)
            return 2
        bytecodes(a.bytecodes)
        return 0
    if not 0 <= a.lo < a.hi:
        print(f"--lo {a.lo} --hi {a.hi}: expected 0 <= lo < hi", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    tasks = (a.hi - a.lo) * 2 * P * M
    runs = [(w, n) for w in ("pipe", "ref") for n in (a.lo, a.hi)]
    with ThreadPoolExecutor(len(runs)) as pool:  # callgrind runs one thread: the 4 runs side by side
        got = dict(zip(runs, pool.map(lambda r: count(*r, a.loop), runs)))
    per = {w: (got[(w, a.hi)] - got[(w, a.lo)]) / tasks for w in ("pipe", "ref")}
    print(f"pipeline ({a.loop}) {per['pipe'] / 1e3:.1f} K instructions/task, by hand {per['ref'] / 1e3:.1f} K, "
          f"ratio {per['pipe'] / per['ref']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
