"""The report's rows for PyTorch's zero-bubble schedules at their own memory and for many real
ranks against the simulator: the simulator's predictions (:mod:`benchmarks.sim_pred`), the
tables and the targets.

Targets (ratios measured side by side in one run):

- at each zero-bubble schedule's own memory (``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), rrfp's default at least 1.00x that schedule at
  J0 and at least 1.10x at J2 and under message delays; where the simulator's ideal at that
  memory (the memory-aware ceiling: the schedule's order over the lower bound of any schedule
  within those bytes) is lower than the goal, at least 0.95 of that ceiling (it is shown);
- 8 and 16 real ranks: real step time within 5% of the calibrated simulator's, strict orders
  and readiness hints alike; the default's real speedup over strict 1F1B within 0.03 of the
  simulated speedup (issue 33).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.tasks import Placement

from .markdown import table as _table
from .sim_pred import fit_model, full_backward, held_applies, predict, predict_bounded, ratio_summary
from .systems import (PEERS, RRFP_SYSTEMS, ZERO_BUBBLE, candidate_systems, kept_hint, peer_default, peer_strict,
                      torch_order_hint)

PEERS_TITLE = "PyTorch's virtual-stage schedules at their own memory"
RANKS_TITLE = "Many real ranks against the simulator"
PEER_GOALS = {"J0": 1.00}
PEER_GOAL = 1.10  # J2 and message delays
BOUND = "memory-aware bound: "
"""Prefix of a zero-bubble schedule's label in :func:`predictions`: per round, the smallest
memory-aware lower bound (seconds) of its two rows, at the schedule's measured bytes."""
STRICT_TOL, READY_TOL, SPEEDUP_TOL = 0.05, 0.05, 0.03


def _timed(phase: dict, name: str) -> list[float]:
    return [r["systems"][name]["step"] for r in phase["rounds"] if r["kind"] == "timed"]


def _memory(phase: dict, name: str) -> list[float] | None:
    mem = next((r for r in phase["rounds"] if r["kind"] == "memory"), None)
    return mem["systems"][name]["peak_bytes"] if mem and name in mem["systems"] else None


# --------------------------------------------------------------------------- predictions


def predictions(res: dict) -> dict[str, dict[str, list[float]]]:
    """Per phase and row, the simulated step time of each timed round: the zero-bubble rows
    (the order strictly, the default hint at the schedule's measured bytes), with, under
    ``BOUND + label``, the memory-aware bound at those bytes (the smaller of the two rows'
    bounds, as the suite's ceiling takes the smallest over a point's runs) and, where the
    setting kept its strict rows' task records (the calibrated model, :func:`calibrated`) or
    its tasks sleep, every row with one stage per rank (:func:`flat_rows`)."""
    cfg, cal = res["config"], res["calibration"]
    default = cfg.get("hint") or res.get("default_hint") or "bf"
    out: dict[str, dict[str, list[float]]] = {}
    for pi, ph in enumerate(res["phases"]):
        names = list(ph["rounds"][0]["systems"])
        rows: dict[str, list[float]] = {}
        one = ByBackward(res, pi, ph)
        model = one.all
        placed: dict[str, ByBackward] = {}  # a placement's models, fitted once for its peers
        for label, p in PEERS.items():
            peak = _memory(ph, p["torch"])
            if not {peer_default(label), peer_strict(label), p["torch"]} <= set(names) or not peak:
                continue
            sb = [b[p["placement"]] for b in res["virtual_stage_bytes"]]
            budgets = [int(x) for x in peak]
            kw = dict(n_virtual=2, placement=p["placement"], bound_budgets=budgets, stage_bytes=sb)
            pl = p["placement"]
            by = placed[pl] if pl in placed else placed.setdefault(pl, ByBackward(res, pi, ph, 2, pl, fallback=model,
                                                                                  one=one))
            kept = kept_hint(ph, peer_default(label), default)
            rows[peer_strict(label)], b_strict = predict_bounded(cfg, cal, pi, ph, p["strict"],
                                                                 model=by(p["strict"], peer_strict(label)), **kw)
            rows[peer_default(label)], b_default = predict_bounded(cfg, cal, pi, ph, kept, budgets=budgets,
                                                                   model=by(kept, peer_default(label)), **kw)
            rows[BOUND + label] = [min(a, b) for a, b in zip(b_strict, b_default)]
        if cfg.get("sleep") or model is not None:
            rows.update(flat_rows(res, pi, ph, names, default, one if model is not None else None))
        out[ph["name"]] = rows
    return out


TORCH_ORDERS = {"torch 1F1B": "strict-1f1b", "torch GPipe": "strict-gpipe"}
"""PyTorch's one-stage-per-rank schedules as the simulator predicts them: their order, run
strictly on rrfp's calibrated model (PyTorch's own runtime costs are not modelled)."""


def flat_rows(res: dict, pi: int, ph: dict, names, default: str, model) -> dict[str, list[float]]:
    """Per row with one stage per rank (rrfp's, a budget row's at its schedule's bytes, and
    PyTorch's 1F1B and GPipe by :data:`TORCH_ORDERS`), the simulated step time of each timed
    round on the model ``model(hint)`` gives (a :class:`ByBackward`; None: uncalibrated). A budget row's bytes: the rank's budget
    (``res["budgets"]``) over what 1F1B holds there, ``P - r`` microbatches, as each
    microbatch's size (exact where microbatches are alike; the multimodal and variable-length
    settings' vary)."""
    cfg, cal = res["config"], res["calibration"]
    P = cfg["n_ranks"]
    systems = {**RRFP_SYSTEMS, **candidate_systems(cfg.get("candidates") or [])}
    budgets = res.get("budgets") or []
    by = model or (lambda hint: None)
    rows: dict[str, list[float]] = {}
    for n in names:
        if n in TORCH_ORDERS:
            rows[n] = predict(cfg, cal, pi, ph, TORCH_ORDERS[n], model=by(TORCH_ORDERS[n]))
            continue
        spec = systems.get(n)
        if not spec or spec.get("budget_from") or spec.get("virtual", 1) != 1:
            continue
        kw: dict = {}
        if spec.get("budget"):
            if len(budgets) != P or not all(b.get(spec["budget"]) and b.get("1f1b") for b in budgets):
                continue
            kw = dict(budgets=[int(b[spec["budget"]]) for b in budgets],
                      stage_bytes=[[max(1, int(b["1f1b"]) // (P - r))] for r, b in enumerate(budgets)])
        hint = kept_hint(ph, n, default)
        rows[n] = predict(cfg, cal, pi, ph, hint, limit=spec["limit"], model=by(hint, n) if model else None, **kw)
    return rows


def splits(hint: str, cfg: dict, n_virtual: int = 1, placement: str = "loop") -> bool | None:
    """Whether ``hint`` runs a split backward on the setting's placement (None: unresolved); a
    ``torch-order:`` hint as the prediction runs it (:func:`benchmarks.systems.torch_order_hint`:
    PyTorch's InterleavedZB order splits)."""
    P, M = cfg["n_ranks"], cfg["n_microbatches"]
    try:
        spec = resolve_hint(torch_order_hint(hint, P, M), Placement(P, n_virtual, placement), M)[0]
    except (ValueError, KeyError, AttributeError):  # AttributeError: no such PyTorch schedule class
        return None
    return spec.split_backward


class ByBackward:
    """A phase's calibrated models on a placement by backward form: the model read off the
    strict rows that ran the hint's form (a split backward's routed forwards cost more than a
    full backward's, docs/simulator.md); where every strict row of the placement split (V: the
    zero-bubble orders) and ``one`` (the one-stage models) has both forms, a full backward's
    derived from the split rows' (:func:`benchmarks.sim_pred.full_backward`); else the model off
    all of them (:func:`calibrated`)."""

    def __init__(self, res: dict, pi: int, ph: dict, n_virtual: int = 1, placement: str = "loop", fallback=None,
                 one: "ByBackward | None" = None, held: str | None = ""):
        self.cfg, self.nv, self.pl = res["config"], n_virtual, placement
        self.args = (res, pi, ph, n_virtual, placement, fallback, one)
        self.rows: dict[str, ByBackward] = {}
        # Held factors are read only where each rank has a core (fit_model): elsewhere a row's
        # model is the phase's.
        self.per_row = held is not None and held_applies(run_cores(res), res["config"]["n_ranks"])
        ex = None if held is None else [held] if held else []
        self.all = calibrated(res, pi, ph, n_virtual, placement, held=ex) or fallback
        self.forms = {f: calibrated(res, pi, ph, n_virtual, placement, backward=f, held=ex) for f in ("full", "split")}
        self.derived = (one is not None and self.forms["full"] is None and self.forms["split"] is not None
                        and one.forms["full"] is not None and one.forms["split"] is not None)
        if self.derived:
            self.forms["full"] = full_backward(self.forms["split"], one.forms["full"], one.forms["split"])

    def __call__(self, hint: str, row: str = ""):
        """The model of ``hint``'s backward form; with ``row`` (a recorded row it predicts), one
        whose held-activation factors are read off the other rows only (:func:`calibrated`)."""
        by = self
        if row and self.per_row:
            if row not in self.rows:
                self.rows[row] = ByBackward(*self.args, held=row)
            by = self.rows[row]
        split = splits(hint, self.cfg, self.nv, self.pl)
        m = None if split is None else by.forms["split" if split else "full"]
        return m or by.all


def calibrated(res: dict, pi: int, ph: dict, n_virtual: int = 1, placement: str = "loop",
               backward: str | None = None, held: list[str] | None = None):
    """The calibrated model of phase ``ph`` on a placement (:func:`benchmarks.sim_pred.fit_model`),
    read off that placement's strict rows' task records where the setting kept them
    (``record_tasks``); None without them (with one stage per rank the predictions are then
    uncalibrated: no runtime cost, a core per rank; a virtual-stage row falls back to the
    one-stage model, halved per virtual stage). ``held``: the rows whose records the
    held-activation factors leave out (``fit_model``'s; None: no such factor, ``[]``: every
    row's)."""
    if not ph.get("recorded"):
        return None
    recorded = {row: {int(k): v for k, v in steps.items()} for row, steps in ph["recorded"].items()}
    try:  # costs in place, rescaled to each row's own duty on the cores the ranks shared
        return fit_model(res["config"], res["calibration"], pi, ph, recorded, n_virtual=n_virtual,
                         placement=placement, backward=backward, cores=run_cores(res), held_without=held)
    except ValueError:  # no strict row of the placement recorded in this phase
        return None


def run_cores(res: dict) -> int:
    """The cores a setting's rank processes shared: ``res["cores"]`` where the run recorded it,
    else this machine's (``os.sched_getaffinity``: a refit on the machine that ran it)."""
    import os

    cores = res.get("cores")
    return int(cores) if isinstance(cores, int) and cores >= 1 else len(os.sched_getaffinity(0))


def models(res: dict) -> dict[str, dict | None]:
    """Per phase, the calibrated model its one-stage predictions of full-backward hints ran on
    (:meth:`RuntimeModel.to_json`; :class:`ByBackward`), with, under ``split``, the split-backward
    hints' where the strict-split row was recorded, and under ``virtual``, its virtual-stage
    placements' (``loop``, ``v``, every strict row of each) where their strict rows were recorded,
    ``full_derived`` where their full-backward hints' costs were derived (:class:`ByBackward`);
    None where they ran uncalibrated: for the report's lines on each setting."""
    out = {}
    for pi, ph in enumerate(res["phases"]):
        by = ByBackward(res, pi, ph)
        m = by.forms["full"] or by.all
        out[ph["name"]] = m.to_json() if m is not None else None
        if m is not None and by.forms["split"] is not None:
            out[ph["name"]]["split"] = by.forms["split"].to_json()
        virtual = {pl: ByBackward(res, pi, ph, 2, pl, one=by) for pl in ("loop", "v")}
        if m is not None and any(v.all for v in virtual.values()):
            out[ph["name"]]["virtual"] = {pl: {**v.all.to_json(), "full_derived": v.derived}
                                          for pl, v in virtual.items() if v.all is not None}
    return out


def model_line(model: dict | None) -> str:
    """One line on a phase's simulated column: the calibrated model's figures, or why none."""
    if not model:
        return ("Simulated column: uncalibrated (no strict row's task records here: no runtime cost, a core "
                "per rank).")
    from rrfp.sim.calibration import Calibration

    costs = "; ".join(f"rank {r}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in c.items())
                      for r, c in enumerate(model["costs"]))
    virtual = "".join(f" {pl} rows' model read off {m['source']}" + (
        ", full-backward hints' F and B times each rank's one-stage full/split ratio (all those rows split)."
        if m.get("full_derived") else ".") for pl, m in (model.get("virtual") or {}).items())
    split = model.get("split")
    if split:
        costs_s = "; ".join(f"rank {r}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in c.items() if k != "B")
                            for r, c in enumerate(split["costs"]))
        virtual = (f" Hints with a split backward: the model read off {split['source']} (its routed forwards "
                   f"cost more), ms ({costs_s}).{virtual}")
    return (f"Simulated column: the calibrated model (`benchmarks/sim_pred.py`'s `fit_model`) read off "
            f"{model['source']}: {Calibration.from_mapping(model['calibration']).describe()}; each task's own "
            f"cost in place, ms ({costs}); each round the median over one simulation per recorded step; "
            f"PyTorch's 1F1B and GPipe rows are their orders run strictly on it.{virtual}")


# --------------------------------------------------------------------------- peers


def _kib(xs: list[float] | None) -> str:
    return " ".join(f"{x / 1024:.0f}" for x in xs) if xs else "-"


def _r(s: dict) -> str:
    return (f"{s['median']:.2f}x (quartiles {s['q1']:.2f}-{s['q3']:.2f}, n={s['n']}; "
            f"95% CI {s['ci'][0]:.2f}-{s['ci'][1]:.2f})")


def peer_ceiling(res: dict, phase: str, label: str) -> float | None:
    """The memory-aware ceiling at the schedule's measured bytes: the simulated schedule's own
    order over the memory-aware lower bound of any schedule at those bytes
    (:func:`benchmarks.sim_pred.predict_bounded`), median over the rounds' delays; None
    without predictions."""
    rows = (res.get("predicted") or {}).get(phase) or {}
    strict, bound = rows.get(peer_strict(label)), rows.get(BOUND + label)
    return float(np.median(np.asarray(strict) / np.asarray(bound))) if strict and bound else None


def peer_ideal(res: dict, phase: str, label: str) -> float | None:
    """The simulator's ideal speedup of the default hint at the schedule's measured bytes over the
    schedule's own order (median over the rounds' delays)."""
    rows = (res.get("predicted") or {}).get(phase) or {}
    a, b = rows.get(peer_default(label)), rows.get(peer_strict(label))
    return float(np.median(np.asarray(b) / np.asarray(a))) if a and b else None


def peer_rows(compare: dict[str, dict]) -> tuple[list[list[str]], list[list[str]]]:
    """(table rows, target rows) for the zero-bubble schedules, from each setting's raw result."""
    table, targets = [], []
    for setting, res in compare.items():
        for ph in res["phases"]:
            names = set(ph["rounds"][0]["systems"])
            for label, p in PEERS.items():
                d, t, s = peer_default(label), p["torch"], peer_strict(label)
                if not {d, t, s} <= names:
                    continue
                td, tt, ts = _timed(ph, d), _timed(ph, t), _timed(ph, s)
                vs_torch = ratio_summary(tt, td)
                ideal = peer_ideal(res, ph["name"], label)
                ceil = peer_ceiling(res, ph["name"], label)
                table.append([setting, ph["name"], t[6:], _r(vs_torch), _r(ratio_summary(tt, ts)),
                              _r(ratio_summary(ts, td)), _kib(_memory(ph, d)), _kib(_memory(ph, t)),
                              _kib(_memory(ph, s)), f"{ideal:.2f}x" if ideal else "-",
                              f"{ceil:.2f}x" if ceil else "-"])
                goal = PEER_GOALS.get(ph["level"], PEER_GOAL) if not res["config"].get("comm") else PEER_GOAL
                if setting not in ("jitter4", "comm4") or label not in ZERO_BUBBLE:
                    continue
                # "The simulator's ideal at that memory": the memory-aware ceiling, the most any
                # schedule could gain there (the default hint's own simulated gain is beside it).
                eff, how = goal, f">= {goal:.2f}x"
                if ceil is not None and ceil < goal:
                    eff, how = 0.95 * ceil, f">= 0.95 x the memory-aware ceiling {ceil:.2f}x = {0.95 * ceil:.2f}x"
                what = "message delays (J2)" if res["config"].get("comm") else f"4 ranks, {ph['name']}"
                targets.append([f"{what}, at {t[6:]}'s own memory: default hint {how} {t[6:]}",
                                _r(vs_torch), "met" if vs_torch["median"] >= eff else "**missed**",
                                f"ceiling {ceil:.2f}x, default hint's {ideal:.2f}x" if ceil and ideal else
                                f"ceiling {ceil:.2f}x" if ceil else f"default hint's {ideal:.2f}x" if ideal else "-"])
    return table, targets


PEERS_NOTE = """\
Each schedule with 2 virtual stages per rank (interleaved 1F1B, and the zero-bubble InterleavedZB,
ZBV and DualPipeV) runs in the same rank processes as every other row, alternated round by round,
with the same weights, batches and injected delays and equal gradients. Its rrfp rows run on its
placement (loop for the interleaved schedules, V for ZBV and DualPipeV):
`rrfp default, <schedule> memory` is rrfp's default hint with `memory_budget` on each rank set to
the peak saved-activation bytes the PyTorch schedule measured on that rank in the phase's memory
round; `rrfp strict <schedule> order` runs the schedule's own order strictly (rrfp's `zb-v` and
`dualpipev`, equal to PyTorch's action lists; for InterleavedZB, PyTorch's action list read from
its schedule object; for Int1F1B, rrfp's `interleaved-1f1b`). So "strict vs torch" is the runtime's share (same order), "default vs
strict" the scheduling's share (same runtime). Ratios are medians of per-round paired ratios
(quartiles, n, 95% bootstrap interval of the median). Peaks: KiB of saved activations per rank
(the meter of every row alike; it counts what rrfp's budget counts: a forward's saved tensors and,
on the last stage, its loss's). The simulator's ideal: the default hint at those bytes over the
schedule's order, on the setting's calibrated model (the strict 1F1B row's records, as under each
setting's table) with the very delays of the timed rounds (`benchmarks/sim_pred.py`). The memory-aware ceiling: the schedule's order over the lower bound
of any schedule that keeps each rank within those bytes (`rrfp.sim.metrics.lower_bound` and
`memory_bound` on the same task durations, the larger of the two, the smaller over the two rows'
runs), median over the rounds; a target falls back to 0.95 of it where it is below the goal."""


# --------------------------------------------------------------------------- ranks


def ranks_rows(compare: dict[str, dict], quick: bool = False) -> tuple[list[list[str]], list[list[str]]]:
    """(table rows, target rows) for the settings whose tasks sleep: every row beside the
    simulator's prediction for the same costs and delays (``quick``: no verdict in the table,
    as one small round decides nothing)."""
    table, targets = [], []
    for setting, res in compare.items():
        cfg = res["config"]
        if not cfg.get("sleep"):
            continue
        default = cfg.get("hint") or res.get("default_hint") or "bf"
        for ph in res["phases"]:
            pred = (res.get("predicted") or {}).get(ph["name"]) or {}
            for n, sim in pred.items():
                if n not in RRFP_SYSTEMS:
                    continue
                real = _timed(ph, n)
                rs = ratio_summary(real, sim)
                hint = kept_hint(ph, n, default)
                strict = hint.startswith("strict-")
                tol = STRICT_TOL if strict else READY_TOL
                ok = abs(rs["median"] - 1) <= tol
                peak = _memory(ph, n)
                table.append([setting, ph["name"], n, f"`{hint}`", f"{max(peak) / 1024:.0f}" if peak else "-",
                              f"{np.median(real) * 1e3:.0f}",
                              f"{np.median(sim) * 1e3:.0f}", _r(rs).replace("x (", " ("), f"within {tol:.0%}",
                              "- (quick)" if quick else "met" if ok else "**missed**"])
                targets.append([f"{cfg['n_ranks']} real ranks, {ph['name']}, {n} (`{hint}`): real step within "
                                f"{tol:.0%} of the simulated", _r(rs).replace("x (", " ("), "met" if ok else "**missed**",
                                f"{np.median(sim) * 1e3:.0f} ms"])
            sp = _speedup(ph, pred)
            if sp:
                real_sp, sim_sp, ok = sp
                targets.append([f"{cfg['n_ranks']} real ranks, {ph['name']}: default's speedup over strict 1F1B within "
                                f"{SPEEDUP_TOL} of the simulated", _r(real_sp), "met" if ok else "**missed**",
                                f"{sim_sp:.2f}x"])
    return table, targets


def _speedup(ph: dict, pred: dict) -> tuple[dict, float, bool] | None:
    """The default's real speedup over strict 1F1B (paired per round), the simulated one (median
    over the rounds' delays), and whether they are within :data:`SPEEDUP_TOL`."""
    a, b = "rrfp default", "rrfp strict-1f1b"
    if a not in pred or b not in pred:
        return None
    real_sp = ratio_summary(_timed(ph, b), _timed(ph, a))
    sim_sp = float(np.median(np.asarray(pred[b]) / np.asarray(pred[a])))
    return real_sp, sim_sp, abs(real_sp["median"] - sim_sp) <= SPEEDUP_TOL


def speedup_rows(compare: dict[str, dict], quick: bool = False) -> list[list[str]]:
    """Per sleeping setting and phase: the default's real speedup over strict 1F1B beside the
    simulated one (``quick``: no verdict)."""
    rows = []
    for setting, res in compare.items():
        if not res["config"].get("sleep"):
            continue
        for ph in res["phases"]:
            sp = _speedup(ph, (res.get("predicted") or {}).get(ph["name"]) or {})
            if sp:
                real_sp, sim_sp, ok = sp
                rows.append([setting, ph["name"], _r(real_sp), f"{sim_sp:.2f}x", f"{real_sp['median'] - sim_sp:+.2f}",
                             f"within {SPEEDUP_TOL}", "- (quick)" if quick else "met" if ok else "**missed**"])
    return rows


RANKS_NOTE = """\
Every task sleeps for its compute (the setting's forward and backward sleeps, on a
one-layer-per-stage GPT whose own compute is about a millisecond), plus the injected jitter, so 8
or 16 rank processes fit on 2 cores. The simulator runs the same arbiter with each task's
duration the sleep plus *the same keyed delay the real run injected* (same seed, steps, stages
and microbatches) plus the task's own cost, and what the runtime pays around tasks: the
calibrated model (`rrfp.sim.calibration`, `benchmarks/sim_pred.py`'s `fit_model`) read off the
strict 1F1B row's task records in the same rounds (each task's own cost in place, as the ranks
shared the cores; the runtime's time per task, per message and per step); the other rows are
predicted out of sample. Real: the slowest rank's step time per round; real/simulated is the median of the
per-round ratios (quartiles, n, 95% bootstrap interval of the median)."""


def render(compare: dict[str, dict], quick: bool = False) -> tuple[list[str], list[list[str]]]:
    """(report lines, target rows) of both sections."""
    lines: list[str] = []
    ptable, ptargets = peer_rows(compare)
    if ptable:
        lines += [f"## {PEERS_TITLE}", "", PEERS_NOTE, "", _table(
            ["setting", "phase", "schedule", "default at its memory vs it", "strict same order vs it (runtime)",
             "default vs strict same order (scheduling)", "default peak KiB per rank", "torch peak KiB per rank",
             "strict peak KiB per rank", "simulator's ideal", "memory-aware ceiling"], ptable), ""]
    rtable, rtargets = ranks_rows(compare, quick)
    if rtable:
        lines += [f"## {RANKS_TITLE}", "", RANKS_NOTE, "", _table(
            ["setting", "phase", "row", "hint", "peak KiB (largest rank)", "real median ms", "simulated median ms",
             "real / simulated",
             "target", "verdict"], rtable), ""]
        srows = speedup_rows(compare, quick)
        if srows:
            lines += ["The default's speedup over strict 1F1B, real (paired per round) and simulated:", "", _table(
                ["setting", "phase", "real", "simulated", "real - simulated", "target", "verdict"], srows), ""]
    return lines, ptargets + rtargets
