"""The systems a comparison can run: rrfp rows (a hint, an in-flight limit, a memory budget)
and PyTorch's schedule classes, by row name.

**PyTorch's virtual-stage schedules at their own memory** (:data:`PEERS`): for each of
``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (2 virtual stages, loop
placement), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (2 virtual stages, V placement)
two rrfp rows run on the same
placement: ``rrfp default, <peer> memory``, the default hint with ``memory_budget`` set on each
rank to the peak saved-activation bytes PyTorch's schedule measured on that rank in the same
phase's memory round (``budget_from``), and ``rrfp strict <peer> order``, rrfp running that
schedule's own order strictly (so the runtime's share of a gain and the scheduling's share are
told apart). The strict orders are rrfp's ``zb-v`` and ``dualpipev`` (equal to PyTorch's action
lists, tested) and, for the interleaved zero-bubble schedule with 2 virtual stages, PyTorch's own
action list read from its schedule object (:func:`torch_order_hint`).
"""

from __future__ import annotations

from typing import Any, Sequence

RRFP_SYSTEMS: dict[str, dict[str, Any]] = {
    "rrfp bf": {"hint": "bf", "limit": 32},
    "rrfp bfw": {"hint": "bfw", "limit": 32},
    "rrfp strict-1f1b": {"hint": "strict-1f1b", "limit": 32},
    # 1F1B's order with the backward split into I and W: the calibrated model reads a one-stage
    # placement's I and W off it (benchmarks/sim_pred.py PROFILE_ROWS), as auto measures a job.
    "rrfp strict-split": {"hint": "strict-split", "limit": 32},
    "rrfp bf, 1F1B limits": {"hint": "bf", "limit": "1f1b"},
    # The default hint (whatever rrfp.Pipeline defaults to), unlimited and with a memory
    # budget in bytes: what 1F1B or GPipe would hold on each rank (benchmarks/workloads.py).
    "rrfp default": {"hint": None, "limit": 32},
    "rrfp default, 1F1B memory": {"hint": None, "limit": 32, "budget": "1f1b"},
    "rrfp default, GPipe memory": {"hint": None, "limit": 32, "budget": "gpipe"},
    "rrfp default, 1F1B limits": {"hint": None, "limit": "1f1b"},  # the count, not the bytes
}
TORCH_SYSTEMS: dict[str, dict[str, Any]] = {
    "torch GPipe": {"cls": "ScheduleGPipe", "virtual": 1},
    "torch 1F1B": {"cls": "Schedule1F1B", "virtual": 1},
    "torch Interleaved1F1B": {"cls": "ScheduleInterleaved1F1B", "virtual": 2},
    "torch InterleavedZB": {"cls": "ScheduleInterleavedZeroBubble", "virtual": 2},
    "torch ZBV": {"cls": "ScheduleZBVZeroBubble", "virtual": 2, "placement": "v"},
    "torch DualPipeV": {"cls": "ScheduleDualPipeV", "virtual": 2, "placement": "v"},
}
ALL_SYSTEMS = list(RRFP_SYSTEMS) + list(TORCH_SYSTEMS)
MEMORY_ROWS = {"1f1b": "1F1B memory", "gpipe": "GPipe memory"}


def candidate_systems(hints: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Rows of candidate hints (``--candidates``), run beside the default hint in the same
    rounds at both memory budgets: ``rrfp <hint>, 1F1B memory`` and ``rrfp <hint>, GPipe memory``."""
    return {f"rrfp {h}, {label}": {"hint": h, "limit": 32, "budget": b} for h in hints for b, label in MEMORY_ROWS.items()}
CORE_SYSTEMS = ["rrfp default", "rrfp default, 1F1B memory", "rrfp default, GPipe memory", "rrfp strict-1f1b",
                "rrfp strict-split", "torch GPipe", "torch 1F1B"]


def target_groups(names: Sequence[str]) -> list[list[str]]:
    """The rows each equal-memory target compares, which :func:`~benchmarks.harness.round_order`
    runs side by side: the default hint at a schedule's memory, that PyTorch schedule, and the
    candidate hints at that memory."""
    groups = [[f"rrfp default, {label}", torch_row, *[n for n in names if n.endswith(f", {label}")
                                                      and n != f"rrfp default, {label}"]]
              for label, torch_row in (("1F1B memory", "torch 1F1B"), ("GPipe memory", "torch GPipe"))]
    return groups + [[peer_default(p), PEERS[p]["torch"], peer_strict(p)] for p in PEERS]


def default_hint() -> str:
    """The hint of the "rrfp default" rows: ``auto``, the default of ``rrfp.Pipeline``,
    ``LocalPipeline`` and ``rrfp train``. Its measuring and trial steps run in each phase
    before the timed rounds (:func:`benchmarks.compare.auto_steps`), so the timed rounds
    measure the hint it kept, shown beside each row (:func:`kept_hint`)."""
    return "auto"


def kept_hint(phase: dict, name: str, default: str) -> str:
    """The hint row ``name`` ran in ``phase``'s timed rounds: the hint ``auto`` kept there
    (``phase["kept"]``, from :mod:`benchmarks.compare`), a named row's own, or ``default``."""
    kept = (phase.get("kept") or {}).get(name)
    if kept:
        return kept
    spec = RRFP_SYSTEMS.get(name) or {}
    return spec.get("hint") or default


PEERS: dict[str, dict[str, str]] = {
    "Int1F1B": {"torch": "torch Interleaved1F1B", "placement": "loop", "strict": "strict-interleaved-1f1b"},
    "IntZB": {"torch": "torch InterleavedZB", "placement": "loop", "strict": "torch-order:ScheduleInterleavedZeroBubble"},
    "ZBV": {"torch": "torch ZBV", "placement": "v", "strict": "strict-zb-v"},
    "DualPipeV": {"torch": "torch DualPipeV", "placement": "v", "strict": "strict-dualpipev"},
}
"""PyTorch's schedules with 2 virtual stages per rank compared at their own memory (the three
zero-bubble ones carry targets; interleaved 1F1B is their non-zero-bubble reference): short label
-> its torch row, placement and the strict hint of the same order."""
ZERO_BUBBLE = ("IntZB", "ZBV", "DualPipeV")


def peer_default(label: str) -> str:
    return f"rrfp default, {label} memory"


def peer_strict(label: str) -> str:
    return f"rrfp strict {label} order"


def peer_systems() -> dict[str, dict[str, Any]]:
    """The rrfp rows of :data:`PEERS`: per peer, the default hint at the peer's measured bytes and
    the peer's order run strictly, both on the peer's placement."""
    out: dict[str, dict[str, Any]] = {}
    for label, p in PEERS.items():
        out[peer_default(label)] = {"hint": None, "limit": 32, "virtual": 2, "placement": p["placement"],
                                    "budget_from": p["torch"]}
        out[peer_strict(label)] = {"hint": p["strict"], "limit": 32, "virtual": 2, "placement": p["placement"]}
    return out


RRFP_SYSTEMS.update(peer_systems())
ALL_SYSTEMS = list(RRFP_SYSTEMS) + list(TORCH_SYSTEMS)
PEER_SYSTEMS = [n for label in PEERS for n in (peer_default(label), PEERS[label]["torch"], peer_strict(label))]
ZB_PEER_SYSTEMS = [n for label in ZERO_BUBBLE for n in (peer_default(label), PEERS[label]["torch"], peer_strict(label))]


def virtual_stage_ids(placement: str, rank: int, n_ranks: int) -> list[int]:
    """The two stages ``rank`` holds with 2 virtual stages per rank: ``loop`` (``r``, ``r + p``)
    or ``v`` (``r``, ``2p - 1 - r``), as :class:`rrfp.scheduler.tasks.Placement` places them."""
    from rrfp.scheduler.tasks import Placement

    return Placement(n_ranks, 2, placement).stages_of(rank)


def torch_order_hint(text: str, n_ranks: int, n_microbatches: int) -> str:
    """A hint for ``torch-order:<ScheduleClass>``: ``strict-order:`` with that PyTorch class's
    per-rank compute actions for ``n_ranks`` ranks of 2 virtual stages (its own placement) and
    ``n_microbatches``, each ``OVERLAP_F_B`` read as its forward then its backward, and a full
    ``B`` written as ``I W`` where the class also splits backwards (rrfp orders hold one form).
    Any other hint text is returned unchanged.

    Raises:
        ValueError: what PyTorch raises for a shape it refuses.
    """
    if not text.startswith("torch-order:"):
        return text
    import re

    from torch.distributed.pipelining import schedules as S
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = getattr(S, text[len("torch-order:"):])
    style = "v" if cls in (S.ScheduleZBVZeroBubble, getattr(S, "ScheduleDualPipeV", None)) else "loop"
    n = 2 * n_ranks
    owner = generate_stage_to_rank_mapping(n_ranks, n, style=style)

    class _Stage:  # what the schedule constructors read (as PyTorch's own tests mock it)
        def __init__(self, s: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = s, n, n_ranks, 0
            self.submod, self.stage_index_to_group_rank = None, {}

    sched = cls([_Stage(s) for s in range(n) if owner[s] == 0], n_microbatches)
    ranks = []
    for r in range(n_ranks):
        acts = [str(x) for a in sched.pipeline_order[r] if a is not None
                for x in (a.sub_actions or (a,)) if x.is_compute_op]
        ranks.append(acts)
    full = re.compile(r"^(\d+)B(\d+)$")
    if any(re.match(r"^\d+[IW]\d+$", a) for o in ranks for a in o):
        ranks = [[y for a in o for y in ((full.sub(r"\1I\2", a), full.sub(r"\1W\2", a)) if full.match(a) else (a,))]
                 for o in ranks]
    return "strict-order:" + " | ".join(f"rank{r}: {' '.join(o)}" for r, o in enumerate(ranks))
