"""``hint="auto"``, the default of both front doors, on real pipelines: every step's loss and
gradients equal the single-process reference whatever hint ran it, the kept hint is one of
the trial's candidates, every rank of a multi-process pipeline switches to the same hint
before the same step (through a process group, and through rrfp's control plane without
one), a run too short to choose keeps the strict schedule, and a candidate whose trial steps
were slower than the strict schedule's is never kept. Step times are forced through the
controller's ``measure`` hook, never read off a clock."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp
from rrfp.errors import PipelineError
from handover import rank_env, run_ranks
from reference import ATOL, RTOL, sequential_reference
from rrfp.sim.trial import EXTRA_ROUNDS, TRIAL_ROUNDS, trial_order

M = 4
STEPS = 3 + 3 * TRIAL_ROUNDS + 1  # measuring, a trial of up to three candidates, one kept step


def _modules(n: int = 2) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(n)]


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _forced(times: dict[str, float]):
    """A ``measure`` hook: the step's time by the hint that ran it (forward work 1.0)."""
    return lambda hint, stats: (times.get(hint, times["other"]), 1.0)


def _run_local(times: dict[str, float] | None, steps: int = STEPS, run_length: int | None = None):
    mods = _modules()
    ran = []
    with rrfp.LocalPipeline(mods, M, F.mse_loss) as pipe:
        assert pipe.config.hint == "auto" and pipe.auto is not None
        if times is not None:
            pipe.auto.measure = _forced({**times, pipe.auto.strict: times["strict"]})
        if run_length is not None:
            pipe.auto.run_length(run_length)
        for k in range(steps):
            x, y = _batch(k)
            for m in mods:
                m.zero_grad(set_to_none=True)
            loss = pipe.step(x, target=y)
            ran.append(pipe.hint_name)
            _, ref_loss, ref_grads = sequential_reference(mods, x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            for m, grads in zip(mods, ref_grads):
                for p, g in zip(m.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)
        return pipe.auto, ran


def test_local_pipeline_keeps_strict_when_every_candidate_was_slower(caplog):
    caplog.set_level(logging.INFO, logger="rrfp")
    auto, ran = _run_local({"strict": 1.0, "other": 1.05})
    assert ran[0] == auto.strict == "strict-1f1b"  # one stage per rank: 1F1B's strict order
    assert auto.chosen == auto.strict and ran[-1] == auto.strict
    assert auto.strict in auto.trial and len(auto.trial) >= 2  # a trial ran, and strict won it
    assert set(auto.trial) <= set(auto.known)
    chose = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert len(chose) == 1 and chose[0].startswith(f"hint auto chose {auto.strict}: median step over")


def test_local_pipeline_keeps_a_candidate_measured_faster():
    auto, ran = _run_local({"strict": 1.0, "other": 0.8})
    assert auto.chosen != auto.strict and auto.chosen in auto.trial and auto.chosen in auto.known
    # Measuring (strict warms up, strict, the split candidate), then each trial candidate once
    # per round, then the kept one.
    end = 3 + len(auto.trial) * TRIAL_ROUNDS
    assert ran[:3] == [auto.strict, auto.strict, "strict-split"]
    assert all(sorted(ran[3 + r * len(auto.trial):3 + (r + 1) * len(auto.trial)]) == sorted(auto.trial)
               for r in range(TRIAL_ROUNDS))
    assert ran[end:] == [auto.chosen] * (len(ran) - end)


def test_a_batchs_work_counts_tensors_nested_in_keyword_arguments():
    """A keyword argument may hold a list or dict of tensors (one per image, say), which torch's
    microbatch split accepts: their elements are part of the batch's work (on main before this,
    only a tuple of tensors and a dict's own tensor values were counted: 48 of 112 here)."""
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x, aux=None):
            return self.lin(x) + sum(t.sum() for t in aux["extra"])

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    aux = {"extra": [torch.randn(8, 3, generator=g), torch.randn(8, 5, generator=g)]}
    with rrfp.LocalPipeline([Stage(), Stage()], 4, F.mse_loss, hint="bf") as pipe:
        pipe.step(x, target=y, aux=aux)
        assert [st.input_elems for st in pipe.last_stats] == [x.numel() + 8 * 3 + 8 * 5, 0]


def test_the_trial_rescales_by_the_inputs_elements_not_by_the_forwards_seconds():
    """Each trial step's work figure is the elements of the batch it ran (8, 12 or 16 rows of
    6), whichever hint ran it and however long its forwards took: a figure of the forwards'
    seconds would credit a hint whose own forwards are slower (a split backward's routed
    layers, more microbatches in flight on shared cores)."""
    mods = _modules()
    fed = []
    with rrfp.LocalPipeline(mods, M, F.mse_loss) as pipe:
        for k in range(STEPS + 2 * EXTRA_ROUNDS):  # room for the extra rounds of a noisy trial
            rows = 8 + 4 * (k % 3)
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)
            pipe.step(x, target=y)
            fed.append(x.numel())
            assert [st.input_elems for st in pipe.last_stats] == [x.numel(), 0]  # stage 0's rank only
        auto = pipe.auto
        assert auto.chosen is not None
    first = 3 if auto.split else 2  # the measuring steps, then the trial's rounds
    want = {h: [] for h in auto.trial}
    k = first
    rounds = [trial_order(auto.trial, r) for r in range(TRIAL_ROUNDS)]
    rounds += [trial_order(auto.extension, r) for r in range(EXTRA_ROUNDS if auto.extension else 0)]
    for order in rounds:
        for h in order:
            want[h].append(float(fed[k]))
            k += 1
    assert {h: [w for _, w in v] for h, v in auto.walls.items()} == want


def test_a_tie_within_the_margin_keeps_strict():
    auto, _ = _run_local({"strict": 1.0, "other": 0.995})  # faster by 0.5%, under TIE (1%)
    assert auto.chosen == auto.strict


def test_a_local_run_too_short_runs_strict_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="rrfp")
    auto, ran = _run_local(None, steps=3, run_length=3)
    assert ran == [auto.strict] * 3 and auto.chosen is None and auto.too_short
    lines = [r.getMessage() for r in caplog.records if r.name == "rrfp"]
    assert lines == [f"hint auto: a run of 3 steps is too short to measure and try candidates "
                     f"(needs at least {auto.steps_needed()}); it runs {auto.strict}"]


def test_closing_before_a_choice_says_so(caplog):
    caplog.set_level(logging.INFO, logger="rrfp")
    auto, _ = _run_local(None, steps=2)
    assert auto.chosen is None
    want = (f"hint auto: closed after 2 steps, at least {auto.steps_needed() - 2} more were needed for a choice; "
            f"the last ran "
            f"{auto.strict} (run_length() keeps {auto.strict} throughout a run too short to choose)")
    assert [r.getMessage() for r in caplog.records if r.name == "rrfp"][-1] == want


def test_a_named_hint_has_no_controller():
    with rrfp.LocalPipeline(_modules(), M, F.mse_loss, hint="bf") as pipe:
        assert pipe.auto is None and pipe.hint_name == "bf" and pipe.plan.limits == [32, 32]


def test_auto_runs_its_candidates_at_the_strict_schedules_memory():
    # 4 ranks, 8 microbatches: 1F1B holds p - r (hand count); so does every auto step.
    mods = _modules(4)
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    with rrfp.LocalPipeline(mods, 8, F.mse_loss) as pipe:
        assert pipe.plan.limits == [4, 3, 2, 1]
        for _ in range(4):
            pipe.step(x, target=y)
            assert all(s.peak_inflight <= lim for s, lim in zip(pipe.last_stats, [4, 3, 2, 1]))


def test_the_control_plane_share_gathers_in_rank_order_and_keeps_other_messages():
    """Two ranks' runtimes over the fake network: parts larger than one control message come
    back whole and in rank order on both, max and sum agree, and a control message that is
    not auto's stays in the rank's control queue for its reader."""
    import asyncio

    from rrfp.runtime.features import share

    with rrfp.LocalPipeline(_modules(), M, F.mse_loss, hint="bf") as pipe:
        pipe.step(*_batch(0)[:1], target=_batch(0)[1])  # the ranks receive from their first step on
        rts = pipe.runtimes
        shares = [share.ControlShare(rt, 2, timeout=600) for rt in rts]
        n = 2 * share._PART_ITEMS + 3
        items = [[(r, i, 0.5 * i) for i in range(n)] for r in range(2)]

        async def both(make):
            return await asyncio.gather(*(make(r, sh) for r, sh in enumerate(shares)))

        async def users_message():
            rts[1].send_control(0, 0, {"users": 1})

        pipe.run(users_message())

        got = pipe.run(both(lambda r, sh: sh.gather(items[r])))
        want = [list(t) for t in items[0] + items[1]]
        assert [[list(t) for t in g] for g in got] == [want, want]
        assert pipe.run(both(lambda r, sh: sh.max(1.0 + r))) == [2.0, 2.0]
        assert pipe.run(both(lambda r, sh: sh.sum(1.0 + r))) == [3.0, 3.0]
        assert [m.meta for m in rts[0].poll_control()] == [{"users": 1}] and rts[1].poll_control() == []


@pytest.mark.parametrize("parts, says", [
    ([{"of": 0}], "'of' 0: expected a count of parts, 1..4096"),
    ([{"of": 10**9}], "'of' 1000000000"),
    ([{"part": 2, "of": 2}], "'part' 2: expected 0..1"),
    ([{"part": "0"}], "'part' '0'"),
    ([{"rrfp-auto": 7}], "exchange 7: expected 1 or 2"),
    ([{"rrfp-auto": 0}], "exchange 0: expected 1 or 2"),
    ([{"items": "x"}], "'items': expected a list of at most 256 items"),
    ([{"items": [1.0] * 257}], "'items': expected a list"),
    ([{"of": 2}, {"of": 2}], "part 0 of 2 again"),
    ([{"of": 2}, {"part": 1, "of": 3}], "a second count of parts (first 2)"),
    ([{"rrfp-auto": 2, "of": 2}, {"rrfp-auto": 2, "of": 2}], "part 0 of exchange 2 again"),
])
def test_a_malformed_auto_part_from_a_peer_is_refused_naming_it(parts, says):
    """A part no rank running this code sends (a count, index or exchange out of range, a
    repeat) stops the exchange with one error naming the sender and the field; on main before
    this check some were taken as figures (``of`` 0 ends the wait with no part) and others left
    the rank waiting for parts that never come."""
    from rrfp.runtime.features import share

    with rrfp.LocalPipeline(_modules(), M, F.mse_loss, hint="bf") as pipe:
        pipe.step(*_batch(0)[:1], target=_batch(0)[1])
        rts = pipe.runtimes
        ctl = share.ControlShare(rts[0], 2, timeout=60)  # a hang bound only

        async def peer_sends():
            for p in parts:
                rts[1].send_control(0, 1, {"kind": share.KIND, "rrfp-auto": 1, "part": 0, "of": 1, "items": [9.0], **p})

        pipe.run(peer_sends())
        with pytest.raises(PipelineError, match=re.escape(f"rank 1 sent a malformed auto message (exchange 1): ")
                           + ".*" + re.escape(says)):
            pipe.run(ctl.max(1.0))


# ------------------------------------------------------------------ processes


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    from torch.distributed import TCPStore

    from rrfp.transport.zmq import ZmqTransport

    mods = _modules()
    found = {}
    # Without a process group (a caller-made transport): the control plane shares the figures.
    # Rank 0 alone would keep the candidates (0.5 s), rank 1 alone the strict schedule: shared,
    # every candidate's step is the slowest rank's, 2.0 s, and both keep the strict schedule.
    store = TCPStore("127.0.0.1", port, world, is_master=False)
    control = {"strict": 1.0, "other": 0.5 if rank == 0 else 2.0}
    transport = ZmqTransport(rank, world, store, "auto-ctl")
    found["control"] = _steps(rank, world, mods, control, transport=transport, job="auto-ctl")
    # With one (torchrun's way): its collectives share them; every candidate beats strict.
    from rrfp.parallel.bootstrap import init_distributed

    init_distributed()
    found["dist"] = _steps(rank, world, mods, {"strict": 1.0, "other": 0.5 if rank == 0 else 0.6}, transport=None)
    torch.save(found, f"{out}/rank{rank}.pt")


def _steps(rank: int, world: int, mods, times, **options):
    stage = rrfp.PipelineStage(mods[rank], rank, world)
    ran, losses, grads, routed = [], [], [], []
    with rrfp.Pipeline(stage, M, F.mse_loss, watchdog=600, rank=rank, n_ranks=world, **options) as pipe:
        share = type(pipe.auto.share).__name__
        pipe.auto.measure = _forced({**times, pipe.auto.strict: times["strict"]})
        for k in range(STEPS):
            x, y = _batch(k)
            mods[rank].zero_grad(set_to_none=True)
            pipe.step(x if rank == 0 else None, target=y if rank == world - 1 else None)
            ran.append(pipe.hint_name)
            losses.append(pipe.last_loss)
            grads.append([p.grad.clone() for p in mods[rank].parameters()])
            routed.append(sum("_rrfp_split" in m.__dict__ for m in mods[rank].modules()))  # split backward's layers
        return {"routed": routed, "share": share, "ran": ran, "losses": losses, "grads": grads, "chosen": pipe.auto.chosen,
                "strict": pipe.auto.strict, "trial": pipe.auto.trial}


def _launch(tmp_path, world: int = 2) -> list[dict]:
    """Each rank's findings (``_rank_main``); a hang is bounded, not timed."""
    codes = run_ranks(_rank_main, world, str(tmp_path), timeout_s=880)
    assert codes == [0] * world, codes
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_rank_of_a_pipeline_switches_alike_and_matches_the_reference(tmp_path):
    parts, mods = _launch(tmp_path), _modules()
    for way, share in (("control", "ControlShare"), ("dist", "DistShare")):
        a, b = parts[0][way], parts[1][way]
        assert a["share"] == b["share"] == share
        assert a["ran"] == b["ran"] and a["chosen"] == b["chosen"] and a["trial"] == b["trial"], (a, b)
        assert a["chosen"] in a["trial"] and a["ran"][-1] == a["chosen"]
        if way == "control":
            assert a["chosen"] == a["strict"]  # the slowest rank's step time decides
            # Step 3 measured the split candidate (its one Linear routed); the kept strict
            # schedule runs the layer's own forward on every rank (issue 33: test_auto_kept.py).
            assert a["ran"][2] == "strict-split" and a["routed"][2] == b["routed"][2] == 1
            assert a["routed"][-1] == b["routed"][-1] == 0
        else:
            assert a["chosen"] != a["strict"]
        for k in range(STEPS):
            x, y = _batch(k)
            _, ref_loss, ref_grads = sequential_reference(mods, x, y)
            torch.testing.assert_close(torch.tensor(b["losses"][k]), ref_loss, rtol=RTOL, atol=ATOL)
            for got, want in zip(a["grads"][k] + b["grads"][k], [g for gs in ref_grads for g in gs]):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("steps", [-1, 2.5, "x", None, True])
def test_run_length_refuses_what_is_not_a_number_of_steps(steps):
    with rrfp.LocalPipeline(_modules(), M, F.mse_loss) as pipe:
        with pytest.raises(ValueError, match=rf"run_length\({steps!r}\): expected the run's number of steps"):
            pipe.auto.run_length(steps)


def test_run_length_after_the_first_step_is_refused():
    """It decides the plan before the first step; later it would silently switch to strict."""
    mods = _modules()
    with rrfp.LocalPipeline(mods, M, F.mse_loss) as pipe:
        x, y = _batch(0)
        pipe.step(x, target=y)
        with pytest.raises(RuntimeError, match=r"run_length\(6\) after 1 steps: call it before the first step"):
            pipe.auto.run_length(6)


@pytest.mark.parametrize("options, line", [
    ({"watchdog": -1}, "watchdog=-1: expected seconds >= 0 (0 disables the watchdog)"),
    ({"watchdog": float("nan")}, "watchdog=nan: expected seconds >= 0"),
    ({"deterministic": "yes"}, "deterministic='yes': expected True or False"),
])
def test_library_options_are_checked_as_the_cli_checks_them(options, line):
    with pytest.raises(ValueError) as e:
        rrfp.LocalPipeline(_modules(), M, F.mse_loss, **options)
    assert str(e.value).startswith(line)


def test_hint_none_means_the_default():
    with rrfp.LocalPipeline(_modules(), M, F.mse_loss, hint=None) as pipe:
        assert pipe.auto is not None and pipe.hint_name == pipe.auto.strict
