"""Where a comparison setting's message time goes: rrfp's held-message releases, sends and
hops, PyTorch's delayed-delivery waits, and a replay of rrfp's real steps in the simulator.

    python -m benchmarks.profile_comm [--setting comm4] [--rounds 6] [--out DIR]

Runs the setting's rank processes (``benchmarks.compare``) with rrfp at 1F1B's memory, rrfp's
strict 1F1B and PyTorch's 1F1B, records per rank (in ``DIR/rank<r>.json``) every rrfp task
(``StepStats.records``), every arrival the inbox holds (when, for how long), when it was
admitted, every send (wall and CPU time), and every wait of the PyTorch side's stage wrapper,
then prints per rank:

- release lateness of held messages, on an idle rank and on a busy one (negative: early);
- sends: CPU and wall time of ``Outbox.send`` (a gap between them is time the rank waited to
  run again), and the time from a send's end to the arrival at an idle receiver;
- PyTorch: how late the wrapper's ``time.sleep`` woke after the delivery time;
- median task durations of both runtimes;
- the replay: the simulator (same arbiter) on each real step's measured task durations and the
  same keyed delays plus a latency L per message, beside the real step time (1F1B's memory as
  its in-flight count: every comm4 microbatch holds the same bytes).

The figures of BENCHMARKS.md's "the real runtime profiled" section come from this tool. It is
for finding causes: the per-rank records cost time, so its step times are not benchmark rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SYSTEMS = ["rrfp default, 1F1B memory", "rrfp strict-1f1b", "torch 1F1B"]
HINTS = {"rrfp default, 1F1B memory": None, "rrfp strict-1f1b": "strict-1f1b"}


def rank_main(cfg: dict) -> dict | None:
    """One rank: instrument the systems of :mod:`benchmarks.compare`, run it, save the events."""
    import torch
    import torch.distributed as dist

    from . import compare, harness, workloads

    log: list = []
    now = {"system": "?", "step": -1}

    def stamp_of(tensors) -> float:
        ts = tensors[-1] if tensors else None
        return float(ts.reshape(-1)[0]) if ts is not None and ts.dtype == torch.float64 else -1.0

    init0 = compare.RrfpSystem.__init__

    def init(self, name, spec, *a, hold=None, **kw):
        def held(msg, _h=hold):
            w = _h(msg) if _h else 0.0
            k = msg.key
            log.append(("hold", name, now["step"], k.stage, k.microbatch, int(k.direction), time.monotonic(), w,
                        stamp_of(msg.tensors)))
            return w

        init0(self, name, spec, *a, hold=held if hold else None, **kw)
        rt = self.pipe.runtime
        rt.loop.record = True
        admit0, send0 = rt.inbox._admit, rt.outbox.send

        def admit(msg):
            k = msg.key
            log.append(("admit", name, now["step"], k.stage, k.microbatch, int(k.direction), time.monotonic()))
            return admit0(msg)

        def send(dst_rank, step, m, dst_stage, direction, tensors):
            t0, c0 = time.monotonic(), time.thread_time()
            send0(dst_rank, step, m, dst_stage, direction, tensors)
            log.append(("send", name, now["step"], dst_stage, m, int(direction), t0, time.monotonic(),
                        time.thread_time() - c0))

        rt.inbox._admit, rt.outbox.send = admit, send

    def rrfp_step(self, batch, _step=compare.RrfpSystem.step):
        now.update(system=self.name, step=batch.step_id)
        _step(self, batch)
        for r in self.pipe.last_stats.records:
            log.append(("task", self.name, batch.step_id, r.task[0], r.task[2], str(r.task[1]), r.start, r.end))

    def torch_step(self, batch, _step=compare.TorchSystem.step):
        now.update(system=self.name, step=batch.step_id)
        _step(self, batch)
        now["system"] = "?"

    def wait(self, stamp, send_stage, mb, kind, _wait=workloads.MessageDelays.wait):
        t0 = time.monotonic()
        _wait(self, stamp, send_stage, mb, kind)
        if now["system"].startswith("torch"):
            log.append(("twait", now["system"], now["step"], send_stage, mb, kind, t0, self.draw(send_stage, mb, kind),
                        float(stamp.detach().reshape(-1)[0]), time.monotonic()))

    def record(self, meth, t0, t1, _record=harness.ComputeTimer.record):
        _record(self, meth, t0, t1)
        log.append(("tcall", now["system"], now["step"], meth, t0, t1))

    compare.RrfpSystem.__init__, compare.RrfpSystem.step = init, rrfp_step
    compare.TorchSystem.step, workloads.MessageDelays.wait, harness.ComputeTimer.record = torch_step, wait, record
    out = compare.rank_main(cfg)
    Path(cfg["prof_dir"], f"rank{dist.get_rank()}.json").write_text(json.dumps(log))
    return out


def _q(xs, p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))] * 1e3 if xs else float("nan")


def summarize(prof_dir: str | Path, n_ranks: int, first_step: int = 2) -> dict:
    """Per rank and system: the measures listed in the module docstring (milliseconds), over
    the timed rounds' steps (not ``auto``'s measuring and trial steps)."""
    from .workloads import AUTO_STEP_OFFSET

    def timed(step: int) -> bool:
        return step >= first_step and step % 1000 < AUTO_STEP_OFFSET

    out: dict = {}
    events = {r: json.loads(Path(prof_dir, f"rank{r}.json").read_text()) for r in range(n_ranks)}
    sends = {tuple(e[1:6]): e for r in events for e in events[r] if e[0] == "send" and timed(e[2])}
    for r, log in events.items():
        by = collections.defaultdict(list)
        for e in log:
            if timed(e[2]):
                by[(e[1], e[2])].append(e)
        acc: dict = collections.defaultdict(lambda: collections.defaultdict(list))
        for (name, step), evs in by.items():
            a = acc[name]
            tasks = [e for e in evs if e[0] == "task"]
            admits = {tuple(e[3:6]): e[6] for e in evs if e[0] == "admit"}
            for e in evs:
                if e[0] == "task":
                    a["task " + e[5][-1]].append(e[7] - e[6])
                elif e[0] == "tcall":
                    a["call " + e[3]].append(e[5] - e[4])
                elif e[0] == "send":
                    a["send cpu"].append(e[8])
                    a["send wall"].append(e[7] - e[6])
                elif e[0] == "twait" and e[7] > 0 and e[8] + e[7] > e[6]:
                    a["torch wake late"].append(e[9] - (e[8] + e[7]))
                elif e[0] == "hold":
                    k = tuple(e[3:6])
                    if e[7] > 0 and k in admits:
                        due = e[6] + e[7]
                        busy = any(t[6] <= due <= t[7] for t in tasks)
                        a["release late, busy" if busy else "release late, idle"].append(admits[k] - due)
                    s = sends.get((name, step, *k))
                    if e[7] <= 0 and s is not None and not any(t[6] < e[6] and t[7] > s[7] for t in tasks):
                        a["hop, idle receiver"].append(e[6] - s[7])
        out[r] = {name: {k: {"p10": _q(v, .1), "p50": _q(v, .5), "p90": _q(v, .9),
                             "mean": statistics.fmean(v) * 1e3, "n": len(v)} for k, v in a.items()}
                  for name, a in acc.items()}
    return out


def replay(prof_dir: str | Path, cfg: dict, result: dict, latencies=(0.0, 0.001, 0.002), first_step: int = 2) -> list[str]:
    """rrfp's real steps in the simulator: each task's measured duration, the setting's keyed
    message delays plus ``L`` per message; the median over steps beside the real step time."""
    from rrfp.scheduler.hints import DEFAULT_HINT, resolve_hint
    from rrfp.scheduler.schedules import one_f_one_b_limits
    from rrfp.scheduler.tasks import Placement
    from rrfp.sim.costs import CostModel, StageCost
    from rrfp.sim.duration import CommModel
    from rrfp.sim.engine import simulate
    from rrfp.sim.jitter import LEVELS

    P, M = cfg["n_ranks"], cfg["n_microbatches"]
    comm = CommModel(CostModel(tuple(StageCost(F=1e-3, B=1e-3, I=5e-4, W=5e-4) for _ in range(P))),
                     jitter=LEVELS[cfg["comm"]], seed=cfg["seed"])
    dur: dict = collections.defaultdict(dict)
    for r in range(P):
        for e in json.loads(Path(prof_dir, f"rank{r}.json").read_text()):
            if e[0] == "task":
                dur[(e[1], e[2])][(r, e[5][-1], e[4])] = e[7] - e[6]
    lim = one_f_one_b_limits(P)
    lines = []
    steps = {rd["round"]: rd for rd in result["phases"][0]["rounds"]}
    kept = result["phases"][0].get("kept") or {}  # auto's kept hint (benchmarks.compare)
    for name, hint in HINTS.items():
        text = hint or kept.get(name) or cfg.get("hint") or DEFAULT_HINT
        spec, h, strict = resolve_hint(text, Placement(P), M, inflight_limit=lim)
        # The rounds' steps only (auto's measuring and trial steps have ids of their own).
        ids = sorted(s for (n, s) in dur if n == name and s >= first_step and s in steps)
        real = statistics.median(steps[s]["systems"][name]["step"] for s in ids) * 1e3
        for L in latencies:
            sim = [simulate(spec, h, lambda _s, rk, t, d=dur[(name, s)]: d[(rk, str(t[1])[-1], t[2])], strict=strict,
                            inflight_limit=lim, delay=lambda _s, src, dst, t, s=s: comm(s, src, dst, t) + L,
                            steps=1).makespan for s in ids]
            lines.append(f"{name}: L = {L * 1e3:.1f} ms: replayed {statistics.median(sim) * 1e3:.1f} ms, "
                         f"real {real:.1f} ms (median over {len(ids)} steps)")
    return lines


def main(argv=None) -> int:
    from .compare import setting_config
    from .launcher import launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", default="comm4", choices=["comm4"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="the setting's CI sizes")
    ap.add_argument("--out", default=None, help="folder for the per-rank events (default: a new temporary one)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected at least 1")
    cfg = setting_config(args.setting, quick=args.quick, systems=SYSTEMS, rounds=args.rounds)
    cfg["prof_dir"] = args.out or tempfile.mkdtemp(prefix="rrfp-profile-")
    os.makedirs(cfg["prof_dir"], exist_ok=True)
    load = os.getloadavg()[0]
    res = launch("benchmarks.profile_comm:rank_main", cfg["n_ranks"], cfg, timeout=600, threads=cfg["threads"])
    print(f"{args.setting}, {args.rounds} timed rounds, load average {load:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"events in {cfg['prof_dir']}")
    for r, by in summarize(cfg["prof_dir"], cfg["n_ranks"]).items():
        for name, ms in by.items():
            print(f"rank {r} {name}: " + "; ".join(f"{k} p50 {v['p50']:.2f} p90 {v['p90']:.2f} mean {v['mean']:.2f} "
                                                 f"(n {v['n']})" for k, v in sorted(ms.items())))
    for line in replay(cfg["prof_dir"], cfg, res.result):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
