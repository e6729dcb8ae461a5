"""Once ``auto`` has kept a hint, its steps run what that hint run directly runs (issue 33).

``auto`` measures a split-backward candidate on its third step and may try more in its trial;
a split backward routes the stage modules' affine layers through a Python autograd Function
(:mod:`rrfp.runtime.engine.split`). Before the fix those layers stayed routed after auto kept a
full-backward hint (strict-1f1b, bf): its forwards ran 10-30% longer than the same hint's run
directly (the bench's task records, jitter4/multimodal4/compute2). Counted here, never timed:
after each step, the routed layers are exactly those of a step whose records hold W tasks (an
independent witness of a split backward: only a split backward runs W), and after the choice
none is routed and every layer runs its own forward (the user's own, where they set one).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp
from rrfp.scheduler.tasks import W
from reference import ATOL, RTOL, sequential_reference
from rrfp.sim.trial import TRIAL_ROUNDS

M = 4
STEPS = 3 + 3 * TRIAL_ROUNDS + 2  # measuring, a trial of up to three candidates, two kept steps


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)) for _ in range(2)]


def _routed(mods: list[nn.Module]) -> int:
    """Layers the split backward routes now (its marker, set by ``enable_split_backward``)."""
    return sum("_rrfp_split" in m.__dict__ for mod in mods for m in mod.modules())


def _run(times: dict[str, float], mods: list[nn.Module]) -> tuple[list[tuple[str, int, bool]], str]:
    """Run auto with step times forced by hint; per step ``(hint, layers routed after it, W ran)``."""
    out = []
    with rrfp.LocalPipeline(mods, M, F.mse_loss, record=True) as pipe:
        strict = pipe.auto.strict
        pipe.auto.measure = lambda hint, stats: (times.get(hint, times["other"]) if hint != strict
                                                 else times["strict"], 1.0)
        for k in range(STEPS):
            g = torch.Generator().manual_seed(100 + k)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
            for m in mods:
                m.zero_grad(set_to_none=True)
            loss = pipe.step(x, target=y)
            _, ref_loss, ref_grads = sequential_reference(mods, x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            for m, grads in zip(mods, ref_grads):
                for p, gr in zip(m.parameters(), grads):
                    torch.testing.assert_close(p.grad, gr, rtol=RTOL, atol=ATOL)
            ran_w = any(r.task.kind == W for st in pipe.last_stats for r in st.records)
            out.append((pipe.hint_name, _routed(mods), ran_w))
        chosen = pipe.auto.chosen
    return out, chosen


def test_a_kept_full_backward_hint_runs_the_layers_own_forwards():
    mods = _modules()
    steps, chosen = _run({"strict": 1.0, "other": 1.05}, mods)
    assert chosen == "strict-1f1b"
    # The split candidate did run (step 3 measures it), with every affine layer routed (4 by hand).
    assert steps[2] == ("strict-split", 4, True)
    for hint, routed, ran_w in steps:
        assert routed == (4 if ran_w else 0), (hint, routed, ran_w)
    kept = steps[-2:]
    assert kept == [("strict-1f1b", 0, False)] * 2
    assert all("forward" not in m.__dict__ for mod in mods for m in mod.modules())


def test_an_adopted_split_hint_stays_routed_on_every_step():
    mods = _modules()
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with rrfp.LocalPipeline(mods, M, F.mse_loss, record=True) as pipe:
        assert pipe.auto.adopt("strict-split")
        for _ in range(3):
            pipe.step(x, target=y)
            ran_w = any(r.task.kind == W for st in pipe.last_stats for r in st.records)
            assert (pipe.hint_name, _routed(mods), ran_w) == ("strict-split", 4, True)
    assert _routed(mods) == 0


def test_set_hint_to_a_full_backward_undoes_the_routing_and_keeps_a_users_own_forward():
    mods = _modules()
    lin = mods[1][2]

    def own(self, x):  # the user's instance-level forward: what a full backward must run
        return F.linear(x, self.weight, self.bias)

    lin.forward = types.MethodType(own, lin)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with rrfp.LocalPipeline(mods, M, F.mse_loss, hint="strict-split") as pipe:
        # The layer with the user's own forward is never routed (its weight gradients come in I).
        assert _routed(mods) == 3
        assert lin.__dict__["forward"].__func__ is own
        for hint, want in (("bf", 0), ("strict-split", 3), ("strict-1f1b", 0), ("bfw-mem", 3), ("bf", 0)):
            pipe.set_hint(hint)
            assert _routed(mods) == want, hint
            for m in mods:
                m.zero_grad(set_to_none=True)
            loss = pipe.step(x, target=y)
            assert _routed(mods) == want, hint
            _, ref_loss, ref_grads = sequential_reference(mods, x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            for m, grads in zip(mods, ref_grads):
                for p, g in zip(m.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)
        # Back on a full backward: the user's own forward in place, the others the class's.
        assert lin.__dict__["forward"].__func__ is own
        assert all("forward" not in m.__dict__ for mod in mods for m in mod.modules() if m is not lin)


def test_a_split_hint_runs_a_users_own_forward_that_differs_from_the_class():
    mods = _modules()
    lin = mods[0][0]

    def own(self, x):  # the user's instance-level forward (a frozen scale, as an adapter would add)
        return 2.0 * F.linear(x, self.weight, self.bias)

    lin.forward = types.MethodType(own, lin)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    _, ref_loss, ref_grads = sequential_reference(mods, x, y)  # nothing routed yet: the user's model
    with rrfp.LocalPipeline(mods, M, F.mse_loss, hint="bf") as pipe:
        for hint in ("bf", "strict-split", "bf"):
            pipe.set_hint(hint)
            for m in mods:
                m.zero_grad(set_to_none=True)
            torch.testing.assert_close(pipe.step(x, target=y), ref_loss, rtol=RTOL, atol=ATOL, msg=hint)
            for m, grads in zip(mods, ref_grads):
                for p, g in zip(m.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL, msg=hint)


def test_a_forward_the_user_sets_while_routed_survives_a_switch_to_a_full_backward():
    mods = _modules()
    lin = mods[1][2]
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with rrfp.LocalPipeline(mods, M, F.mse_loss, hint="strict-split") as pipe:
        pipe.step(x, target=y)

        def own(self, x):  # set after the pipeline routed the layer (an adapter added mid-run)
            return 2.0 * F.linear(x, self.weight, self.bias)

        lin.forward = types.MethodType(own, lin)
        pipe.set_hint("bf")  # what auto does once it keeps a full-backward hint
        assert lin.__dict__.get("forward") is not None and lin.__dict__["forward"].__func__ is own
