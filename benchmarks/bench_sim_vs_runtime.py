"""How closely the calibrated simulator predicts the real runtime, at 4, 8 and 16 ranks.

    python -m benchmarks.bench_sim_vs_runtime [--ranks 4,8,16] [--work sleep,compute] [--rounds 3]
    python -m benchmarks.bench_sim_vs_runtime --from DIR          # analyse a recorded run again
    python -m benchmarks.bench_sim_vs_runtime --cores             # the core-sharing model alone

Each setting runs in the benchmark harness (:mod:`benchmarks.compare`: rank processes, the same
keyed injected delays as the simulator's, gradients checked), every rrfp row with its task
records, and the settings alternate: for each rank count, sleep-based tasks (``ranks8``'s: F
sleeps 10 ms, B 20 ms, on a one-layer-per-stage GPT) then real compute (the same model without
the sleeps; ``jitter4``'s model at 4 ranks). Rows: strict 1F1B, its split (``strict-split``),
``bf`` (limit 32 and 1F1B's), ``wfloat`` at 1F1B's limits.

The calibrated model (:func:`benchmarks.sim_pred.fit_model`) is read off the strict rows only
(strict 1F1B for F and B, strict-split for I and W, as ``auto`` measures a job): each task's own
cost in place, the runtime's time per task, per message and per step. Every row is then
predicted: the readiness rows' predictions are out of sample. Printed per row: real and
simulated step time (median), real/simulated (median and range over rounds), the same with the
core-sharing rescale (the costs rescaled from the duty they were measured at to each row's,
with the machine's cores and its other load as the ranks see it, measured by
:func:`benchmarks.sim_pred.machine_background` before each setting), uncalibrated, and the
speedup over strict 1F1B, real and simulated. Goals (issue 33): within 5%, and
speedups within 0.03, on a quiet machine; a loaded machine's figures are printed with the load.

``--fixture PATH`` writes one setting's recorded profile rows and step times as the fixture of
``tests/test_sim_calibration.py``. ``--cores`` checks :meth:`Calibration.stretch
<rrfp.sim.calibration.Calibration.stretch>` against N processes that alternate busy loops and
sleeps at a given duty.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = {  # row -> (hint, in-flight limit), the rows each setting runs
    "rrfp strict-1f1b": ("strict-1f1b", 32),
    "rrfp strict-split": ("strict-split", 32),
    "rrfp bf": ("bf", 32),
    "rrfp bf, 1F1B limits": ("bf", "1f1b"),
    "rrfp wfloat, 1F1B limits": ("wfloat", "1f1b"),
}
STRICT = "rrfp strict-1f1b"


# --------------------------------------------------------------------------- recording


def rank_main(cfg: dict) -> dict | None:
    """One rank of :mod:`benchmarks.compare` with :data:`ROWS` and each rrfp row's task records
    and step edges (the records' clock, ``time.perf_counter``), saved to
    ``cfg["rec_dir"]/rank<r>.json``."""
    import torch.distributed as dist

    from . import compare, systems

    systems.RRFP_SYSTEMS.update({n: {"hint": h, "limit": lim} for n, (h, lim) in ROWS.items()})
    log: dict = {}
    init0, step0 = compare.RrfpSystem.__init__, compare.RrfpSystem.step

    def init(self, name, spec, *a, **kw):
        init0(self, name, spec, *a, **kw)
        self.pipe.runtime.loop.record = True

    def step(self, batch):
        t0 = time.perf_counter()
        step0(self, batch)
        t1 = time.perf_counter()
        tasks = [(r.task.stage, str(r.task.kind), r.task.mb, r.start, r.end) for r in self.pipe.last_stats.records]
        log.setdefault(self.name, {})[batch.step_id] = {"rank": dist.get_rank(), "t0": t0, "t1": t1, "tasks": tasks}

    compare.RrfpSystem.__init__, compare.RrfpSystem.step = init, step
    out = compare.rank_main(cfg)
    Path(cfg["rec_dir"], f"rank{dist.get_rank()}.json").write_text(json.dumps(log))
    return out


def setting(n_ranks: int, work: str, rounds: int, level: str) -> dict:
    """The configuration of one recorded setting (module docstring)."""
    from .settings import setting_config

    base = "jitter4" if (n_ranks, work) == (4, "compute") else "ranks8"
    cfg = setting_config(base, systems=[STRICT], rounds=rounds)
    cfg["systems"] = list(ROWS)
    cfg["phases"] = [{"name": level, "level": level, "varlen": False, "rounds": rounds}]
    if base == "ranks8":
        cfg["n_ranks"], cfg["model"] = n_ranks, {**cfg["model"], "n_layer": n_ranks}
        cfg["title"] = f"{n_ranks} ranks, {work}"
    if work == "compute":
        cfg.pop("sleep", None)
    return cfg


def record(n_ranks: int, work: str, rounds: int, level: str, out: Path, timeout: float = 900.0) -> Path:
    """Run one setting with records into ``out/<ranks><work>/``; returns that folder."""
    from .launcher import launch
    from .sim_pred import machine_background

    cfg = setting(n_ranks, work, rounds, level)
    d = out / f"{n_ranks}{work}"
    d.mkdir(parents=True, exist_ok=True)
    cfg["rec_dir"] = str(d)
    cores, bg = machine_background()
    load0, t = os.getloadavg(), time.time()
    res = launch("benchmarks.bench_sim_vs_runtime:rank_main", n_ranks, cfg, timeout=timeout, threads=cfg["threads"])
    meta = {"cores": cores, "background": bg, "load": [load0, os.getloadavg()], "wall": time.time() - t}
    (d / "result.json").write_text(json.dumps({"result": res.result, **meta}))
    return d


def load_recorded(d: Path) -> tuple[dict, dict, dict]:
    """``(result, meta, recorded)`` of a folder :func:`record` wrote; ``recorded``: row -> step id
    -> per-rank records (:func:`benchmarks.sim_pred.fit_model`'s form)."""
    raw = json.loads((d / "result.json").read_text())
    res = raw.pop("result")
    P = res["config"]["n_ranks"]
    recorded: dict = {}
    for r in range(P):
        for row, steps in json.loads((d / f"rank{r}.json").read_text()).items():
            for sid, rs in steps.items():
                recorded.setdefault(row, {}).setdefault(int(sid), []).append({"rank": r, **rs})
    raw.setdefault("cores", len(os.sched_getaffinity(0)))
    raw.setdefault("background", 0.0)
    return res, raw, recorded


# --------------------------------------------------------------------------- analysis


def compare_rows(res: dict, meta: dict, recorded: dict) -> dict:
    """Per row: real and simulated step times of the timed rounds (the calibrated model, and
    the uncalibrated one), and the fitted model."""
    from .sim_pred import fit_model, predict, timed_step_ids

    cfg, cal, ph = res["config"], res["calibration"], res["phases"][0]
    model = fit_model(cfg, cal, 0, ph, recorded)
    shared = fit_model(cfg, cal, 0, ph, recorded, cores=meta["cores"], background=meta["background"])
    ids = timed_step_ids(0, ph)
    out = {"model": model, "shared": shared, "rows": {}}
    for row, (hint, limit) in ROWS.items():
        if row not in recorded:
            continue
        real = [max(rs["t1"] - rs["t0"] for rs in recorded[row][sid]) for sid in ids]
        out["rows"][row] = {"real": real, "sim": predict(cfg, cal, 0, ph, hint, limit=limit, model=model),
                            "cores": predict(cfg, cal, 0, ph, hint, limit=limit, model=shared),
                            "raw": predict(cfg, cal, 0, ph, hint, limit=limit)}
    return out


def report(name: str, res: dict, meta: dict, got: dict) -> list[str]:
    import numpy as np

    rows = got["rows"]
    lines = [f"{name}: {res['config']['n_ranks']} ranks, {'sleep-based' if res['config'].get('sleep') else 'real compute'}"
             f", {res['phases'][0]['level']}, {len(rows[STRICT]['real'])} timed rounds; load "
             f"{meta['load'][0][0]:.1f} -> {meta['load'][1][0]:.1f}, {meta['cores']} cores, background "
             f"{meta['background']:.1f}; model: {got['model'].calibration.describe()} ({got['model'].source}; "
             f"the core-sharing rescale measured at duty {got['shared'].calibration.duty:.2f})"]
    lines.append(f"  {'row':26s} {'real ms':>8s} {'min':>7s} {'sim ms':>8s} {'real/sim':>8s} {'range':>13s} "
                 f"{'rescaled':>8s} {'uncal.':>7s} {'speedup real':>12s} {'sim':>6s} {'diff':>6s}")
    for row, v in rows.items():
        r = np.asarray(v["real"]) / np.asarray(v["sim"])
        raw = np.median(np.asarray(v["real"]) / np.asarray(v["raw"]))
        resc = np.median(np.asarray(v["real"]) / np.asarray(v["cores"]))
        sp_real = np.median(np.asarray(rows[STRICT]["real"]) / np.asarray(v["real"]))
        sp_sim = np.median(np.asarray(rows[STRICT]["sim"]) / np.asarray(v["sim"]))
        lines.append(f"  {row:26s} {1e3 * np.median(v['real']):8.1f} {1e3 * min(v['real']):7.1f} "
                     f"{1e3 * np.median(v['sim']):8.1f} {np.median(r):8.3f} {r.min():6.3f}-{r.max():6.3f} {resc:8.3f} {raw:7.3f} "
                     f"{sp_real:12.3f} {sp_sim:6.3f} {sp_real - sp_sim:+6.3f}")
    return lines


def write_fixture(path: Path, res: dict, meta: dict, recorded: dict) -> None:
    """One setting's recorded profile rows (task records, times from the step's first start on
    any rank, rounded to the microsecond: the ranks share one clock) and every row's real step
    times: the fixture of
    ``tests/test_sim_calibration.py``."""
    from .sim_pred import PROFILE_ROWS, timed_step_ids

    ph = res["phases"][0]
    ids = timed_step_ids(0, ph)

    def rel(rs: dict, t0: float) -> dict:
        return {"rank": rs["rank"], "t0": round(rs["t0"] - t0, 6), "t1": round(rs["t1"] - t0, 6),
                "tasks": [[s, k, m, round(a - t0, 6), round(b - t0, 6)] for s, k, m, a, b in rs["tasks"]]}

    cfg = {k: res["config"][k] for k in ("n_ranks", "n_microbatches", "seed", "sleep", "comm") if k in res["config"]}
    out = {"config": cfg, "calibration": res["calibration"], "phase": {"name": ph["name"], "level": ph["level"],
                                                                       "rounds": len(ids)},
           "machine": {k: meta[k] for k in ("cores", "background", "load")},
           "rows": {row: {"hint": ROWS[row][0], "limit": ROWS[row][1],
                          "step": [max(rs["t1"] - rs["t0"] for rs in recorded[row][sid]) for sid in ids]}
                    for row in ROWS if row in recorded},
           "recorded": {row: {str(sid): [rel(rs, min(x["t0"] for x in recorded[row][sid])) for rs in recorded[row][sid]]
                              for sid in ids}
                        for row in PROFILE_ROWS if row in recorded}}
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")


# --------------------------------------------------------------------------- cores


def _duty_worker(args: tuple) -> tuple[float, float, float]:
    """Alternate busy loops of ``busy`` CPU seconds and sleeps of ``idle`` seconds for
    ``seconds``: ``(wall, cpu, total)``, the busy periods' wall and CPU seconds and the time
    run."""
    busy, idle, seconds = args
    wall = cpu = 0.0
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < busy:
            pass
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.thread_time() - c0
        if idle:
            time.sleep(idle)
    return wall, cpu, time.perf_counter() - t_start


def check_cores(counts=(1, 2, 4, 8, 16), duties=(0.1, 0.5, 1.0), busy: float = 0.002, seconds: float = 2.0) -> list[str]:
    """:meth:`Calibration.stretch` against N processes busy at a duty: each alternates busy
    loops of ``busy`` CPU seconds and sleeps; measured, the busy periods' wall time over their
    CPU time; modelled, ``stretch(N, duty measured)`` with the cores and the background the
    machine had just before (:func:`benchmarks.sim_pred.machine_background`)."""
    import multiprocessing as mp

    from rrfp.sim.calibration import Calibration

    from .sim_pred import machine_background

    lines = []
    ctx = mp.get_context("fork")
    for duty in duties:
        idle = busy * (1 - duty) / duty
        for N in counts:
            cores, bg = machine_background(0.3)
            with ctx.Pool(N) as pool:
                got = pool.map(_duty_worker, [(busy, idle, seconds)] * N)
            wall, cpu, total = (sum(g[i] for g in got) for i in range(3))
            u = min(1.0, wall / total)
            lines.append(f"  N {N:2d}, duty {duty:.1f} (busy {u:.2f} of the time): stretch measured {wall / cpu:5.2f}, "
                         f"model {Calibration(cores=cores, background=bg).stretch(N, u):5.2f} "
                         f"({cores} cores, background {bg:.1f}; on a quiet machine {Calibration(cores=cores).stretch(N, u):5.2f})")
    return [f"load {os.getloadavg()[0]:.1f}"] + lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8,16", help="rank counts, comma-separated")
    ap.add_argument("--work", default="sleep,compute", help="sleep, compute or both (alternated)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per setting")
    ap.add_argument("--level", default="J2", help="injected jitter level (J0-J3)")
    ap.add_argument("--out", default=None, help="folder for the records (default: a new temporary one)")
    ap.add_argument("--from", dest="source", default=None,
                    help="analyse the records in this folder (one setting's, or one per setting), run nothing")
    ap.add_argument("--fixture", default=None, help="write the first setting's records as the test fixture here")
    ap.add_argument("--cores", action="store_true", help="check the core-sharing model only")
    args = ap.parse_args(argv)
    if args.cores:
        print("\n".join(check_cores()))
        return 0
    if args.source:
        src = Path(args.source)
        dirs = [src] if (src / "result.json").is_file() else sorted(p.parent for p in src.glob("*/result.json"))
    else:
        import tempfile

        out = Path(args.out or tempfile.mkdtemp(prefix="rrfp-calib-"))
        dirs = []
        for p in (int(x) for x in args.ranks.split(",")):
            for work in args.work.split(","):
                dirs.append(record(p, work, args.rounds, args.level, out))
                print(f"recorded {dirs[-1]}", flush=True)
    for i, d in enumerate(dirs):
        res, meta, recorded = load_recorded(d)
        print("\n".join(report(d.name, res, meta, compare_rows(res, meta, recorded))), flush=True)
        if args.fixture and i == 0:
            write_fixture(Path(args.fixture), res, meta, recorded)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
