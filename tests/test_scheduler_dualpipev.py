"""The DualPipeV order: equal to ``torch.distributed.pipelining.ScheduleDualPipeV``'s action
lists for every shape PyTorch accepts, a valid strict schedule for every shape, run exactly by
the simulator, and equal to a single-process model run through the runtime in both modes."""

from __future__ import annotations

import re

import pytest

from rrfp.scheduler import SCHEDULES, Placement, PipelineSpec, resolve_hint, validate_schedule
from rrfp.sim.engine import simulate

from test_scheduler_schedules import FakeStage, _torch


def torch_dualpipev(p: int, m: int) -> list[list[str]]:
    """PyTorch's per-rank compute actions, each ``OVERLAP_F_B`` read as its forward then its
    backward (the order PyTorch's runtime executes them in on one device)."""
    S, mapping = _torch()
    if not hasattr(S, "ScheduleDualPipeV"):
        pytest.skip("torch.distributed.pipelining lacks ScheduleDualPipeV")
    owner = mapping(p, 2 * p, style="v")
    sched = S.ScheduleDualPipeV([FakeStage(s, 2 * p, p) for s in range(2 * p) if owner[s] == 0], m)
    out = []
    for r in range(p):
        acts = []
        for a in sched.pipeline_order[r]:
            if a is not None:
                acts += [str(x) for x in (a.sub_actions or (a,)) if x.is_compute_op]
        out.append(acts)
    return out


_FULL_B = re.compile(r"^(\d+)B(\d+)$")


def split_form(order: list[str]) -> list[str]:
    """A full backward ``sBm`` is ``sIm`` then ``sWm``."""
    return [y for a in order for y in ((_FULL_B.sub(r"\1I\2", a), _FULL_B.sub(r"\1W\2", a)) if _FULL_B.match(a) else (a,))]


def full_form(order: list[str]) -> list[str]:
    """Without a split backward: ``I`` is ``B`` and ``W`` is gone."""
    return [a.replace("I", "B") for a in order if "W" not in a]


def ours(p: int, m: int, split: bool) -> list[list[str]]:
    spec = PipelineSpec(Placement(p, 2, "v"), m, split)
    return [[str(t) for t in o] for o in SCHEDULES["dualpipev"](spec)]


@pytest.mark.parametrize("p", range(1, 9))
def test_equals_pytorchs_action_lists_for_every_accepted_shape(p):
    compared = 0
    for m in range(1, 2 * p + 10):
        try:
            theirs = torch_dualpipev(p, m)
        except ValueError:
            assert m < 2 * p  # PyTorch's only refusal: fewer microbatches than stages
            continue
        assert any(_FULL_B.match(a) for r in theirs for a in r) or p == 1  # PyTorch mixes both forms
        assert ours(p, m, True) == [split_form(o) for o in theirs], (p, m)
        assert ours(p, m, False) == [full_form(split_form(o)) for o in theirs], (p, m)
        compared += 1
    assert compared == 10


def test_the_papers_shape_on_two_ranks():
    # Hand-read from PyTorch 2.13's generator for p = 2, M = 4 (rank 1 holds stages 1 and 2).
    assert " ".join(ours(2, 4, True)[1]) == (
        "1F0 2F0 1F1 2F1 1F2 2I0 2W0 2F2 1I0 1W0 1F3 2I1 2W1 2F3 1I1 1W1 2I2 2W2 1I2 1W2 2I3 1I3 2W3 1W3"
    )


def test_valid_strict_schedule_for_every_shape_including_fewer_microbatches_than_stages():
    for p in range(1, 9):
        for m in range(1, 3 * p + 3):
            for split in (True, False):
                spec, hint, strict = resolve_hint("strict-dualpipev", Placement(p, 2, "v"), m, split)
                assert strict and spec.split_backward is split
                validate_schedule(spec, hint.order)
    spec, _, _ = resolve_hint("dualpipev", Placement(3, 2, "v"), 6)
    assert spec.split_backward  # the default form: PyTorch's I and W kept apart


@pytest.mark.parametrize("bad", [Placement(2, 2, "loop"), Placement(2), Placement(2, 3, "v")])
def test_placement_requirement_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match=r"^dualpipev needs 2 virtual stages per rank in the v placement \(got "):
        resolve_hint("dualpipev", bad, 8)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 5), (8, 20)])
def test_the_simulator_runs_the_strict_order_exactly(p, m):
    spec, hint, strict = resolve_hint("strict-dualpipev", Placement(p, 2, "v"), m)
    cost = {"F": 1.0, "I": 1.0, "W": 0.5, "B": 1.5}
    res = simulate(spec, hint, lambda step, r, t: cost[t.kind] * (1 + 0.1 * (t.stage % 3)), strict=True)
    ran = [[x.task for x in sorted(res.records, key=lambda x: x.start) if x.rank == r] for r in range(p)]
    assert ran == hint.order


# ------------------------------------------------------------- single-process reference
@pytest.mark.parametrize("strict", [False, True], ids=["ready", "strict"])
@pytest.mark.parametrize("n_ranks,M,split", [pytest.param(1, 2, True, id="p1-M2"), pytest.param(2, 4, True, id="p2-M4", marks=pytest.mark.slow),
                                             pytest.param(2, 3, True, id="p2-M3-fewer-than-stages"),
                                             pytest.param(2, 5, False, id="p2-M5-full-backward"),
                                             pytest.param(3, 6, True, id="p3-M6", marks=pytest.mark.slow),
                                             pytest.param(4, 9, True, id="p4-M9", marks=pytest.mark.slow)])
def test_matches_the_single_process_reference(n_ranks, M, split, strict):
    from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
    from rrfp.runtime.doors.local import LocalPipeline

    from test_runtime_hints import _batch, _check

    model = GPT(GPTConfig(n_layer=2 * n_ranks, n_head=2, d_model=32, max_len=64), seed=3)
    samples, mbs = _batch(M, 0)
    stages = split_gpt(model, 2 * n_ranks)
    # The full-backward form through the order text (a named hint takes its default form).
    hint = "dualpipev" if split else "order:" + " | ".join(" ".join(o) for o in ours(n_ranks, M, False))
    with LocalPipeline(stages, M, lm_loss, hint=("strict-" if strict else "") + hint, n_virtual=2,
                       placement="v", loss_weight_fn=count_tokens, delay=(0.0, 0.002)) as pipe:
        assert pipe.spec.split_backward is split
        loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    _check(model, samples, stages, loss)


def test_pytorchs_class_names_the_order():
    from rrfp.runtime.doors.names import hint_text

    S, _ = _torch()
    if not hasattr(S, "ScheduleDualPipeV"):
        pytest.skip("torch.distributed.pipelining lacks ScheduleDualPipeV")
    assert hint_text(S.ScheduleDualPipeV) == "dualpipev"
    assert hint_text("strict-DualPipeV") == "strict-dualpipev"
