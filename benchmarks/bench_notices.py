"""What backfilling's started notices cost (rrfp.runtime.features.notices).

Usage::

    python -m benchmarks.bench_notices [--n 20000] [--rounds 7] [--ranks 4] [--microbatches 8]
    python -m benchmarks.bench_notices --ratio [--setting jitter4]

Prints:

- the bytes of one notice as the codec frames it (the header; a notice carries no tensor);
- notices per step of a ``backfill`` run: counted on an in-process pipeline (``LocalPipeline``,
  fake transport, toy stages, ``--ranks`` ranks, ``--microbatches`` microbatches; the second
  step, when every kind has an estimate), against the count ``2 M (p - 1)`` (every task whose
  output goes to another rank: the forwards of every stage but the last, the input backwards
  of every stage but the first);
- microseconds of thread CPU time per notice, fastest of ``--rounds`` rounds of ``--n``: the
  sender's part (estimate, meta, codec encode) and the receiver's (codec decode, checks,
  board). The transport's own per-message cost is ``benchmarks/bench_codec.py --zmq``'s.

``--ratio``: ``backfill`` against its strict order ``strict-split`` on real rank processes (the
comparison harness, :func:`benchmarks.compare.run_setting`, with the setting's phases; both
hints as candidate rows at 1F1B's and GPipe's memory, in rotating order each round, gradients
checked). Prints, per phase, the median over rounds and rows of strict-split's step time over
backfill's, and as a control the same ratio between strict-split's two rows (one system twice:
the machine's noise).
"""

from __future__ import annotations

import argparse
import time

from rrfp.runtime.features.notices import StartedNotices
from rrfp.scheduler.tasks import F, PipelineSpec, Placement, Task
from rrfp.transport.base import Message
from rrfp.transport.codec import decode, encode
from rrfp.transport.keys import Direction, MsgKey

JOB = "rrfp-bench-notices"


def notice_cpu(n: int, rounds: int) -> tuple[float, float, int]:
    """(sender µs, receiver µs, bytes) per notice, fastest round."""
    spec = PipelineSpec(Placement(2), n, False)
    frames: list = []
    key = MsgKey(JOB, 0, 0, 0, Direction.CTL)
    sender = StartedNotices(spec, 0, lambda dst, step, meta: frames.append(encode(key, [], meta)))
    receiver = StartedNotices(spec, 1, lambda *a: None)
    for m in range(n):
        sender.averages.observe(Task(0, F, m), 0.01)
    tasks = [Task(0, F, m) for m in range(n)]
    best_s = best_r = float("inf")
    for _ in range(rounds):
        frames.clear()
        t0 = time.thread_time()
        for t in tasks:
            sender.started(0, t)
        t1 = time.thread_time()
        receiver._boards.clear()
        t2 = time.thread_time()
        for f in frames:
            k, tensors, meta = decode(f)
            problem = receiver.receive(Message(0, k, tensors, meta), 0)
        t3 = time.thread_time()
        assert problem is None and len(receiver._boards[0]) == n
        best_s, best_r = min(best_s, (t1 - t0) / n), min(best_r, (t3 - t2) / n)
    size = sum(len(bytes(x)) for x in frames[0])
    return best_s * 1e6, best_r * 1e6, size


def notices_per_step(p: int, M: int) -> tuple[list[int], int]:
    """Notices sent in each of two steps of a ``backfill`` run on ``p`` toy ranks, and the
    second step's expected count ``2 M (p - 1)``."""
    import torch

    from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
    from rrfp.runtime.doors.local import LocalPipeline

    torch.manual_seed(0)
    cfg = ToyConfig(n_layer=p)
    x, y = toy_batch(cfg, 2 * M, seed=1)
    counts = []
    with LocalPipeline(split_toy(ToyModel(cfg), p), M, toy_loss, hint="backfill:1f1b") as pipe:
        for _ in range(2):
            before = sum(rt.features["notices"].n_sent for rt in pipe.runtimes)
            pipe.step(*x, target=y)
            counts.append(sum(rt.features["notices"].n_sent for rt in pipe.runtimes) - before)
    return counts, 2 * M * (p - 1)


def runtime_ratio(setting: str) -> None:
    import statistics

    from .compare import run_setting
    from .settings import setting_config

    out = run_setting(setting_config(setting, systems=["torch 1F1B"], candidates=["backfill", "strict-split"]),
                      timeout=1800)
    rows = ("1F1B memory", "GPipe memory")
    for ph in out["phases"]:
        timed = [r["systems"] for r in ph["rounds"] if r["kind"] == "timed"]
        ratio = [s[f"rrfp strict-split, {m}"]["step"] / s[f"rrfp backfill, {m}"]["step"] for s in timed for m in rows]
        ctrl = [s[f"rrfp strict-split, {rows[1]}"]["step"] / s[f"rrfp strict-split, {rows[0]}"]["step"] for s in timed]
        print(f"{setting} {ph['name']}: backfill speedup over strict-split, median {statistics.median(ratio):.3f} "
              f"(min {min(ratio):.3f}, max {max(ratio):.3f}, {len(ratio)} pairs); control (strict-split against "
              f"itself) {statistics.median(ctrl):.3f} (min {min(ctrl):.3f}, max {max(ctrl):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ratio", action="store_true", help="backfill against strict-split on real rank processes")
    ap.add_argument("--setting", default="jitter4")
    a = ap.parse_args()
    if a.ratio:
        runtime_ratio(a.setting)
        return
    send_us, recv_us, size = notice_cpu(a.n, a.rounds)
    counts, want = notices_per_step(a.ranks, a.microbatches)
    print(f"notice: {size} bytes on the wire (codec frames; no tensor)")
    print(f"notices per step, {a.ranks} ranks, {a.microbatches} microbatches: step 0 {counts[0]}, "
          f"step 1 {counts[1]} (expected 2 M (p - 1) = {want}); {counts[1] * size} bytes per step")
    print(f"thread CPU per notice: sender {send_us:.1f} us, receiver {recv_us:.1f} us "
          f"(fastest of {a.rounds} rounds of {a.n})")


if __name__ == "__main__":
    main()
