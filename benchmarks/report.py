"""The machine, the Markdown tables and the targets of ``BENCHMARKS.md``."""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Sequence

import numpy as np

from .harness import median_ci, paired_speedup, summarize
from .markdown import table as _table
from .report_peers import model_line


def machine_info() -> dict[str, Any]:
    import torch
    import zmq

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count()
    return {
        "nproc": affinity,
        "cpu": model,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "platform": platform.platform(),
        "loadavg": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


# --------------------------------------------------------------------------- comparison


def phase_summary(phase: dict) -> dict[str, Any]:
    """Per system: step-time statistics, paired speedups, bubble and memory per rank."""
    timed = [r for r in phase["rounds"] if r["kind"] == "timed"]
    mem = next((r for r in phase["rounds"] if r["kind"] == "memory"), None)
    names = list(timed[0]["systems"]) if timed else []
    steps = {n: [r["systems"][n]["step"] for r in timed] for n in names}
    out: dict[str, Any] = {"names": names, "steps": steps, "systems": {}, "kept": dict(phase.get("kept") or {})}
    for n in names:
        bub = np.mean([[1.0 - b / e if e > 0 else 0.0 for b, e in zip(r["systems"][n]["busy"], r["systems"][n]["elapsed"])]
                       for r in timed], axis=0)
        infl = [max(r["systems"][n]["peak_inflight"][i] for r in timed) for i in range(len(bub))]
        out["systems"][n] = {
            "stats": summarize(steps[n]),
            "bubble": bub.tolist(),
            "peak_bytes": mem["systems"][n]["peak_bytes"] if mem else None,
            "peak_inflight": infl,
            "injected": float(np.mean([sum(r["systems"][n]["injected"]) for r in timed])) if timed else 0.0,
        }
    out["speedup"] = {a: {b: paired_speedup(steps[a], steps[b]) for b in names} for a in names}
    torch_names = [n for n in names if n.startswith("torch")]
    if torch_names:
        out["fastest_torch"] = min(torch_names, key=lambda n: out["systems"][n]["stats"]["median"])
    return out


_SHORT = {
    "rrfp default": "default", "rrfp default, 1F1B memory": "default@1F1B-mem",
    "rrfp default, GPipe memory": "default@GPipe-mem", "rrfp default, 1F1B limits": "default@1F1B-lim",
    "rrfp bf": "bf", "rrfp bfw": "bfw", "rrfp strict-1f1b": "strict-1f1b", "rrfp bf, 1F1B limits": "bf@1F1B-lim",
    "torch GPipe": "GPipe", "torch 1F1B": "1F1B", "torch Interleaved1F1B": "Int1F1B", "torch InterleavedZB": "IntZB",
    "torch ZBV": "ZBV", "torch DualPipeV": "DualPipeV",
    **{f"rrfp default, {p} memory": f"default@{p}-mem" for p in ("Int1F1B", "IntZB", "ZBV", "DualPipeV")},
    **{f"rrfp strict {p} order": f"strict-{p}" for p in ("Int1F1B", "IntZB", "ZBV", "DualPipeV")},
}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}" if b >= 0 else "-"


def render_setting(res: dict) -> tuple[str, dict[str, dict]]:
    cfg = res["config"]
    m = cfg["model"]
    mm = cfg.get("workload") == "multimodal"
    model = (f"multimodal: ViT-style encoder ({m.get('enc_layers', 1)} block of width {m.get('enc_width', 32)}) and "
             f"embeddings on stage 0, GPT decoder {m['n_layer']} blocks of d_model {m['d_model']} on stages 1-3"
             if mm else f"GPT {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads")
    data = ("digit captions, one sample per microbatch with 6 images and the others 0-6 (decoder length 18)"
            if mm else f"fixed length {cfg['seq_len']} tokens")
    if cfg.get("sleep"):
        data += (f"; every forward sleeps {cfg['sleep']['F'] * 1e3:.0f} ms and every backward "
                 f"{cfg['sleep']['B'] * 1e3:.0f} ms (the task's compute), on top of the injected jitter")
    virtual = [n for n in cfg["systems"] if n.startswith("torch ") and n not in ("torch GPipe", "torch 1F1B")
               or " memory" in n and n.split(", ")[-1] not in ("1F1B memory", "GPipe memory") or " order" in n]
    lines = [
        f"### {cfg['title']}",
        "",
        f"{cfg['n_ranks']} rank processes, {cfg['threads']} torch thread each; {model}; batch {cfg['batch_size']} "
        f"samples in {cfg['n_microbatches']} microbatches of {cfg['batch_size'] // cfg['n_microbatches']}, {data}"
        + ("" if mm or not virtual else f"; rows with virtual stages use 2 per rank ({2 * cfg['n_ranks']} stages of "
                                        f"{m['n_layer'] // (2 * cfg['n_ranks'])} layer(s); loop placement for the "
                                        "interleaved schedules, V for ZBV and DualPipeV)")
        + (f"; message delays {cfg['comm']} on every activation and gradient between ranks" if cfg.get("comm") else "")
        + (f". Hint of the `rrfp default` rows: `{cfg['hint']}` (`--hint`; not rrfp.Pipeline's default). "
           if cfg.get("hint") else f". Hint of the `rrfp default` rows: `{res.get('default_hint', '?')}`"
           + (" (rrfp.Pipeline's default: in each phase its measuring and trial steps run after the memory round, "
              "on batches and delays of their own, and the timed rounds run the hint it kept, named in the row; "
              "its peak bytes are the memory round's, where it runs the strict schedule). "
              if res.get("default_hint") == "auto" else ". "))
        + f"Run time {res.get('wall_seconds', 0):.0f} s.",
        "",
        "Calibrated base compute per rank ("
        + ("added to the sleeps; the jitter model's `e` is the sleep" if cfg.get("sleep") else "the jitter model's `e`")
        + "): "
        + ", ".join(f"rank {r}: F {c['F'] * 1e3:.2f} ms, B {c['B'] * 1e3:.2f} ms" for r, c in enumerate(res["calibration"]))
        + ".",
        "",
    ]
    if any(res.get("budgets") or []):
        lines += ["Memory budgets of the `1F1B memory` / `GPipe memory` rows (`memory_budget` in bytes: what "
                  "that schedule's order holds on the rank for this setting's measured per-microbatch sizes): "
                  + ", ".join(f"rank {r}: {_mib(b['1f1b'])} / {_mib(b['gpipe'])} MiB" for r, b in enumerate(res["budgets"]))
                  + ".", ""]
    summaries = {}
    for ph in res["phases"]:
        s = phase_summary(ph)
        s["level"] = ph["level"]
        s["varlen"] = ph["varlen"]
        summaries[ph["name"]] = s
        n_timed = len(s["steps"][s["names"][0]]) if s["names"] else 0
        what = "variable-length microbatches" if ph["varlen"] else "fixed-length microbatches"
        lines += [f"#### {ph['name']} (jitter {ph['level']}, {what}, {n_timed} timed rounds)", ""]
        if ph["varlen"]:
            lengths = [r["lengths"] for r in ph["rounds"] if r["kind"] == "timed"]
            flat = [x for l in lengths for x in l]
            if flat:
                lines += [f"rrfp pads each microbatch to its own longest sample: lengths {min(flat)}..{max(flat)} "
                          f"(mean {np.mean(flat):.0f}) tokens; PyTorch's schedules get every microbatch padded to "
                          f"{cfg['seq_len']} (its receive buffers have the first step's static shapes).", ""]
        ft = s.get("fastest_torch")
        ref_cols = [n for n in ("torch 1F1B", ft, "rrfp strict-1f1b") if n and n in s["names"]]
        ref_cols = list(dict.fromkeys(ref_cols))
        header = ["system", "median ms", "IQR ms", "min-max ms"] + [
            f"speedup vs {_SHORT.get(c, c)}" + (" (fastest torch)" if c == ft else "") for c in ref_cols
        ] + ["simulated ms", "real / simulated"] + [
            "bubble per rank", "peak saved activations MiB per rank", "peak in-flight"]
        rows = []
        kept = ph.get("kept") or {}
        pred = ((res.get("predicted") or {}).get(ph["name"]) or {})
        s["predicted"] = {n: v for n, v in pred.items() if n in s["names"]}
        s["sleep"] = bool(cfg.get("sleep"))
        s["calibrated"] = bool((res.get("sim_model") or {}).get(ph["name"]))
        for n in s["names"]:
            st = s["systems"][n]["stats"]
            sim = s["predicted"].get(n)
            rows.append([
                f"{n} (auto kept `{kept[n]}`)" if n in kept else n, _ms(st["median"]), f"{_ms(st['p25'])}-{_ms(st['p75'])}", f"{_ms(st['min'])}-{_ms(st['max'])}",
                *[f"{s['speedup'][n][c]:.2f}x" for c in ref_cols],
                _ms(float(np.median(sim))) if sim else "-",
                f"{np.median(np.asarray(s['steps'][n]) / np.asarray(sim)):.3f}" if sim else "-",
                " ".join(f"{b:.2f}" for b in s["systems"][n]["bubble"]),
                " ".join(_mib(b) for b in (s["systems"][n]["peak_bytes"] or [])),
                " ".join(str(int(v)) if v >= 0 else "-" for v in s["systems"][n]["peak_inflight"]),
            ])
        lines += [_table(header, rows), ""]
        if s["predicted"]:
            lines += [model_line((res.get("sim_model") or {}).get(ph["name"])), ""]
        lines += ["Speedup of the row's system over the column's (median over rounds of the paired ratio "
                  "t_column / t_row):", ""]
        cols = s["names"]
        lines += [_table(["", *[_SHORT.get(c, c) for c in cols]],
                         [[_SHORT.get(a, a), *[f"{s['speedup'][a][b]:.2f}" for b in cols]] for a in cols]), ""]
        lines += [f"Gradients: every system in every round matched (worst |diff| / (atol + rtol |ref|) = "
                  f"{ph['worst_grad_ratio']:.3f}, must be <= 1).", ""]
    return "\n".join(lines), summaries


# --------------------------------------------------------------------------- micro


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 1024} KiB"


def render_micro(res: dict) -> str:
    arb = res["arbiter"]
    hints = list(arb)
    sizes = sorted({int(k) for h in hints for k in arb[h]})
    lines = ["### Arbiter decision time", "",
             "CPU microseconds per decision (`next()` + `complete()`, plus the `mark_input()` that refills the "
             "ready set; thread CPU time, so other work on the machine does not count), median of 5 runs of "
             "several thousand cycles, against the ready set's size. `1f1b` is a total-order hint (PyTorch's "
             "1F1B order) in readiness mode.", ""]
    lines += [_table(["hint", *[str(n) for n in sizes]],
                     [[h, *[f"{arb[h][str(n)]['median']:.2f}" for n in sizes]] for h in hints]), ""]
    lines += ["### Runtime overhead per task", "",
              "Stages that do nothing (`x * w` on a one-element tensor). Overhead = time per task minus the "
              "time per task of the same tasks run by hand with no runtime (`sequential_runner` in "
              "`benchmarks/micro.py`: the same stage modules, each stage's forward on a detached copy of the "
              "previous output and each stage's backward its own autograd engine call, as any pipeline runtime "
              "must, measured in the same process right after each step). In one process (`LocalPipeline`, "
              "every rank on one event loop, one thread, never waiting) the thread's CPU time is the measure: "
              "fastest step against the fastest reference. Across 2 processes only wall time means anything: "
              "a rank's fastest step over its own tasks (the ranks run concurrently on 2 cores, so it includes "
              "waiting for messages), against the reference's wall time per task.", ""]
    rows = []
    for h, r in res["overhead_local"].items():
        rows.append([f"rrfp {h}: LocalPipeline, 4 ranks in 1 process", r["tasks"], f"{r['per_task_us']:.1f}",
                     f"{r['min_per_task_us']:.1f}", f"{r['cpu_per_task_us']:.1f}",
                     f"{r['ref_cpu_per_task_us']:.1f} (CPU)", f"{r['overhead_cpu_us']:.1f} (CPU)"])
    for name, r in res["overhead_2proc"].items():
        rows.append([f"{name}, 2 processes", r["tasks_per_rank"], f"{r['per_task_us']:.1f}",
                     f"{r['min_per_task_us']:.1f}", "-", f"{r['ref_wall_per_task_us']:.1f} (wall)",
                     f"{r['overhead_wall_us']:.1f} (wall)"])
    lines += [_table(["pipeline", "tasks per step (per rank)", "wall us/task (median step)",
                      "wall us/task (fastest step)", "CPU us/task", "same tasks, no runtime, us/task",
                      "overhead us/task"], rows), ""]
    lines += ["### Transports", "",
              "One-way latency (half the median ping-pong round trip, the payload echoed back) and streaming "
              "throughput (back-to-back messages, then a one-element acknowledgement). ZeroMQ and gloo "
              "between 2 processes; the fake transport in one process through the codec. Each size is one "
              "short run: from 1 MiB up, allocation and page faults make single rows noisy (not monotonic "
              "in size).", ""]
    tr = res["transport"]
    names = list(tr)
    header = ["size", *[f"{n} latency us" for n in names], *[f"{n} MB/s" for n in names]]
    rows = []
    for size in res["sizes"]:
        k = str(size)
        rows.append([_size(size), *[f"{tr[n][k]['latency_us']:.0f}" for n in names],
                     *[f"{tr[n][k]['throughput_MBps']:.0f}" for n in names]])
    lines += [_table(header, rows), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- targets


def _ratio(s: dict, a: str, b: str) -> str:
    """Paired speedup of ``a`` over ``b`` with the quartiles of the per-round ratios."""
    r = np.asarray(s["steps"][b]) / np.asarray(s["steps"][a])
    q1, q3 = np.percentile(r, [25, 75])
    lo, hi = median_ci(r)
    return (f"{s['speedup'][a][b]:.2f}x (per-round ratios: quartiles {q1:.2f}-{q3:.2f}, n={r.size}; "
            f"95% CI of the median {lo:.2f}-{hi:.2f})")


R1, RG = "rrfp default, 1F1B memory", "rrfp default, GPipe memory"
T1, TG = "torch 1F1B", "torch GPipe"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _ideal_value(ideal: dict | None, phase: str, which: str) -> float | None:
    return ((ideal or {}).get(phase) or {}).get(which)


def _ideal_text(ideal: dict | None, phase: str, which: str) -> str:
    v = _ideal_value(ideal, phase, which)
    return f"{v:.2f}x" if v else "-"


def simulated_speedup(s: dict, a: str, b: str) -> float | None:
    """The simulator's speedup of row ``a`` over row ``b`` on the phase's predictions (the
    calibrated model where the setting kept records, :mod:`benchmarks.report_peers`): median
    over the timed rounds of ``sim_b / sim_a``; None without both."""
    pred = s.get("predicted") or {}
    if not pred.get(a) or not pred.get(b):
        return None
    return float(np.median(np.asarray(pred[b]) / np.asarray(pred[a])))


def _sim_text(s: dict, a: str, b: str, ideal: dict | None, phase: str, which: str) -> str:
    """The simulator's column: its ideal (no runtime cost) and, beside it, the calibrated
    model's speedup on the run's own delays."""
    cal = simulated_speedup(s, a, b)
    ide = _ideal_text(ideal, phase, which)
    return f"{ide} ideal; {cal:.2f}x calibrated" if cal else ide


def targets(compare: dict[str, dict], micro: dict | None, ideal: dict | None = None) -> list[list[str]]:
    """[target, measured, verdict, simulator's ideal] rows: the real runtime's targets."""
    ideal = ideal or {}
    rows: list[list[str]] = []

    def row(setting: str, phase: str, a: str, b: str, goal: float, label: str, which: str) -> None:
        s = compare.get(setting, {}).get(phase)
        if not s or a not in s["names"] or b not in s["names"]:
            return
        v = s["speedup"][a][b]
        verdict = _verdict(v >= goal)
        best = _ideal_value(ideal.get(setting), phase, which)
        if v < goal and best and best < goal:
            # The rule: "where a target is out of reach of the simulator's zero-overhead ideal
            # for its setting, show the ideal and say so".
            verdict += f" (out of reach of the ideal, {best:.2f}x)"
        rows.append([label, _ratio(s, a, b), verdict, _sim_text(s, a, b, ideal.get(setting), phase, which)])

    row("jitter4", "J2", R1, T1, 1.15, "4 ranks, J2, at 1F1B's memory: default hint >= 1.15x Schedule1F1B", "1f1b")
    row("jitter4", "J2", RG, TG, 1.25, "4 ranks, J2, at GPipe's memory: default hint >= 1.25x ScheduleGPipe", "gpipe")
    s = compare.get("jitter4", {}).get("J0")
    if s and {R1, RG, T1, TG} <= set(s["names"]):
        ft = min((T1, TG), key=lambda n: s["systems"][n]["stats"]["median"])
        mine = R1 if ft == T1 else RG
        row("jitter4", "J0", mine, ft, 0.98,
            f"4 ranks, J0: default hint >= 0.98x the fastest PyTorch schedule at equal memory ({ft[6:]}, against "
            f"the default hint at {ft[6:]}'s memory)", "1f1b" if ft == T1 else "gpipe")
    row("comm4", "comm J2", R1, T1, 1.25, "message delays (J2), at 1F1B's memory: default hint >= 1.25x Schedule1F1B", "1f1b")
    row("multimodal4", "images 0-6", R1, T1, 1.3, "multimodal, at 1F1B's memory: default hint >= 1.3x Schedule1F1B", "1f1b")
    if micro:
        for h, r in micro["overhead_local"].items():
            if not h.endswith(", codec") or h.startswith("strict"):
                continue
            v = r["overhead_cpu_us"]
            reps = r.get("reps_overhead_cpu_us")
            extra = f" (median of {len(reps)} runs: {', '.join(f'{x:.1f}' for x in reps)})" if reps else ""
            rows.append([f"runtime overhead per task with the codec, in process (rrfp {h.split(',')[0]}, CPU time) <= 50 us",
                         f"{v:.1f} us{extra}", _verdict(v <= 50), "-"])
        for h, by_n in micro["arbiter"].items():
            r = by_n.get("32", by_n.get(32))
            if r and h in ("bf", "bfw", "1f1b"):
                rows.append([f"arbiter decision <= 5 us with 32 ready tasks ({h}, CPU time)", f"{r['median']:.2f} us",
                             _verdict(r["median"] <= 5), "-"])
    return rows


STEP_TOL, RATIO_TOL = 0.05, 0.05
"""Issue 33's goals for the calibrated simulator on real rows: each rrfp row's step time within
5% of the simulated one, and its speedup over strict 1F1B within 0.05 of the simulated ratio."""


def calibration_targets(compare: dict[str, dict]) -> list[list[str]]:
    """[target, measured, verdict, simulated] rows, per setting and phase whose predictions ran
    on the calibrated model (settings whose tasks sleep have their own rows in
    :mod:`benchmarks.report_peers`): every rrfp row with a prediction against it."""
    rows = []
    for setting, phases in compare.items():
        for name, s in phases.items():
            if s.get("sleep") or not s.get("calibrated"):
                continue
            rrfp = [n for n in s["names"] if n.startswith("rrfp ") and (s.get("predicted") or {}).get(n)]
            if not rrfp:
                continue
            ratio = {n: float(np.median(np.asarray(s["steps"][n]) / np.asarray(s["predicted"][n]))) for n in rrfp}
            worst = max(rrfp, key=lambda n: abs(ratio[n] - 1))
            ok = sum(abs(r - 1) <= STEP_TOL for r in ratio.values())
            rows.append([f"{setting}, {name}: each rrfp row's real step within {STEP_TOL:.0%} of the calibrated "
                         "simulator's", f"{ok} of {len(rrfp)} rows; real / simulated {min(ratio.values()):.3f}-"
                         f"{max(ratio.values()):.3f} (worst {_SHORT.get(worst, worst)})",
                         _verdict(ok == len(rrfp)), "-"])
            base = "rrfp strict-1f1b"
            if base not in rrfp:
                continue
            diffs = {n: s["speedup"][n][base] - simulated_speedup(s, n, base) for n in rrfp if n != base}
            if not diffs:
                continue
            w = max(diffs, key=lambda n: abs(diffs[n]))
            ok = sum(abs(d) <= RATIO_TOL for d in diffs.values())
            rows.append([f"{setting}, {name}: each rrfp row's speedup over strict 1F1B within {RATIO_TOL} of the "
                         "calibrated simulator's", f"{ok} of {len(diffs)} rows; real - simulated "
                         f"{min(diffs.values()):+.3f} to {max(diffs.values()):+.3f} (worst {_SHORT.get(w, w)})",
                         _verdict(ok == len(diffs)), "-"])
    return rows


def equal_memory(compare: dict[str, dict], ideal: dict | None) -> list[list[str]]:
    """One row per setting and phase: the default hint at 1F1B's and GPipe's bytes against
    PyTorch's schedule that holds them, with both systems' peak bytes per rank."""
    rows = []
    for setting, phases in compare.items():
        for name, s in phases.items():
            for a, b, which in ((R1, T1, "1f1b"), (RG, TG, "gpipe")):
                if a not in s["names"] or b not in s["names"]:
                    continue
                pa, pb = s["systems"][a]["peak_bytes"] or [], s["systems"][b]["peak_bytes"] or []
                rows.append([setting, name, f"{_SHORT[a]} vs {b[6:]}", _ratio(s, a, b),
                             " ".join(_mib(x) for x in pa), " ".join(_mib(x) for x in pb),
                             _sim_text(s, a, b, (ideal or {}).get(setting), name, which)])
    return rows


def candidates(compare: dict[str, dict], results: dict) -> list[list[str]]:
    """One row per setting, phase, memory budget and candidate hint (``--candidates``): the
    default hint and the candidate against the PyTorch schedule of that memory, and the
    candidate against the default hint, all paired per round."""
    rows = []
    for setting, phases in compare.items():
        cfg = results["compare"][setting]["config"]
        default = cfg.get("hint") or results["compare"][setting].get("default_hint", "default")
        for name, s in phases.items():
            for h in cfg.get("candidates") or []:
                for label, dflt, torch_row in (("1F1B", R1, T1), ("GPipe", RG, TG)):
                    c = f"rrfp {h}, {label} memory"
                    if not {c, dflt, torch_row} <= set(s["names"]):
                        continue
                    rows.append([setting, name, label, f"`{h}`",
                                 f"`{s.get('kept', {}).get(dflt, default)}` " + _ratio(s, dflt, torch_row),
                                 _ratio(s, c, torch_row), _ratio(s, c, dflt)])
    return rows


def interpret(summaries: dict[str, dict], sim: dict | None) -> list[str]:
    """Bullet lines that read the comparison tables: readiness gain (same runtime, readiness
    against fixed order), runtime parity (same schedule, rrfp against PyTorch), memory-matched
    readiness, and the simulator's ideal where known."""
    out = []
    for setting, phases in summaries.items():
        for name, s in phases.items():
            sp = s["speedup"]
            if not {"rrfp bf", "rrfp strict-1f1b"} <= set(s["names"]):
                continue
            bits = [f"readiness (rrfp bf over rrfp strict-1f1b, same runtime) {sp['rrfp bf']['rrfp strict-1f1b']:.2f}x"]
            ideal = ((sim or {}).get(setting) or {}).get(s.get("level", name))
            if ideal and "bf" in ideal:
                bits[-1] += f" (simulated ideal {ideal['bf']:.2f}x)"
            if "rrfp bf, 1F1B limits" in s["names"]:
                bits.append(f"at 1F1B's memory {sp['rrfp bf, 1F1B limits']['rrfp strict-1f1b']:.2f}x")
            if "torch 1F1B" in s["names"]:
                what = "same order, rrfp padding each microbatch to its own length" if s.get("varlen") else "same order"
                bits.append(f"runtime (rrfp strict-1f1b over torch 1F1B, {what}) {sp['rrfp strict-1f1b']['torch 1F1B']:.2f}x")
            out.append(f"- {setting}, {name}: " + "; ".join(bits) + ".")
    return out
