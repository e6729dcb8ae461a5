"""Micro-benchmarks of the runtime itself.

- :func:`arbiter_decisions`: the arbiter's cost per decision (``next()`` + ``complete()``, plus
  the ``mark_input`` that refills the ready set) against the ready set's size, for the policy
  hints and a total-order hint, in-process.
- Runtime overhead per task: a pipeline whose stage modules do nothing (``x * w`` on a
  one-element tensor, ``w`` a one-element parameter so there is a backward), wall time per task:
  :func:`local_overhead` in one process (``LocalPipeline``, every rank on one event loop), and
  across 2 processes (``rank_main``, rrfp over ZeroMQ and PyTorch's schedules over gloo).
- Transports: one-way latency (half a ping-pong round trip) and streaming throughput from
  1 KiB to 16 MiB: rrfp's ZeroMQ (tcp) and fake in-process transports, and gloo
  ``isend``/``irecv`` for reference.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rrfp.scheduler.arbiter import Arbiter
from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.tasks import F, I, Placement

READY_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ARBITER_HINTS = ("bf", "bfw", "fb", "b-priority", "f-priority", "1f1b")
SIZES = tuple(1024 * 4**i for i in range(8))  # 1 KiB .. 16 MiB


# --------------------------------------------------------------------------- arbiter


def arbiter_cycle_us(hint_name: str, n_ready: int, cycles: int = 3000, repeats: int = 5) -> dict[str, float]:
    """CPU microseconds per decision with a ready set of ``n_ready`` tasks (thread CPU time, so
    that other work on the machine does not count).

    The arbiter is rank 1 of a 2-rank pipeline (the last stage): activations are marked to
    arrive until ``n_ready`` tasks are ready; then each cycle dispatches the best-ranked ready
    task (``next()``), completes it (``complete()``) and marks new activations until the ready
    set holds ``n_ready`` tasks again (one ``mark_input`` per dispatched forward, in steady
    state). The in-flight limit is set out of reach so it never gates.
    """
    M = n_ready + cycles + 8
    spec, hint, _ = resolve_hint(hint_name, Placement(2), M)
    samples = []
    for _ in range(repeats):
        arb = Arbiter(spec, 1, hint, inflight_limit=1 << 30)
        nxt = 0
        ready = 0
        while ready < n_ready:
            arb.mark_input(1, nxt, False)
            nxt += 1
            ready += 1
        t0 = time.thread_time_ns()
        for _ in range(cycles):
            t = arb.next()
            arb.complete(t)
            k = t.kind
            if k == F:
                pass  # its backward became ready: the ready set keeps its size
            elif k == I:
                pass  # its W became ready
            else:
                ready -= 1  # a B or W finished: nothing new became ready
                while ready < n_ready and nxt < M:
                    arb.mark_input(1, nxt, False)
                    nxt += 1
                    ready += 1
        samples.append((time.thread_time_ns() - t0) / cycles / 1000)
    return {"median": statistics.median(samples), "min": min(samples)}


def arbiter_decisions(sizes: Sequence[int] = READY_SIZES, hints: Sequence[str] = ARBITER_HINTS,
                      cycles: int = 3000, repeats: int = 5) -> dict[str, dict[int, dict[str, float]]]:
    return {h: {n: arbiter_cycle_us(h, n, cycles, repeats) for n in sizes} for h in hints}


# --------------------------------------------------------------------------- runtime overhead


class Scale(nn.Module):
    """A stage that does (almost) nothing: ``x * w`` with a one-element parameter ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def scalar_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * target).sum()


def sequential_runner(n_stages: int, n_microbatches: int,
                      device: torch.device | str | None = None) -> tuple[Callable[[], None], int, list[nn.Module]]:
    """The tasks of a ``n_stages``-stage pipeline of :class:`Scale` stages with no runtime: a
    function that runs them by hand, one microbatch after another, each stage's forward on a
    detached copy of the previous stage's output and each stage's backward its own engine call
    (as in every pipeline runtime, rrfp's and PyTorch's), the loss weighted by ``1/M``; the
    number of tasks it runs (``2 * n_stages * n_microbatches``); and the stage modules (their
    ``.grad`` accumulates over calls).

    This is the reference that runtime overhead is measured against: what a pipeline's tasks
    cost when nothing arbitrates, buffers or moves messages. ``device``: where it computes
    (default CPU; on CUDA the kernels are queued, as a pipeline's are)."""
    from rrfp.runtime.engine.rank import run_backward
    from rrfp.runtime.engine.stage import detach_for_next

    stages = [Scale().to(device or "cpu") for _ in range(n_stages)]
    x = torch.ones(n_microbatches, 1, device=device)
    y = torch.ones(n_microbatches, 1, device=device)
    w = 1.0 / n_microbatches

    def once() -> None:
        for m in range(n_microbatches):
            ins, outs = [], []
            h = x[m:m + 1]
            for st in stages:
                ins.append(h)
                out = st(h)
                outs.append(out)
                h = detach_for_next(out)
            loss = scalar_loss(outs[-1], y[m:m + 1])
            g = None
            for k in range(n_stages - 1, -1, -1):
                if k == n_stages - 1:
                    run_backward([loss], [torch.full_like(loss, w)])
                else:
                    run_backward([outs[k]], [g])
                g = ins[k].grad

    once()  # warm up
    return once, 2 * n_stages * n_microbatches, stages


def local_overhead(n_ranks: int = 4, n_microbatches: int = 64, hints: Sequence[str] = ("bf", "strict-1f1b"),
                   steps: int = 7, executors: Sequence[str] = ("inline",), device: str | None = None,
                   encodes: Sequence[bool] = (True, False), launch_ahead: int = 1) -> dict[str, dict[str, float]]:
    """Microseconds per task of an in-process ``LocalPipeline`` (every rank on one event loop,
    one thread) on do-nothing stages, with messages through the codec (as between processes)
    and without (the runtime alone): wall time (median and fastest step) and the thread's CPU
    time (fastest step; the run never waits, so on an idle machine the two agree).

    After every pipeline step the same tasks run by hand (:func:`sequential_runner`), so the
    reference sees the same machine state; ``overhead_cpu_us`` is the fastest step's CPU time
    per task minus the reference's fastest.

    ``executors`` (``rrfp.runtime.engine.executor`` names) and ``device`` run the same pipeline under
    other executors (rows named ``"<hint>, <codec>, <executor>"``); the thread executor computes
    on its worker thread, which the loop thread's CPU time does not see, so compare executors
    by wall time (``min_per_task_us``, ``overhead_wall_us``). On CUDA, every step ends with a
    device synchronisation (in both the pipeline's and the reference's times).

    Where the ``bf, codec`` row stands (issue 33's target: at most 1.5x the reference, CPU per
    task). In instructions, which the load does not change (``python -m
    benchmarks.overhead_instructions``, callgrind, each tree's runs side by side; 2026-12-05):
    190.0 K per task against 90.8 K for the reference, **2.09x** (1.98x against main's run of
    the reference, 96.2 K: between runs the reference's count moves by up to 6%); main before:
    221.0 K against 96.2 K, 2.30x (h33task's figure, 217.8 K against 97.0 K). Whole processes
    of ``--child pipe 100`` (100 steps after the warm-up, torch's import included), main and
    the branch alternated, 3 pairs at load 7-20: CPU main/branch 1.113 (median; 0.998-1.115).

    Where the instructions went (``--bytecodes``: per task, main before -> now): 1828 -> 1557
    bytecodes, 44.4 -> 34.4 Python calls. The codec reads a data header whose job/step prefix
    and microbatch...meta tail it accepted before without msgpack or ``parse_header`` (the
    header's parse 400 -> 190 bytecodes; anything else is parsed in full and teaches it), and
    builds a CPU tensor's frame inline; the inbox buffers a host stage's arrival in its
    delivery callback; the loop's inline path marks the task watch and records the task
    itself; a task empties its input slot itself. The instructions of the reference's own work
    (the autograd engine, the stage's multiply: ~70 K) are the pipeline's too; the pipeline's
    extra ~95 K are nearly all the interpreter's: per task the encode and decode (~340
    bytecodes), the scheduler loop's turn and the arbiter's decision, completion and input
    marking (~400), the fake network's send, delivery and mailbox (~180, in
    rrfp/transport/fake.py and base.py) and the two keys and the message built per message.
    1.5x (~145 K) needs that extra halved: fewer layers per message (transport, mailbox, inbox)
    than the transport's contract has.

    The transport's in-process path (2026-12-05, h34task): the fake network's send takes
    ``encode_sized``'s frames and size in one pass and queues them itself, its FIFO hands the
    frames to ``deliver_frames`` directly, which hands the message to the inbox's handler (no
    ``_post``, ``_deliver``, ``frames_nbytes``, ``check_send`` or ``_Mailbox.put`` calls), the
    known-header read finds the step by a table and builds the key, and the inbox fills the
    router's slot itself: per task 1593 -> 1527 bytecodes, 36.6 -> 31.4 Python calls. In
    instructions, main's and this tree's pipeline runs side by side (callgrind, ``--child pipe``
    1 and 5 steps): 191.7 K -> 188.6 K per task (-1.6%; with 1 and 3 steps 193.3 K -> 189.6 K);
    ``python -m benchmarks.overhead_instructions`` before and after: 193.0 K against 87.8 K
    (2.20x), 187.0 K against 90.0 K (2.08x; the reference's count moves by up to 9% between
    runs, the pipeline's by ~1.5%). 1.5x stays out of reach: the
    pipeline's extra ~95 K per task are the interpreter's work on the ~1500 bytecodes and ~31
    calls of the loop's turn, the arbiter's decision, completion and input marking (~310
    bytecodes), the encode and decode (~380 per message) and the send, delivery and admission
    (~240 per message); halving it needs the per-message path out of Python (the codec and the
    admission in C), not fewer layers.

    uvloop against asyncio's own loop (issue 33 item 3; ``--loop asyncio``, both runs counted
    whole, 2026-12-05, this branch before its compute changes): asyncio 203.6 K instructions
    per task, uvloop 193.8 K, 4.8% fewer: uvloop stays the runtime's loop
    (:func:`rrfp.runtime.doors.front.new_event_loop`).

    The hot path compiled with Cython (issue 33 item 3, 2026-12-05, branch h7cy, a21be5b and
    5709fd6, reverted): the codec, the transport's base and fake network, the policies, the
    arbiter, the scheduler loop, the inbox, compute, outbox and router, compiled as they are
    (pure-Python mode, no C types), cut the bytecodes per task 1545 -> 238 but the instructions
    2-3%: ``overhead_instructions --pure`` (the pipeline from the extensions and from the
    ``.py`` in one run, load 7-17) 186.0 K against 189.7 K (by hand 92.6 K: 2.01x against
    2.05x); callgrind inside two timed steps only, 186.2 K against 191.2 K. The interpreter's own
    loop falls from 39.9 K to 7.1 K per task, but the compiled code looks each attribute up in
    full (``_PyObject_GenericGetAttrWithDict``, ``_PyType_Lookup``, the dict probes: ~5 K -> ~21 K
    per task) where 3.11's specialised bytecodes read slots and instance values from their
    inline caches, and runs 9 K of its own. CPU time per task (4 pairs alternated, load 4.5):
    28.3 us against 32.1 us (0.88): fewer branches, not fewer instructions. Where the
    compiled pipeline's 186 K per task go (callgrind, inclusive): the task's compute 97 K (the
    autograd engine's backward 54 K, as in the reference), the send (router, outbox, fake
    network, encode 16 K) 24 K, the delivery (fake network, decode 12 K, inbox 9 K) 28 K, the
    arbiter's decision, completion and input marking 13 K; by library, libpython 96 K (the
    object protocol, allocation, GC), torch's 54 K, libc 19 K (malloc, memcpy), the dynamic
    loader's TLS lookups 8 K. Even every attribute lookup typed away (``cdef`` classes, which the
    tests' monkeypatched methods and instances rule out for the policies, the inbox and compute)
    leaves ~165 K, 1.8x: 1.5x needs less work per message (fewer objects and torch calls per
    send and delivery), not a compiler."""
    from rrfp.runtime.doors.local import LocalPipeline

    out = {}
    x = torch.ones(n_microbatches, 1)
    y = torch.ones(n_microbatches, 1)
    n_tasks = 2 * n_ranks * n_microbatches
    ref, ref_tasks, _ = sequential_runner(n_ranks, n_microbatches, device)
    sync = torch.cuda.synchronize if device is not None and torch.device(device).type == "cuda" else (lambda: None)
    quiet = logging.getLogger("rrfp")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # closing a LocalPipeline logs each rank's peers as lost
    try:
        for h in hints:
            for encode in encodes:
                for ex in executors:
                    with LocalPipeline([Scale() for _ in range(n_ranks)], n_microbatches, scalar_loss, hint=h,
                                       encode=encode, watchdog=60, executor=ex, device=device,
                                       launch_ahead=launch_ahead) as pipe:
                        walls, cpus, ref_cpus, ref_walls, procs = [], [], [], [], []
                        for k in range(steps + 1):
                            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                            pipe.step(x, target=y)
                            sync()
                            if k:
                                walls.append(time.perf_counter() - t0)
                                cpus.append(time.thread_time() - c0)
                                procs.append(time.process_time() - p0)
                            t0, c0 = time.perf_counter(), time.thread_time()
                            ref()
                            sync()
                            ref_cpus.append(time.thread_time() - c0)
                            ref_walls.append(time.perf_counter() - t0)
                    name = f"{h}, {'codec' if encode else 'no codec'}" + ("" if ex == "inline" else f", {ex}")
                    name += f", window {launch_ahead}" if launch_ahead != 1 else ""
                    cpu, ref_cpu = min(cpus) / n_tasks * 1e6, min(ref_cpus) / ref_tasks * 1e6
                    out[name] = {"per_task_us": statistics.median(walls) / n_tasks * 1e6,
                                 "min_per_task_us": min(walls) / n_tasks * 1e6,
                                 "cpu_per_task_us": cpu, "ref_cpu_per_task_us": ref_cpu,
                                 "overhead_cpu_us": cpu - ref_cpu, "tasks": n_tasks,
                                 "overhead_wall_us": (min(walls) / n_tasks - min(ref_walls) / ref_tasks) * 1e6,
                                 "process_cpu_per_task_us": min(procs) / n_tasks * 1e6}
    finally:
        quiet.setLevel(level)
    return out


def _overhead_2proc(cfg: dict) -> dict[str, Any]:
    """rrfp and PyTorch's schedules on do-nothing stages across the rank processes."""
    import torch.distributed.pipelining as pp

    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage

    rank, P = dist.get_rank(), dist.get_world_size()
    M, steps = cfg["overhead_microbatches"], cfg["overhead_steps"]
    x = torch.ones(M, 1)
    y = torch.ones(M, 1)
    tasks_per_rank = 2 * M
    # The reference: this rank's share of the same tasks run by hand, measured on each rank
    # while the other waits at the barrier (2 ranks on 2 cores: no contention between them).
    ref, ref_tasks, _ = sequential_runner(P, M)
    ref_walls = []
    for r in range(P):
        dist.barrier()
        if r == rank:
            for _ in range(steps):
                t0 = time.perf_counter()
                ref()
                ref_walls.append(time.perf_counter() - t0)
    ref_us = torch.tensor([min(ref_walls) / ref_tasks * 1e6], dtype=torch.float64)
    dist.all_reduce(ref_us, op=dist.ReduceOp.MAX)
    results: dict[str, Any] = {}
    systems: list[tuple[str, Any]] = []
    for h in ("bf", "strict-1f1b"):
        pipe = Pipeline(PipelineStage(Scale(), rank, P), M, scalar_loss, hint=h, rank=rank, n_ranks=P,
                        job=f"{cfg['run_id']}-ovh-{h}", watchdog=60)
        systems.append((f"rrfp {h} (ZeroMQ)", pipe))
    for cls in ("ScheduleGPipe", "Schedule1F1B"):
        st = pp.PipelineStage(Scale(), rank, P, torch.device("cpu"))
        systems.append((f"torch {cls[8:]} (gloo)", getattr(pp, cls)(st, M, loss_fn=scalar_loss)))
    for name, s in systems:
        walls, busy = [], []
        for k in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if isinstance(s, Pipeline):
                s.step(*((x,) if rank == 0 else ()), target=y if rank == P - 1 else None)
            else:
                kw = {"target": y} if rank == P - 1 else {}
                s.step(*((x,) if rank == 0 else ()), return_outputs=False, **kw)
            wall = time.perf_counter() - t0
            if k:
                walls.append(wall)
                if isinstance(s, Pipeline):
                    busy.append(s.last_stats.busy)
        t = torch.tensor([statistics.median(walls), statistics.median(busy) if busy else -1.0, min(walls)],
                         dtype=torch.float64)
        got = [torch.zeros_like(t) for _ in range(P)]
        dist.all_gather(got, t)
        wall = max(float(g[0]) for g in got)
        results[name] = {
            "per_task_us": wall / tasks_per_rank * 1e6,
            "min_per_task_us": max(float(g[2]) for g in got) / tasks_per_rank * 1e6,
            "busy_per_task_us": [float(g[1]) / tasks_per_rank * 1e6 for g in got] if busy else None,
            "tasks_per_rank": tasks_per_rank,
            "ref_wall_per_task_us": float(ref_us),
            "overhead_wall_us": max(float(g[2]) for g in got) / tasks_per_rank * 1e6 - float(ref_us),
        }
    for name, s in systems:
        if isinstance(s, Pipeline):
            s.close()
    return results


# --------------------------------------------------------------------------- transports


def _iters(size: int, budget_bytes: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget_bytes // size))


async def _zmq_bench(tr, rank: int, job: str, sizes: Sequence[int], budget: int) -> dict[int, dict[str, float]]:
    from rrfp.transport.keys import Direction, MsgKey

    out = {}
    peer = 1 - rank
    for size in sizes:
        payload = torch.ones(size // 4, dtype=torch.float32)
        n_pp = _iters(size, budget // 4, 5, 200)
        n_st = _iters(size, budget, 10, 2000)
        ack = torch.zeros(1)
        # ping-pong
        rtts = []
        for i in range(n_pp + 3):
            t0 = time.perf_counter()
            key = MsgKey(job, i, 0, peer, Direction.ACT)
            if rank == 0:
                tr.send(peer, key, [payload])
                await tr.recv()
            else:
                msg = await tr.recv()
                tr.send(peer, MsgKey(job, i, 0, peer, Direction.ACT), [msg.tensors[0]])
            if i >= 3:
                rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        # stream, then a one-element ack
        await _zmq_sync(tr, rank, job)
        t0 = time.perf_counter()
        if rank == 0:
            for i in range(n_st):
                tr.send(peer, MsgKey(job, i, 1, peer, Direction.ACT), [payload])
            await tr.recv()
        else:
            for _ in range(n_st):
                await tr.recv()
            tr.send(peer, MsgKey(job, 0, 2, peer, Direction.ACT), [ack])
            await tr.flush()
        dt = time.perf_counter() - t0
        out[size] = {"latency_us": rtt / 2 * 1e6, "throughput_MBps": n_st * size / dt / 1e6}
    return out


async def _zmq_sync(tr, rank: int, job: str) -> None:
    from rrfp.transport.keys import Direction, MsgKey

    peer = 1 - rank
    tr.send(peer, MsgKey(job, 0, 9, peer, Direction.CTL), [], {"sync": 1})
    await tr.recv()


def _gloo_bench(rank: int, sizes: Sequence[int], budget: int) -> dict[int, dict[str, float]]:
    out = {}
    peer = 1 - rank
    for size in sizes:
        buf = torch.ones(size // 4, dtype=torch.float32)
        n_pp = _iters(size, budget // 4, 5, 200)
        n_st = _iters(size, budget, 10, 2000)
        rtts = []
        for i in range(n_pp + 3):
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(buf, peer).wait()
                dist.irecv(buf, peer).wait()
            else:
                dist.irecv(buf, peer).wait()
                dist.isend(buf, peer).wait()
            if i >= 3:
                rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        dist.barrier()
        ack = torch.zeros(1)
        t0 = time.perf_counter()
        if rank == 0:
            works = [dist.isend(buf, peer) for _ in range(n_st)]
            for w in works:
                w.wait()
            dist.irecv(ack, peer).wait()
        else:
            bufs = [torch.empty_like(buf) for _ in range(min(n_st, 8))]
            works = [dist.irecv(bufs[i % len(bufs)], peer) for i in range(n_st)]
            for w in works:
                w.wait()
            dist.isend(ack, peer).wait()
        dt = time.perf_counter() - t0
        out[size] = {"latency_us": rtt / 2 * 1e6, "throughput_MBps": n_st * size / dt / 1e6}
    return out


def fake_transport_bench(sizes: Sequence[int] = SIZES, budget: int = 64 << 20) -> dict[int, dict[str, float]]:
    """The in-process fake transport (through the codec, as ``LocalPipeline`` uses it): both
    ends on one event loop."""
    from rrfp.runtime.doors.pipeline import new_event_loop
    from rrfp.transport.fake import FakeNetwork
    from rrfp.transport.keys import Direction, MsgKey

    async def main() -> dict:
        net = FakeNetwork(2, encode=True)
        a, b = net.transport(0), net.transport(1)
        await a.start()
        await b.start()
        out = {}
        for size in sizes:
            payload = torch.ones(size // 4, dtype=torch.float32)
            n_pp = _iters(size, budget // 4, 5, 200)
            n_st = _iters(size, budget, 10, 2000)

            async def echo(n: int) -> None:
                for i in range(n):
                    msg = await b.recv()
                    b.send(0, MsgKey("f", i, 0, 0, Direction.ACT), [msg.tensors[0]])

            task = asyncio.ensure_future(echo(n_pp))
            rtts = []
            for i in range(n_pp):
                t0 = time.perf_counter()
                a.send(1, MsgKey("f", i, 0, 1, Direction.ACT), [payload])
                await a.recv()
                rtts.append(time.perf_counter() - t0)
            rtt = statistics.median(rtts)
            await task
            t0 = time.perf_counter()
            for i in range(n_st):
                a.send(1, MsgKey("f", i, 1, 1, Direction.ACT), [payload])
            for _ in range(n_st):
                await b.recv()
            dt = time.perf_counter() - t0
            out[size] = {"latency_us": rtt / 2 * 1e6, "throughput_MBps": n_st * size / dt / 1e6}
        a.abort()
        b.abort()
        return out

    loop = new_event_loop()
    quiet = logging.getLogger("rrfp")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # aborting one end logs the other's peer as lost
    try:
        return loop.run_until_complete(main())
    finally:
        quiet.setLevel(level)
        loop.close()


def rank_main(cfg: dict) -> dict | None:
    """Two rank processes: transports (ZeroMQ, gloo), then the runtime's overhead per task."""
    from rrfp.parallel.bootstrap import default_transport
    from rrfp.runtime.doors.pipeline import new_event_loop

    rank = dist.get_rank()
    sizes = cfg["sizes"]
    budget = cfg["budget_bytes"]
    loop = new_event_loop()
    tr = default_transport(rank, dist.get_world_size(), f"{cfg['run_id']}-zmq")
    loop.run_until_complete(tr.start())
    zmq_res = loop.run_until_complete(_zmq_bench(tr, rank, f"{cfg['run_id']}-zmq", sizes, budget))
    loop.run_until_complete(tr.close())
    loop.close()
    dist.barrier()
    gloo_res = _gloo_bench(rank, sizes, budget)
    dist.barrier()
    overhead = _overhead_2proc(cfg)
    dist.barrier()
    if rank != 0:
        return None
    return {"zmq": zmq_res, "gloo": gloo_res, "overhead_2proc": overhead}


def _overhead_reps(reps: int, hint: str | None = None, **kw: Any) -> dict[str, dict[str, Any]]:
    """:func:`local_overhead` of the scheduler's default policy (``bf``; not ``auto``, whose
    steps switch hints) and strict 1F1B, ``reps`` times over (the machine is shared: each figure
    is the median of the repetitions, all of them kept under ``reps_overhead_cpu_us``)."""
    from rrfp.scheduler.hints import DEFAULT_HINT

    hints = tuple(dict.fromkeys((hint or DEFAULT_HINT, "strict-1f1b")))
    runs = [local_overhead(hints=hints, **kw) for _ in range(reps)]
    out = {}
    for name in runs[0]:
        vals = [r[name]["overhead_cpu_us"] for r in runs]
        mid = sorted(range(reps), key=lambda i: vals[i])[reps // 2]
        out[name] = {**runs[mid][name], "reps_overhead_cpu_us": vals}
    return out


def run_micro(quick: bool = False, timeout: float = 300.0, hint: str | None = None) -> dict[str, Any]:
    """Every micro-benchmark; the 2-process ones in freshly launched ranks."""
    from .launcher import launch

    sizes = list(SIZES[::2]) if quick else list(SIZES)
    budget = (4 << 20) if quick else (64 << 20)
    cfg = {"sizes": sizes, "budget_bytes": budget, "run_id": f"micro-{time.time_ns()}",
           "overhead_microbatches": 16 if quick else 64, "overhead_steps": 2 if quick else 15}
    res = launch("benchmarks.micro:rank_main", 2, cfg, timeout=timeout).result
    out: dict[str, Any] = {
        "arbiter": arbiter_decisions(sizes=(1, 32, 256) if quick else READY_SIZES,
                                     hints=("bf", "1f1b") if quick else ARBITER_HINTS,
                                     cycles=500 if quick else 3000, repeats=2 if quick else 5),
        "overhead_local": _overhead_reps(1 if quick else 5, hint, n_microbatches=16 if quick else 64,
                                         steps=2 if quick else 20),
        "overhead_2proc": res["overhead_2proc"],
        "transport": {"zmq (tcp)": res["zmq"], "fake (in-process)": fake_transport_bench(sizes, budget), "gloo": res["gloo"]},
        "sizes": sizes,
    }
    return out
