"""Cost of authentication: the ZeroMQ transport with and without CURVE (a job secret).

Usage::

    python benchmarks/bench_auth.py [--rounds 5] [--markdown]

Two ranks in one process on one event loop over 127.0.0.1 (each transport has its own
ZeroMQ context, hence its own I/O thread, where CurveZMQ encrypts and decrypts). For 1 KiB
and 16 MiB float32 payloads it measures

- latency: half the median round trip of a ping-pong (the payload echoed back); the
  difference with and without CURVE is the overhead a pipeline task pays per message it
  sends (each F or B sends one);
- throughput: ``n`` back-to-back messages one way until the receiver has decoded all.

The two settings alternate round by round and the best round of each is kept (other work
on a shared machine only makes a round slower).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
import torch.distributed as dist

from rrfp.transport.auth import JobAuth
from rrfp.transport.keys import Direction, MsgKey
from rrfp.transport.zmq import ZmqTransport

SIZES = {"1 KiB": 1024, "16 MiB": 16 << 20}
COUNTS = {"1 KiB": (400, 4000), "16 MiB": (10, 30)}  # (ping-pongs, streamed messages)


async def _pair(auth: JobAuth | None, job: str) -> list[ZmqTransport]:
    store = dist.HashStore()
    ts = [ZmqTransport(r, 2, store, job, host="127.0.0.1", auth=auth, insecure=auth is None) for r in range(2)]
    await asyncio.gather(*(t.start() for t in ts))
    return ts


async def _measure(auth: JobAuth | None, nbytes: int, pings: int, stream: int, job: str) -> tuple[float, float]:
    a, b = await _pair(auth, job)
    x = torch.zeros(nbytes // 4)
    key = MsgKey(job, 0, 0, 1, Direction.ACT)
    back = MsgKey(job, 0, 0, 0, Direction.GRAD)
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        a.send(1, key, [x])
        m = await b.recv()
        b.send(0, back, m.tensors)
        await a.recv()
        rtts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(stream):
        a.send(1, key, [x])
    for _ in range(stream):
        await b.recv()
    secs = time.perf_counter() - t0
    await asyncio.gather(a.close(), b.close())
    return statistics.median(rtts) / 2 * 1e6, stream * nbytes / secs / 1e6


def run(rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """{size: {"plain"|"curve": (latency us, MB/s)}}, best of ``rounds``."""
    auth = JobAuth(JobAuth.generate())
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, nbytes in SIZES.items():
        pings, stream = COUNTS[name]
        best = {"plain": (float("inf"), 0.0), "curve": (float("inf"), 0.0)}
        for i in range(rounds):
            for mode in ("plain", "curve"):
                lat, tput = asyncio.run(_measure(auth if mode == "curve" else None, nbytes, pings, stream,
                                                 f"bench-{mode}-{i}"))
                best[mode] = (min(best[mode][0], lat), max(best[mode][1], tput))
        out[name] = best
    return out


def markdown(res: dict[str, dict[str, tuple[float, float]]]) -> str:
    rows = ["| payload | latency us, plain | latency us, CURVE | overhead us/message | MB/s, plain | MB/s, CURVE | "
            "throughput with CURVE |", "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        (lp, tp), (lc, tc) = r["plain"], r["curve"]
        rows.append(f"| {name} | {lp:.0f} | {lc:.0f} | {lc - lp:+.0f} | {tp:.0f} | {tc:.0f} | {tc / tp:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--markdown", action="store_true", help="print a BENCHMARKS.md table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = run(args.rounds)
    if args.markdown:
        print(markdown(res))
    else:
        for name, r in res.items():
            for mode, (lat, tput) in r.items():
                print(f"{name:7s} {mode:6s} latency {lat:9.1f} us  throughput {tput:9.1f} MB/s")


if __name__ == "__main__":
    main()
