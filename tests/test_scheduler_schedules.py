"""Named schedules, their text/CSV forms, hint resolution, and the cross-check against
torch.distributed.pipelining's own schedule generators (no processes: the schedule classes
only read a few attributes of their stage objects to build ``pipeline_order``)."""

from __future__ import annotations

import itertools
import re

import pytest

from rrfp.scheduler import (
    SCHEDULES,
    Hint,
    Placement,
    PipelineSpec,
    ScheduleError,
    Task,
    dump_order_csv,
    format_orders,
    load_order_csv,
    microbatches_per_round,
    one_f_one_b,
    one_f_one_b_limits,
    order_peak_inflight,
    parse_orders,
    resolve_hint,
    validate_schedule,
)
from rrfp.scheduler.registry import names
from rrfp.sim.engine import simulate

HINT_NAMES = names(order=False) + tuple(SCHEDULES)  # the policies and the named schedules


# --------------------------------------------------------------- PyTorch's generators
def _torch():
    try:
        from torch.distributed.pipelining import schedules as S
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    except Exception as e:  # noqa: BLE001 - any import problem means "not available here"
        pytest.skip(f"torch.distributed.pipelining not importable: {e}")
    needed = ["ScheduleGPipe", "Schedule1F1B", "ScheduleLoopedBFS", "ScheduleInterleaved1F1B",
              "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "PipelineScheduleMulti"]
    missing = [n for n in needed if not hasattr(S, n)]
    if missing:
        pytest.skip(f"torch.distributed.pipelining lacks {missing}")
    return S, generate_stage_to_rank_mapping


class FakeStage:
    """The attributes PyTorch's schedule constructors read from a stage (as in PyTorch's own
    test_schedule.py MockPipelineStage), without a process group or a module."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.submod = None
        self.stage_index_to_group_rank = {}


TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}


def torch_schedule(name: str, p: int, v: int, m: int):
    """PyTorch's schedule object for ``name``; raises what PyTorch raises for a bad shape."""
    S, mapping = _torch()
    cls = getattr(S, TORCH_CLASS[name])
    style = "v" if name == "zb-v" else "loop"
    n = p * v
    owner = mapping(p, n, style=style)
    stages = [FakeStage(s, n, p) for s in range(n) if owner[s] == 0]
    if issubclass(cls, S.PipelineScheduleMulti):
        return cls(stages, m)
    return cls(stages[0], m)


def torch_compute_orders(name: str, p: int, v: int, m: int) -> list[list[str]]:
    sched = torch_schedule(name, p, v, m)
    return [
        [str(a) for a in sched.pipeline_order[r] if a is not None and a.is_compute_op]
        for r in range(p)
    ]


def ours(name: str, p: int, v: int, m: int) -> list[list[str]]:
    kind = "v" if name == "zb-v" else "loop"
    spec = PipelineSpec(Placement(p, v, kind), m, name.startswith("zb-"))
    return [[str(t) for t in o] for o in SCHEDULES[name](spec)]


CASES = [
    # (name, ranks, virtual stages, microbatches); several M not divisible by the ranks
    ("gpipe", 4, 1, 7),
    ("looped-bfs", 3, 2, 5),
    ("looped-bfs", 2, 4, 3),
    ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 4, 2, 6),
    ("interleaved-1f1b", 4, 2, 10),
    ("interleaved-1f1b", 3, 2, 8),
    ("interleaved-1f1b", 4, 2, 3),
    ("interleaved-1f1b", 2, 3, 4),
    ("interleaved-1f1b", 4, 4, 12),
    ("interleaved-1f1b", 3, 1, 5),
    ("zb-h1", 4, 1, 8),
    ("zb-h1", 4, 1, 6),
    ("zb-h1", 3, 1, 8),
    ("zb-h1", 5, 1, 3),
    ("zb-v", 4, 2, 8),
    ("zb-v", 4, 2, 5),
    ("zb-v", 3, 2, 7),
    ("zb-v", 2, 2, 1),
]


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_compiled_orders_equal_pytorch(name, p, v, m):
    assert ours(name, p, v, m) == torch_compute_orders(name, p, v, m)


@pytest.mark.parametrize("name", ["gpipe", "looped-bfs", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_compiled_orders_equal_pytorch_on_a_grid(name):
    """Every shape PyTorch accepts for ranks 1-5, microbatches 1-12. Where PyTorch refuses an
    interleaved shape for its microbatch count, so do we with virtual stages; with one stage
    per rank the round size changes nothing, so we accept any count (and PyTorch's check is
    needlessly strict there)."""
    vs = {"gpipe": [1], "zb-h1": [1], "zb-v": [2]}.get(name, [1, 2, 3])
    compared = 0
    for p, v, m in itertools.product(range(1, 6), vs, range(1, 13)):
        try:
            theirs = torch_compute_orders(name, p, v, m)
        except ValueError:
            assert name in ("interleaved-1f1b", "zb-h1")
            if v > 1:
                with pytest.raises(ValueError, match="multiple of the number of rounds"):
                    ours(name, p, v, m)
            else:
                spec = PipelineSpec(Placement(p), m, name == "zb-h1")
                validate_schedule(spec, SCHEDULES[name](spec))
            continue
        assert ours(name, p, v, m) == theirs, (p, v, m)
        compared += 1
    assert compared >= 12


def test_1f1b_equals_pytorch_except_its_last_rank_ir_bug():
    """``Schedule1F1B._get_pipeline_order`` (torch 2.13) numbers the last rank's forwards 1..M
    instead of 0..M-1 (its warm-up count is 0, and it increments before use); its execution
    (``_step_microbatches``) runs 0..M-1 as ours does. Every other rank matches exactly; the
    last rank matches once that shift is undone, or exactly if PyTorch fixes it."""
    for p, m in [(1, 1), (2, 4), (3, 5), (4, 4), (4, 9)]:
        theirs = torch_compute_orders("1f1b", p, 1, m)
        mine = ours("1f1b", p, 1, m)
        assert mine[:-1] == theirs[:-1]
        shifted = [re.sub(r"F(\d+)$", lambda g: f"F{int(g.group(1)) + 1}", a) for a in mine[-1]]
        assert theirs[-1] in (mine[-1], shifted)


def test_torch_csv_files_load_as_our_orders(tmp_path):
    """Both of PyTorch's CSV dumps (compute-only with empty idle cells, and compute+comms)
    load as the compute order; our CSV loads into PyTorch's own loader."""
    _torch()
    for name, p, v, m in [("zb-h1", 4, 1, 6), ("interleaved-1f1b", 4, 2, 8), ("zb-v", 3, 2, 4)]:
        sched = torch_schedule(name, p, v, m)
        for fmt in ("compute_only", "compute_comms"):
            path = tmp_path / f"{name}-{fmt}.csv"
            sched._dump_csv(str(path), format=fmt)
            assert [[str(t) for t in o] for o in load_order_csv(str(path))] == ours(name, p, v, m)
        path = tmp_path / f"{name}-ours.csv"
        spec = PipelineSpec(Placement(p, v, "v" if name == "zb-v" else "loop"), m, name.startswith("zb-"))
        path.write_text(dump_order_csv(SCHEDULES[name](spec)))
        sched._load_csv(str(path), format="compute_only")
        assert [[str(a) for a in sched.pipeline_order[r] if a is not None] for r in range(p)] == ours(name, p, v, m)


# --------------------------------------------------------------- properties of our orders
def _shapes():
    for name in SCHEDULES:
        for p in (1, 2, 3, 5, 8):
            for v in {"1f1b": [1], "zb-h1": [1], "zb-v": [2], "dualpipev": [2]}.get(name, [1, 2, 3, 4]):
                kinds = ["v"] if name in ("zb-v", "dualpipev") else ["loop"] if name == "interleaved-1f1b" else ["loop", "v"]
                for kind in kinds:
                    for m in (1, 2, 3, 5, 8, 13, 32):
                        yield name, Placement(p, v, kind), m


@pytest.mark.slow
def test_every_named_schedule_is_a_valid_strict_schedule():
    checked = 0
    for name, place, m in _shapes():
        for split in (False, True):
            spec = PipelineSpec(place, m, split)
            try:
                orders = SCHEDULES[name](spec)
            except ValueError:
                assert name == "interleaved-1f1b"
                continue
            validate_schedule(spec, orders)
            checked += 1
    assert checked > 400


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (3, 2)])
def test_memory_of_named_schedules(p, m):
    """1F1B holds at most p - r activations on rank r; ZB-H1, counting a microbatch until its
    W (W reads what F saved), min(M, p) on every rank: rank r defers p - 1 - r weight
    gradients past its p - r, so its peak over ranks is 1F1B's (ZB-H1's point, Qi et al. 2024
    §3.1: 1F1B's peak memory), not rank r's; GPipe holds all M."""
    spec = PipelineSpec(Placement(p), m)
    assert order_peak_inflight(spec, one_f_one_b(spec)) == [min(m, lim) for lim in one_f_one_b_limits(p)]
    zspec = PipelineSpec(Placement(p), m, True)
    assert order_peak_inflight(zspec, SCHEDULES["zb-h1"](zspec)) == [min(m, p)] * p
    assert max(order_peak_inflight(zspec, SCHEDULES["zb-h1"](zspec))) == max(order_peak_inflight(spec, one_f_one_b(spec)))
    assert order_peak_inflight(spec, SCHEDULES["gpipe"](spec)) == [m] * p


def test_zb_h1_is_the_papers_h1_order():
    # Qi et al. 2024 Fig. 3 (p = 4): 1F1B's warm-up; the last stage defers 3 weight gradients
    # to its cool-down, the first none.
    spec = PipelineSpec(Placement(4), 8, True)
    o = [" ".join(map(str, r)) for r in SCHEDULES["zb-h1"](spec)]
    assert o[0].startswith("0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1")
    assert o[3].startswith("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1")
    assert o[3].endswith("3I7 3W4 3W5 3W6 3W7")


def test_bf_with_1f1b_limits_reproduces_1f1b_exactly():
    """RRFP §4: with equal durations and the in-flight limit set per rank to 1F1B's, the BF
    policy runs exactly 1F1B's per-rank order."""
    for durations in ({"F": 1.0, "B": 1.0}, {"F": 1.0, "B": 2.0}):
        for p in range(1, 9):
            for m in range(1, 21):
                spec, hint, _ = resolve_hint("bf", Placement(p), m)
                res = simulate(spec, hint, lambda s, r, t: durations[t.kind], inflight_limit=one_f_one_b_limits(p))
                ran = [[x.task for x in sorted(res.records, key=lambda x: x.start) if x.rank == r] for r in range(p)]
                assert ran == one_f_one_b(spec), (durations, p, m)


def test_placement_requirements_are_one_line_errors():
    with pytest.raises(ValueError, match="1 virtual stage per rank"):
        resolve_hint("1f1b", Placement(2, 2), 4)
    with pytest.raises(ValueError, match="1 virtual stage per rank"):
        resolve_hint("zb-h1", Placement(2, 2), 4)
    with pytest.raises(ValueError, match=r"^zb-v needs 2 virtual stages per rank in the v placement "
                                         r"\(got 2 virtual stages, loop placement\)$"):
        resolve_hint("zb-v", Placement(2, 2, "loop"), 4)
    with pytest.raises(ValueError, match="loop placement"):
        resolve_hint("interleaved-1f1b", Placement(2, 2, "v"), 4)
    with pytest.raises(ValueError, match=r"nearby valid counts: .*8"):
        resolve_hint("interleaved-1f1b", Placement(4, 2), 9)
    assert microbatches_per_round(4, 10) == 5 and microbatches_per_round(4, 3) == 3


# --------------------------------------------------------------- text and CSV forms
def test_text_forms_round_trip():
    spec = PipelineSpec(Placement(3, 2), 5, True)
    orders = SCHEDULES["interleaved-1f1b"](spec)
    text = format_orders(orders)
    assert text.splitlines()[0].startswith("rank0: 0F0 0F1 0F2")
    assert parse_orders(text) == orders
    assert parse_orders([" ".join(map(str, o)) for o in orders]) == orders
    assert parse_orders(" | ".join(", ".join(map(str, o)) for o in orders)) == orders
    shuffled = "\n\n".join(reversed(text.splitlines()))
    assert parse_orders(shuffled) == orders
    assert load_order_csv(dump_order_csv(orders)) == orders


def test_text_form_errors():
    with pytest.raises(ValueError, match="bad action '0X1'"):
        parse_orders("0F0 0X1")
    with pytest.raises(ValueError, match="rank 1 is given twice"):
        parse_orders("rank0: 0F0 | rank1: 1F0 | rank1: 1B0")
    with pytest.raises(ValueError, match="no order given for rank 1"):
        parse_orders("rank0: 0F0 | rank2: 2F0")
    with pytest.raises(ValueError, match="CSV row 1 .* cell 2: bad action 'oops'"):
        load_order_csv("0F0,0B0\n1F0,,oops\n")


def test_csv_special_cells():
    text = "0UNSHARD,0F0,,0SEND_F0,(0F1;0B0)OVERLAP_F_B,0B1,0REDUCE_GRAD\r\n\r\n"
    assert load_order_csv(text) == [[Task(0, "F", 0), Task(0, "F", 1), Task(0, "B", 0), Task(0, "B", 1)]]


# --------------------------------------------------------------- hint resolution
def test_every_hint_name_resolves_in_both_modes():
    for name in HINT_NAMES:
        place = Placement(3, 2, "v") if name in ("zb-v", "dualpipev") else Placement(3)
        for strict in (False, True):
            spec, hint, s = resolve_hint(("strict-" if strict else "") + name, place, 6)
            assert s is strict and hint.name == name
            assert hint.order is not None or not strict
            if hint.order is not None:
                validate_schedule(spec, hint.order)


def test_strict_policy_is_compiled_with_nominal_durations():
    spec, hint, strict = resolve_hint("strict-bf", Placement(4), 8, inflight_limit=one_f_one_b_limits(4))
    assert strict and hint.policy == "bf"
    assert hint.order == one_f_one_b(spec)
    spec, hint, _ = resolve_hint("strict-bfw", Placement(2), 2)
    assert spec.split_backward
    # rank 0 fills its wait for 1I1's gradient with W0 (W only as filler)
    assert format_orders(hint.order) == (
        "rank0: 0F0 0F1 0I0 0W0 0I1 0W1\n"
        "rank1: 1F0 1I0 1F1 1I1 1W0 1W1"
    )


def test_user_orders_as_hints(tmp_path):
    place = Placement(2)
    text = "order:rank0: 0F0 0F1 0B0 0B1 | rank1: 1F0 1B0 1F1 1B1"
    spec, hint, strict = resolve_hint("strict-" + text, place, 2)
    assert strict and not spec.split_backward and hint.name == "order"
    assert hint.order == one_f_one_b(spec)
    path = tmp_path / "mine.csv"
    path.write_text("0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n")
    for h in (str(path), f"csv:{path}", f"strict-{path}"):
        spec, hint, strict = resolve_hint(h, place, 2)
        assert spec.split_backward and hint.name == str(path) and strict == h.startswith("strict-")
    # readiness mode accepts any permutation; strict mode rejects an impossible one
    spec, hint, strict = resolve_hint("order:0B0 0F0 0B1 0F1 | 1F0 1B0 1F1 1B1", place, 2)
    assert not strict
    with pytest.raises(ScheduleError, match="rank 0, position 0: action 0B0 comes before its dependency 0F0"):
        resolve_hint("strict-order:0B0 0F0 0B1 0F1 | 1F0 1B0 1F1 1B1", place, 2)
    with pytest.raises(ScheduleError, match="action 0B0 is a full backward but the order also has split"):
        resolve_hint("order:0F0 0B0 | 1F0 1I0 1W0", Placement(2), 1)
    with pytest.raises(ScheduleError, match="not split: use B instead"):
        resolve_hint("order:0F0 0I0 0W0 | 1F0 1I0 1W0", Placement(2), 1, split_backward=False)


def test_unknown_hint_lists_the_forms():
    with pytest.raises(ValueError) as e:
        resolve_hint("1f1bb", Placement(2), 4)
    msg = str(e.value)
    assert "\n" not in msg and "unknown hint '1f1bb'" in msg
    for form in ("bf", "zb-v", "strict-<name>", "order:", "csv:<path>"):
        assert form in msg


def test_hint_equality_ignores_the_order():
    assert Hint("x", order=[[Task(0, "F", 0)]]) == Hint("x", order=None)
