"""Throughput of the ``zmq`` and ``torch`` (gloo) data planes, 1 KiB to 64 MiB, 2 processes.

Usage::

    python benchmarks/bench_transport.py [--rounds 3] [--max-mib 64] [--json out.json]

Two rank processes on loopback (TCPStore rendezvous, as the tests do) hold both transports
at once: a :class:`~rrfp.transport.zmq.ZmqTransport` and a
:class:`~rrfp.transport.planes.PlaneTransport` (ZeroMQ announcements + gloo point-to-point).
For each size, rank 0 streams ``n`` float32 activation messages (ACT) to rank 1 through the
full transport API (``send``, the delivery callback, fresh tensors on arrival), and rank 1
answers with a one-element control message once it has all ``n``; throughput is ``n * size``
over the time from the first send to that answer. The data planes alternate within each round
(zmq, torch, zmq, torch...) so that load on a shared machine hits both alike; the table gives
the median of ``--rounds`` rounds, and the ratio torch / zmq measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid

import torch

SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB
BUDGET = 128 << 20  # bytes streamed per measurement (at least MIN_N messages)
MIN_N, MAX_N = 4, 400


def n_messages(size: int) -> int:
    return max(MIN_N, min(MAX_N, BUDGET // size))


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


async def _rank(rank: int, port: int, job: str, sizes: list[int], rounds: int, out: mp.Queue | None) -> None:
    from torch.distributed import TCPStore

    from rrfp.transport import Direction, MsgKey, PlaneTransport, ZmqTransport
    from rrfp.transport.torch_plane import TorchDataPlane, gloo_groups

    store = TCPStore("127.0.0.1", port, 2, is_master=False)
    planes = {
        "zmq": ZmqTransport(rank, 2, store, f"{job}-zmq"),
        "torch": PlaneTransport(
            ZmqTransport(rank, 2, store, f"{job}-torch"),
            TorchDataPlane(rank, lambda: gloo_groups(store, rank, 2, f"{job}/gloo"), "cpu"),
        ),
    }
    for t in planes.values():
        await t.start()
    results: dict[str, dict[int, list[float]]] = {name: {s: [] for s in sizes} for name in planes}
    for r in range(rounds):
        for size in sizes:
            n = n_messages(size)
            for name, t in planes.items():
                key = MsgKey(t.job, r, 0, 1, Direction.ACT)
                done = MsgKey(t.job, r, 0, 0, Direction.CTL)
                if rank == 0:
                    x = torch.randn(size // 4)
                    t0 = time.perf_counter()
                    for i in range(n):
                        t.send(1, key, [x])
                    ack = await t.recv()
                    assert ack.meta == {"got": n}, ack.meta
                    results[name][size].append(n * size / (time.perf_counter() - t0))
                else:
                    for i in range(n):
                        m = await t.recv()
                        assert m.tensors[0].numel() == size // 4
                    t.send(0, done, [], {"got": n})
                    await t.flush()
    for t in planes.values():
        await t.close()
    if out is not None:
        out.put(results)


def _main_rank(rank: int, port: int, job: str, sizes: list[int], rounds: int, out: mp.Queue | None) -> None:
    torch.set_num_threads(1)
    asyncio.run(_rank(rank, port, job, sizes, rounds, out))


def run(rounds: int, max_size: int) -> dict[str, dict[int, float]]:
    """Median bytes/s per data plane and size."""
    from torch.distributed import TCPStore

    sizes = [s for s in SIZES if s <= max_size]
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    job = f"bench-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_main_rank, args=(r, master.port, job, sizes, rounds, q if r == 0 else None))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    del master
    return {name: {s: statistics.median(v) for s, v in per.items()} for name, per in results.items()}


def report(med: dict[str, dict[int, float]], rounds: int) -> str:
    lines = [
        "| size | messages | zmq MiB/s | torch (gloo) MiB/s | torch / zmq |",
        "|---|---|---|---|---|",
    ]
    for s in med["zmq"]:
        z, g = med["zmq"][s], med["torch"][s]
        lines.append(f"| {label(s)} | {n_messages(s)} | {z / 2**20:.0f} | {g / 2**20:.0f} | {g / z:.2f} |")
    return "\n".join(lines) + f"\n\nMedian of {rounds} rounds, the two data planes alternating within each round."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=64, help="largest message, MiB")
    ap.add_argument("--json", default=None, help="also write the medians here")
    a = ap.parse_args(argv)
    med = run(a.rounds, a.max_mib << 20)
    print(report(med, a.rounds))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {str(s): v for s, v in d.items()} for k, d in med.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
