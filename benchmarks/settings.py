"""The comparison settings (model, batch, ranks, systems, phases), their ``--quick`` sizes, and
the configuration one run of a setting gets (:func:`setting_config`)."""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

from .systems import CORE_SYSTEMS, PEER_SYSTEMS, ZB_PEER_SYSTEMS, candidate_systems

LEGACY_SYSTEMS = ["rrfp bf", "rrfp bfw", "rrfp strict-1f1b", "rrfp bf, 1F1B limits", "torch GPipe", "torch 1F1B",
                  "torch Interleaved1F1B", "torch InterleavedZB"]
SETTINGS: dict[str, dict[str, Any]] = {
    "jitter4": {
        "title": "4 ranks, injected jitter dominates compute",
        "n_ranks": 4,
        "model": {"n_layer": 8, "n_head": 2, "d_model": 32},
        "seq_len": 32,
        "batch_size": 32,
        "n_microbatches": 16,
        "threads": 1,
        "systems": [*CORE_SYSTEMS, "rrfp default, 1F1B limits", *PEER_SYSTEMS],
        # J2 carries more targets: more rounds (the median's spread falls as 1/sqrt(rounds)).
        "phases": [{"name": lv, "level": lv, "varlen": False, "rounds": n} for lv, n in (("J0", 8), ("J2", 14))],
        "step_s": 0.2,
    },
    "compute2": {
        "title": "2 ranks, real CPU compute only",
        "n_ranks": 2,
        "model": {"n_layer": 8, "n_head": 4, "d_model": 128},
        "seq_len": 128,
        "batch_size": 16,
        "n_microbatches": 8,
        "threads": 1,
        "systems": [*CORE_SYSTEMS, "torch Interleaved1F1B"],
        "step_s": 0.4,
        "phases": [
            {"name": "fixed length", "level": "J0", "varlen": False, "rounds": 6},
            {"name": "variable length", "level": "J0", "varlen": True, "rounds": 6},
        ],
    },
}
# Communication variability: the jitter4 model with steady compute and J2's injected delays on
# every message (benchmarks/workloads.py: the same keyed delay for every system).
SETTINGS["comm4"] = {
    **SETTINGS["jitter4"],
    "title": "4 ranks, injected message delays (J2 on every activation and gradient between ranks)",
    "comm": "J2",
    "systems": [*CORE_SYSTEMS, *ZB_PEER_SYSTEMS],
    "phases": [{"name": "comm J2", "level": "J0", "varlen": False, "rounds": 16}],
    "step_s": 0.14,
}
# The multimodal model (ViT-style encoder on stage 0, 3 decoder blocks) on digit captions.
SETTINGS["multimodal4"] = {
    "title": "4 ranks, multimodal (image encoder on stage 0, 0-6 images per sample)",
    "workload": "multimodal",
    "n_ranks": 4,
    "model": {"n_layer": 3, "n_head": 2, "d_model": 64, "enc_width": 32, "enc_layers": 1},
    "seq_len": 18,
    "batch_size": 64,
    "n_microbatches": 16,
    "threads": 1,
    "systems": list(CORE_SYSTEMS),
    "phases": [{"name": "images 0-6", "level": "J0", "varlen": False, "rounds": 20}],
    "step_s": 0.09,
}
# The jitter4 model and microbatch size with 4x the microbatches, J2 only: the simulator's ideal
# speedup of readiness grows with the number of microbatches (docs in BENCHMARKS.md).
SETTINGS["jitter4-m64"] = {
    **SETTINGS["jitter4"],
    "title": "4 ranks, injected jitter dominates compute, 64 microbatches",
    "batch_size": 128,
    "n_microbatches": 64,
    "systems": LEGACY_SYSTEMS,
    "phases": [{"name": "J2", "level": "J2", "varlen": False, "rounds": 8}],
    "step_s": 0.5,
}
# Many real ranks on few cores: every task sleeps for its compute (F 10 ms, B 20 ms) on a tiny GPT
# (one layer per stage), so injected jitter dominates and 16 processes fit on 2 cores; each row
# is set beside the simulator's prediction for the same costs and the same injected delays
# (benchmarks/sim_pred.py).
RANKS_SYSTEMS = ["rrfp strict-1f1b", "rrfp default", "rrfp default, 1F1B limits"]
for _p in (8, 16):
    SETTINGS[f"ranks{_p}"] = {
        "title": f"{_p} ranks, tasks sleep for their compute (F 10 ms, B 20 ms), against the simulator",
        "n_ranks": _p,
        "model": {"n_layer": _p, "n_head": 1, "d_model": 8},
        "seq_len": 8,
        "batch_size": 16,
        "n_microbatches": 16,
        "threads": 1,
        # The rank processes' own CPU (compute and runtime, ~1 ms per task here) stays a few
        # percent of the sleeps, so 16 ranks on 2 cores rarely wait for a core.
        "sleep": {"F": 0.010, "B": 0.020},
        "systems": list(RANKS_SYSTEMS),
        # Sleep-dominated steps vary little round to round: few rounds pin the real/simulated ratio.
        "phases": [{"name": lv, "level": lv, "varlen": False, "rounds": n} for lv, n in (("J0", 2), ("J2", 6))],
        "step_s": 0.035 * (15 + _p),  # (M + p - 1) tasks of 30 ms on the slowest rank, plus jitter
    }
# 8 microbatches: ScheduleDualPipeV refuses fewer than its 8 stages.
_TINY = {"model": {"n_layer": 8, "n_head": 2, "d_model": 16}, "seq_len": 16, "batch_size": 8, "n_microbatches": 8}
QUICK: dict[str, dict[str, Any]] = {
    "jitter4": {**_TINY, "phases": [{"name": "J2", "level": "J2", "varlen": False, "rounds": 1}], "step_s": 0.12},
    "comm4": {**_TINY, "phases": [{"name": "comm J2", "level": "J0", "varlen": False, "rounds": 1}], "step_s": 0.12},
    "multimodal4": {"model": {"n_layer": 3, "n_head": 2, "d_model": 16, "enc_width": 8, "enc_layers": 1},
                    "batch_size": 8, "n_microbatches": 4, "step_s": 0.05,
                    "phases": [{"name": "images 0-6", "level": "J0", "varlen": False, "rounds": 1}]},
    "jitter4-m64": {"model": {"n_layer": 8, "n_head": 2, "d_model": 16}, "seq_len": 16, "batch_size": 32,
                    "n_microbatches": 32, "step_s": 0.3,
                    "phases": [{"name": "J2", "level": "J2", "varlen": False, "rounds": 2}]},
    "compute2": {"model": {"n_layer": 4, "n_head": 2, "d_model": 32}, "seq_len": 32, "batch_size": 8, "n_microbatches": 4,
                 "step_s": 0.1, "phases": [{"name": "variable length", "level": "J0", "varlen": True, "rounds": 2}]},
    **{f"ranks{p}": {"phases": [{"name": "J2", "level": "J2", "varlen": False, "rounds": 1}]} for p in (8, 16)},
}


def setting_config(name: str, quick: bool = False, systems: Sequence[str] | None = None, seed: int = 0,
                   rounds: int | None = None, hint: str | None = None, candidates: Sequence[str] = ()) -> dict:
    """The configuration of one setting (a key of :data:`SETTINGS`), optionally shrunk for CI.
    ``hint``: the hint of the ``rrfp default`` rows (None: ``rrfp.Pipeline``'s default);
    ``candidates``: more hints, each run at 1F1B's and GPipe's memory in the same rounds
    (:func:`candidate_systems`)."""
    cfg = copy.deepcopy(SETTINGS[name])
    cfg["hint"] = hint
    cfg["candidates"] = list(candidates)
    if quick:
        cfg.update(copy.deepcopy(QUICK[name]))
    if rounds is not None:
        for ph in cfg["phases"]:
            ph["rounds"] = rounds
    cfg["systems"] = list(systems or cfg.get("systems") or LEGACY_SYSTEMS) + list(candidate_systems(candidates))
    # Every setting keeps its rrfp rows' task records: the calibrated model of the report's
    # predictions is read off the strict rows' (benchmarks/sim_pred.py, fit_model; issue 33).
    cfg.setdefault("record_tasks", True)
    cfg["seed"] = seed
    cfg["setting"] = name
    cfg["run_id"] = f"bench-{name}-{time.time_ns()}"
    return cfg
