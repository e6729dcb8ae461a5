"""A memory budget is never silently broken: ``auto`` measures with, tries, keeps and falls back
to hints the budget gates (a strict order cannot wait for bytes, so it holds what its order holds
whatever the budget: on main ``rrfp train --memory-budget 4MiB`` kept ``strict-1f1b`` and held
8.07 MiB on rank 0, exit 0, no word), and a hint whose step breaks the budget anyway (a strict
one the user named) is said in one line naming the budget, the hint and what each rank held.

Peaks are the runtime's own meter (``StepStats.peak_bytes``) or the simulator's
(``peak_memory_rank``); the budget's rule lets a rank hold one microbatch however large, so a
rank may hold ``max(budget, its largest microbatch)``, its largest microbatch measured by an
independent strict probe run."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from rrfp.data.batches import make_microbatches
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.sim.auto import Profile, rank, simulate_auto
from rrfp.sim.compare import SimConfig, run_one
from rrfp.sim.costs import CostModel, StageCost

def mib(n: int) -> str:
    """How the line writes bytes (an independent copy: 2 decimals of MiB, plain bytes below 1 MiB)."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} bytes"


ACT = 1000  # bytes one microbatch's forward holds on every stage (the simulated profile's)
STAGES = tuple(StageCost(0.010, 0.020, 0.011, 0.011, ACT, 1) for _ in range(4))


def _sim_peaks(hint: str, budget: int) -> list[int]:
    cfg = SimConfig(n_ranks=4, n_microbatches=8, costs=CostModel(STAGES), memory_budget=budget)
    return run_one(cfg, hint, record=False)[0].peak_memory_rank


def test_the_ranking_drops_candidates_whose_simulated_peak_breaks_the_budget():
    # 2.5 microbatches: strict 1F1B holds 4 on rank 0 (4000 bytes), whatever the budget.
    budget = 2500
    assert _sim_peaks("strict-1f1b", budget)[0] == 4 * ACT
    r = rank(Profile(STAGES, (0.0, 0.0, 0.0)), n_ranks=4, n_microbatches=8, memory_budget=budget)
    names = [h for h, _ in r.order]
    skipped = dict(r.skipped)
    assert "strict-1f1b" not in names and r.strict is None
    assert skipped["strict-1f1b"] == "holds 4000 bytes on rank 0, over the memory budget 2500 bytes"
    # What is left holds to the budget in an independent simulation; what was dropped does not.
    assert names and all(max(_sim_peaks(h, budget)) <= budget for h in names)
    for h in ("strict-split", "backfill", "wfloat"):
        assert h not in names and max(_sim_peaks(h, budget)) > budget, h
    # Above the strict order's own peak nothing is dropped for the budget.
    r = rank(Profile(STAGES, (0.0, 0.0, 0.0)), n_ranks=4, n_microbatches=8, memory_budget=4 * ACT)
    assert r.strict == "strict-1f1b" and not any("over the memory budget" in w for _, w in r.skipped)


def test_simulated_auto_keeps_a_hint_within_the_budget():
    cfg = SimConfig(n_ranks=4, n_microbatches=8, costs=CostModel(STAGES), memory_budget=2500, seed=5)
    run = simulate_auto(cfg)
    assert "strict-1f1b" not in run.walls and run.chosen != "strict-1f1b"
    assert max(_sim_peaks(run.chosen, 2500)) <= 2500


# ---------------------------------------------------------------- the runtime, in process
CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)
M = 4


def _batch():
    text = b"def f(x):\n    return x * 2 + 1\n" * 8
    return make_microbatches([text[i: i + 30 + 3 * i] for i in range(8)], M)


def _steps(hint: str, budget, steps: int, run_length: int | None = None):
    """Each step's ``(hint, [peak bytes per rank], [microbatches in flight per rank])``."""
    stages = split_gpt(GPT(CFG, seed=1), 4)
    mbs, out = _batch(), []
    with LocalPipeline(stages, M, lm_loss, hint=hint, loss_weight_fn=count_tokens, memory_budget=budget) as pipe:
        if run_length is not None:
            pipe.auto.run_length(run_length)
        for _ in range(steps):
            pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
            out.append((pipe.hint_name, [s.peak_bytes for s in pipe.last_stats],
                        [s.peak_mb_inflight for s in pipe.last_stats]))
    return out


@pytest.fixture(scope="module")
def probe():
    """Strict 1F1B under a budget it ignores: per rank its own peak, and the largest microbatch
    (a budget of one byte runs one microbatch at a time under ``bf``)."""
    strict = _steps("strict-1f1b", 2**40, 1)[0][1]
    one = [max(p) for p in zip(*(peaks for _, peaks, _ in _steps("bf", 1, 2)))]
    budget = one[0] * 5 // 2  # 2.5 microbatches of rank 0: strict 1F1B holds 4 there
    assert one[0] < budget < strict[0]
    return strict, one, budget


@pytest.mark.timeout(600)
def test_default_auto_holds_to_the_budget_in_every_step(probe, caplog):
    strict, one, budget = probe
    with caplog.at_level(logging.INFO, logger="rrfp"):
        got = _steps("auto", budget, 12, run_length=12)
    for k, (hint, peaks, _) in enumerate(got):
        assert hint != "strict-1f1b", k
        assert all(p <= max(budget, o) for p, o in zip(peaks, one)), (k, hint, peaks, budget, one)
        assert peaks[0] <= budget < strict[0]
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == ("hint auto: steps 1-3 of this run measure costs (bf warms up, then bf, bfw-mem), "
                       "then 3 trial rounds of one step per candidate")
    assert not [s for s in said if "broke the memory budget" in s]
    assert re.search(r"hint auto chose (bf|bfw-mem):", "\n".join(said))


@pytest.mark.timeout(600)
def test_a_run_too_short_to_choose_falls_back_to_a_hint_the_budget_gates(probe, caplog):
    _, one, budget = probe
    with caplog.at_level(logging.INFO, logger="rrfp"):
        got = _steps("auto", budget, 2, run_length=2)
    assert [h for h, _, _ in got] == ["bf", "bf"]
    assert all(p <= max(budget, o) for _, peaks, _ in got for p, o in zip(peaks, one))
    assert ("hint auto: a run of 2 steps is too short to measure and try candidates (needs at least 9); it runs bf "
            "(under the memory budget: strict-1f1b cannot wait for bytes, bf holds to the budget)") in caplog.text


@pytest.mark.timeout(600)
def test_a_strict_hint_over_the_budget_says_so_once_naming_what_each_rank_held(probe, caplog):
    strict, _, budget = probe
    with caplog.at_level(logging.WARNING, logger="rrfp"):
        got = _steps("strict-1f1b", budget, 2)
    assert got[0][1] == strict and got[0][2] == [4, 3, 2, 1]  # the budget cannot change a strict order
    said = [r.getMessage() for r in caplog.records if "memory budget" in r.getMessage()]
    assert len(said) == 1, said  # once, not once per step or rank
    over = [(r, b, n) for r, (b, n) in enumerate(zip(got[0][1], got[0][2])) if b > budget and n > 1]
    assert over and over[0][0] == 0
    held = ", ".join(f"rank {r} held {mib(b)} ({n} microbatches)" for r, b, n in over)
    assert said[0] == (f"hint strict-1f1b broke the memory budget {mib(budget)} in step 1: {held}; it runs its "
                       "order's forwards whatever the budget (a strict order cannot wait for bytes); bf, bfw-mem, "
                       "auto or the order as a hint (without strict-) hold to it (said once)")


# ---------------------------------------------------------------- rrfp train, 4 processes
_ACTS = re.compile(r"activations \[([0-9. ]+)\]")


def _train(*flags: str) -> str:
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--steps", "14", "--memory-budget", "4MiB", *flags],
                       capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rrfp_train_auto_holds_the_users_budget():
    # The user's run: on main auto kept strict-1f1b, peak in-flight [4 3 2 1] at every step and
    # rank 0 held 8.07 MiB. Every step is checked by the ranks' own meter (no line said).
    out = _train()
    assert "broke the memory budget" not in out
    assert "steps 1-3 of this run measure costs (bf warms up, then bf, bfw-mem)" in out
    assert "peak in-flight [4 3 2 1]" not in out
    acts = [float(x) for x in _ACTS.search(out).group(1).split()]
    # Rank 3's one microbatch (the logits) is 2.77 MiB: under 4 MiB, so every rank is held to it.
    assert max(acts) <= 4.0, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rrfp_train_strict_over_the_budget_says_it_in_one_line():
    out = _train("--hint", "strict-1f1b")
    lines = [ln for ln in out.splitlines() if "broke the memory budget" in ln]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("rrfp train: hint strict-1f1b broke the memory budget 4.00 MiB in step 1: rank 0 held ")
    held = [float(x) for x in re.findall(r"held ([0-9.]+) MiB", lines[0])]
    assert held and all(h > 4.0 for h in held)


def test_rank_zeros_report_says_the_ranks_over_the_budget_once_and_drops_a_forged_flag(capsys):
    import io
    from types import SimpleNamespace

    from rrfp.scheduler.tasks import Placement
    from rrfp.train.progress import Output
    from rrfp.train.report import Reporter

    MiB = 2**20
    args = SimpleNamespace(steps=2, microbatches=4, quiet=False, hint="strict-1f1b", skip_nonfinite=False,
                           memory_budget="3MiB")
    out = io.StringIO()
    rep = Reporter(args, 2, Placement(2, 1, "loop"), Output(2, stream=out, bar=False))
    mem = lambda act: {"params": 0, "grads": 0, "optimizer": 0, "activations": act, "gathered": 0,  # noqa: E731
                       "rss": MiB, "cuda_allocated": None, "cuda_reserved": None, "limit": None, "headroom": None}
    for k in range(2):
        rep.step_time[k], rep.tokens[k] = 1.0, 10
        base = {"kind": "stats", "step": k, "busy": 0.5, "wall": 1.0}
        if k == 0:
            rep.add({**base, "peak": 2, "loss": 2.0, "mem": mem(MiB), "over": 5}, 1)  # forged: dropped
            assert "over=5 is neither False nor a hint's name" in capsys.readouterr().err
        rep.add({**base, "peak": 2, "loss": None, "mem": mem(5 * MiB), "over": "strict-1f1b"}, 0)
        rep.add({**base, "peak": 1, "loss": 2.0, "mem": mem(MiB), "over": False}, 1)
        rep.flush()
    lines = out.getvalue().splitlines()
    assert lines[1] == ("rrfp train: hint strict-1f1b broke the memory budget 3.00 MiB in step 1: rank 0 held 5.00 MiB "
                        "(2 microbatches); it runs its order's forwards whatever the budget (a strict order cannot "
                        "wait for bytes); bf, bfw-mem, auto or the order as a hint (without strict-) hold to it "
                        "(said once)")
    assert lines[0].startswith("step    1/2") and lines[2].startswith("step    2/2") and len(lines) == 3


def test_a_process_given_no_budget_measures_as_one_given_a_budget_from_the_second_step():
    # A pipeline whose processes were given a budget and none (test_auto_limits' two processes in
    # one event loop): after the first step, which runs each one's own plan, both learn that a rank
    # has a budget and measure with the hints it gates; the one given none says so.
    import asyncio

    from rrfp.runtime.features.auto import AutoHint
    from test_auto_limits import ACT as UNIT, Pair, _process, _stats

    pair, lines = Pair(), []
    pipes = [_process(r, 2, b) for r, b in enumerate([UNIT, None])]
    ctls = [AutoHint(p, pair.member(r), recheck_every=0, say=lines.append if r else None) for r, p in enumerate(pipes)]
    ran = []
    for k in range(3):
        for c in ctls:
            c.before_step(k)
        ran.append([c.current for c in ctls])

        async def both():
            await asyncio.gather(*(c.after_step(k, [_stats(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))))

        asyncio.run(both())
    assert ran == [["bf", "strict-1f1b"], ["bf", "bf"], ["bfw-mem", "bfw-mem"]]
    assert lines[1] == ("hint auto: a rank was given a memory budget: bf, bfw-mem from the next step (under the memory "
                        "budget: strict-1f1b cannot wait for bytes, bf holds to the budget)")
