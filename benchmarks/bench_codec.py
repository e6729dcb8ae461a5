"""Per-message CPU cost of the codec and of the ZeroMQ transport, on small messages.

Usage::

    python benchmarks/bench_codec.py [--n 20000] [--rounds 7]   # codec, in-process
    python benchmarks/bench_codec.py --zmq [--n 20000]           # 2 processes over ZeroMQ

Prints microseconds of thread CPU time per call, the fastest of ``--rounds`` rounds (other
work on a shared machine only ever makes a round slower). The messages are those a pipeline
sends between do-nothing stages:

- ``act 2x32x32``: one float32 activation of shape (2, 32, 32), no grad;
- ``act 1x1``: one float32 (1, 1) tensor;
- ``mixed``: ``[float32 (4, 8) requiring grad, None, int64 (2, 3), bool (5,)]``.

``--zmq`` starts a second rank process (TCPStore rendezvous, as the tests do) and sends the
``act 2x32x32`` message: a ping-pong (median one-way latency, half a round trip) and a
one-way stream of ``--n`` messages (wall time per message until the receiver has decoded
all, and each side's CPU time per message: the whole process, ZeroMQ's I/O thread included,
and the event-loop thread alone), fastest of ``--rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Callable

import torch

from rrfp.transport.codec import decode, encode
from rrfp.transport.keys import Direction, MsgKey


def messages() -> dict[str, list[torch.Tensor | None]]:
    return {
        "act 2x32x32": [torch.randn(2, 32, 32)],
        "act 1x1": [torch.ones(1, 1)],
        "mixed": [
            torch.randn(4, 8).requires_grad_(True),
            None,
            torch.arange(6, dtype=torch.int64).view(2, 3),
            torch.tensor([True, False, True, True, False]),
        ],
    }


def cpu_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Fastest round's thread CPU time per call of ``fn``, in microseconds."""
    for _ in range(min(n, 1000)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time_ns() - t0) / n / 1000)
    return best


def codec_bench(n: int, rounds: int) -> None:
    key = MsgKey("job-0123", 3, 17, 2, Direction.ACT)
    print(f"{'message':<14}{'encode':>10}{'decode':>10}{'round trip':>12}   (us CPU per call)")
    for name, tensors in messages().items():
        frames = encode(key, tensors)
        wire = [bytes(f) for f in frames]  # what a receiver holds: immutable buffers

        def enc(tensors: list = tensors) -> object:
            return encode(key, tensors)

        def dec(wire: list = wire) -> object:
            return decode(wire)

        def both(tensors: list = tensors) -> object:
            return decode(encode(key, tensors))

        e = cpu_us(enc, n, rounds)
        d = cpu_us(dec, n, rounds)
        b = cpu_us(both, n, rounds)
        print(f"{name:<14}{e:>10.2f}{d:>10.2f}{b:>12.2f}")


# --------------------------------------------------------------------------- zmq


def _zmq_rank(rank: int, port: int, job: str, n: int, rounds: int, out: mp.Queue | None) -> None:
    import uvloop
    from torch.distributed import TCPStore

    from rrfp.transport.zmq import ZmqTransport

    torch.set_num_threads(1)

    async def run() -> dict[str, float]:
        store = TCPStore("127.0.0.1", port, 2, is_master=False)
        tr = ZmqTransport(rank, 2, store, job)
        await tr.start()
        peer = 1 - rank
        payload = messages()["act 2x32x32"]
        ack = MsgKey(job, 0, 0, peer, Direction.CTL)
        res: dict[str, float] = {}
        # ping-pong
        n_pp = max(200, n // 10)
        rtts = []
        for i in range(n_pp + 50):
            t0 = time.perf_counter()
            if rank == 0:
                tr.send(peer, MsgKey(job, i, 0, peer, Direction.ACT), payload)
                await tr.recv()
            else:
                m = await tr.recv()
                tr.send(peer, MsgKey(job, i, 0, peer, Direction.ACT), m.tensors)
            if i >= 50:
                rtts.append(time.perf_counter() - t0)
        res["latency_us"] = statistics.median(rtts) / 2 * 1e6
        # one-way stream, then an ack
        best_wall = best_cpu = best_main = float("inf")
        for _ in range(rounds):
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            if rank == 0:
                for i in range(n):
                    tr.send(peer, MsgKey(job, i, 1, peer, Direction.ACT), payload)
                    if i % 64 == 63:
                        await asyncio.sleep(0)  # as a runtime would, between tasks
                c1, m1 = time.process_time(), time.thread_time()
                await tr.recv()
            else:
                for _ in range(n):
                    await tr.recv()
                c1, m1 = time.process_time(), time.thread_time()
                tr.send(peer, ack, [])
                await tr.flush()
            best_wall = min(best_wall, time.perf_counter() - t0)
            best_cpu = min(best_cpu, c1 - c0)
            best_main = min(best_main, m1 - m0)
        res["stream_wall_us"] = best_wall / n * 1e6
        res["stream_cpu_us"] = best_cpu / n * 1e6
        res["stream_main_us"] = best_main / n * 1e6
        await tr.close()
        return res

    res = uvloop.run(run())
    if out is not None:
        out.put(res)


def zmq_bench(n: int, rounds: int) -> None:
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_zmq_rank, args=(1, master.port, job, n, rounds, out), daemon=True)
    child.start()
    try:
        mine: dict[str, float] = {}
        q: mp.Queue = ctx.Queue()
        _zmq_rank(0, master.port, job, n, rounds, q)
        mine = q.get(timeout=10)
        theirs = out.get(timeout=60)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    print(f"ping-pong one-way latency: {mine['latency_us']:.1f} us (median)")
    print(f"stream of {n}: {mine['stream_wall_us']:.1f} us wall per message; CPU per message "
          f"(process, of it the event-loop thread): sender {mine['stream_cpu_us']:.1f} "
          f"({mine['stream_main_us']:.1f}) us, receiver {theirs['stream_cpu_us']:.1f} "
          f"({theirs['stream_main_us']:.1f}) us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls (messages) per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; the fastest counts")
    ap.add_argument("--zmq", action="store_true", help="2 processes over ZeroMQ instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.zmq:
        zmq_bench(args.n, args.rounds)
    else:
        codec_bench(args.n, args.rounds)


if __name__ == "__main__":
    main()
