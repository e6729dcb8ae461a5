"""Every hint, both placements and virtual stages, split backward and deterministic mode,
against the single-process reference (in-process, fake transport)."""

from __future__ import annotations

import copy

import pytest
import torch

from rrfp.data.batches import Microbatch, pad_batch
from rrfp.model.gpt import GPT, GPTConfig, count_tokens, lm_loss, split_gpt
from rrfp.runtime.doors.local import LocalPipeline

from reference import ATOL, RTOL, assert_stage_grads, gpt_reference
CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)
TEXT = b"class A:\n    def f(self, x):\n        return [x] * 3\n" * 4


def _batch(n_microbatches: int, seed: int) -> tuple[list[bytes], list[Microbatch]]:
    """One sample per microbatch, each of a different length: every microbatch has its own
    sequence length."""
    lengths = [5 + 7 * m + seed for m in range(n_microbatches)]
    samples = [TEXT[m : m + n] for m, n in enumerate(lengths)]
    mbs = [Microbatch(*pad_batch([s])) for s in samples]
    assert len({mb.tokens.shape[1] for mb in mbs}) == n_microbatches
    return samples, mbs


def _run(n_ranks, n_virtual, placement, hint, M, *, seed=0, delay=(0.0, 0.002), deterministic=False, model=None):
    model = model or GPT(CFG, seed=3)
    samples, mbs = _batch(M, seed)
    stages = split_gpt(model, n_ranks * n_virtual)
    with LocalPipeline(stages, M, lm_loss, hint=hint, n_virtual=n_virtual, placement=placement,
                       loss_weight_fn=count_tokens, delay=delay, seed=seed, deterministic=deterministic) as pipe:
        loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    return model, samples, stages, loss


def _check(model, samples, stages, loss):
    ref_loss, ref_grads = gpt_reference(model, samples)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


ONE_STAGE_PER_RANK = ["bf", "bfw", "fb", "b-priority", "f-priority", "gpipe", "1f1b", "zb-h1"]


@pytest.mark.parametrize("strict", [pytest.param(False, id="ready"), pytest.param(True, id="strict", marks=pytest.mark.slow)])
@pytest.mark.parametrize("hint", ONE_STAGE_PER_RANK)
@pytest.mark.parametrize("n_ranks,M", [pytest.param(2, 3, id="M-not-divisible"),
                                       pytest.param(4, 2, id="M-fewer-than-stages", marks=pytest.mark.slow)])
def test_every_hint_one_stage_per_rank(hint, strict, n_ranks, M):
    if strict and hint == "zb-h1" and M < n_ranks:
        pytest.skip("PyTorch's ZB-H1 order needs at least as many microbatches as ranks")
    _check(*_run(n_ranks, 1, "loop", ("strict-" if strict else "") + hint, M))


@pytest.mark.parametrize("strict", [False, True], ids=["ready", "strict"])
@pytest.mark.parametrize(
    "hint,placement,M",
    [  # the quick subset (-m "not slow") keeps bf, bfw and fb on the loop placement and bf on the V
        ("bf", "loop", 3), ("bfw", "loop", 3), ("fb", "loop", 2),
        *(pytest.param(*case, marks=pytest.mark.slow) for case in [
            ("b-priority", "loop", 3), ("f-priority", "loop", 3), ("interleaved-1f1b", "loop", 4), ("looped-bfs", "loop", 3),
            ("gpipe", "loop", 3)]),
        ("bf", "v", 3),
        *(pytest.param(*case, marks=pytest.mark.slow) for case in [("bfw", "v", 3), ("zb-v", "v", 4), ("zb-v", "v", 3)]),
    ],
)
def test_two_ranks_two_virtual_stages_each_microbatch_its_own_length(hint, placement, M, strict):
    # Rank 0 holds stages 0 and 2 (loop) or 0 and 3 (v): its previous and next peer are the
    # same rank, so activations and gradients of different stages must never cross.
    _check(*_run(2, 2, placement, ("strict-" if strict else "") + hint, M))


@pytest.mark.slow
def test_custom_order_as_text():
    order = "order:rank0: 0F0 0F1 0B0 0B1 | rank1: 1F0 1B0 1F1 1B1"
    _check(*_run(2, 1, "loop", order, 2))
    _check(*_run(2, 1, "loop", "strict-" + order, 2))


def test_small_inflight_limit_still_correct():
    model = GPT(CFG, seed=5)
    samples, mbs = _batch(6, 1)
    stages = split_gpt(model, 4)
    with LocalPipeline(stages, 6, lm_loss, hint="bf", n_virtual=2, inflight_limit=1, loss_weight_fn=count_tokens,
                       delay=(0, 0.002)) as pipe:
        loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
        assert max(st.peak_inflight for st in pipe.last_stats) <= 1 + 2
    _check(model, samples, stages, loss)


# Backward orders forced by strict user orders (no timing involved): the same microbatches'
# gradients summed in opposite orders, on 2 ranks of one stage each, 4 microbatches.
_FORWARDS = {r: " ".join(f"{r}F{m}" for m in range(4)) for r in (0, 1)}
ORDERS = {
    "bf": ["0 1 2 3", "3 1 0 2"],
    "bfw": ["0 1 2 3", "2 0 3 1"],
}


def _forced_order(hint: str, mbs: str) -> str:
    if hint == "bfw":  # I in the given order, then W in the reverse order
        back = {r: " ".join([f"{r}I{m}" for m in mbs.split()] + [f"{r}W{m}" for m in reversed(mbs.split())])
                for r in (0, 1)}
    else:
        back = {r: " ".join(f"{r}B{m}" for m in mbs.split()) for r in (0, 1)}
    return f"strict-order:rank0: {_FORWARDS[0]} {back[0]} | rank1: {_FORWARDS[1]} {back[1]}"


def _train(deterministic: bool, order: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG, seed=11)
    stages = split_gpt(model, 2)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    with LocalPipeline(stages, 4, lm_loss, hint=order, loss_weight_fn=count_tokens,
                       deterministic=deterministic) as pipe:
        for step in range(2):
            _, mbs = _batch(4, step)
            opt.zero_grad()
            pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
            opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.slow
@pytest.mark.parametrize("hint", ["bf", "bfw"])
def test_deterministic_mode_is_bitwise_reproducible_under_adversarial_orders(hint):
    a, b = (_train(True, _forced_order(hint, o)) for o in ORDERS[hint])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # The orders really differ in what they sum first: without the mode the bits differ.
    c, d = (_train(False, _forced_order(hint, o)) for o in ORDERS[hint])
    assert not all(torch.equal(x, y) for x, y in zip(c, d))
    for x, y in zip(a, c):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)


def test_deterministic_mode_equals_reference():
    _check(*_run(2, 2, "loop", "bfw", 5, deterministic=True))


def test_split_backward_defers_linear_weight_gradients_to_w():
    from rrfp.runtime.engine.split import WeightGradStore, deferring, enable_split_backward

    full = split_gpt(GPT(CFG, seed=8), 2)[1]
    split = copy.deepcopy(full)
    assert enable_split_backward(split) > 0
    x = torch.randn(2, 9, CFG.d_model)
    g = torch.randn(2, 9, CFG.vocab_size)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward([full(xa)], [g])
    store = WeightGradStore()
    with deferring(store):
        torch.autograd.backward([split(xb)], [g])
    # After I: the input gradient is complete, linear weights have none yet, norms have theirs.
    torch.testing.assert_close(xb.grad, xa.grad, rtol=RTOL, atol=ATOL)
    linear = {n for n, m in split.named_modules() if isinstance(m, torch.nn.Linear)}
    for n, p in split.named_parameters():
        owner = n.rsplit(".", 1)[0]
        assert (p.grad is None) == (owner in linear), n
    assert len(store) > 0
    store.flush()  # W
    for (n, p), q in zip(split.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("hint", ["strict-f-priority", "strict-bf"])
def test_strict_policy_with_per_rank_limits_compiles_one_schedule_for_all_ranks(hint):
    # Every rank must compile the same orders from the whole list of limits, or they deadlock.
    model = GPT(CFG, seed=9)
    samples, mbs = _batch(6, 2)
    stages = split_gpt(model, 4)
    with LocalPipeline(stages, 6, lm_loss, hint=hint, inflight_limit=[4, 3, 2, 1], loss_weight_fn=count_tokens,
                       delay=(0.0, 0.002), watchdog=20) as pipe:
        loss = pipe.step(microbatches=[(mb.tokens,) for mb in mbs], targets=[mb.targets for mb in mbs])
    _check(model, samples, stages, loss)


def test_bad_inflight_limits_are_one_line_errors():
    stages = split_gpt(GPT(CFG), 2)
    for bad, said in [
        ("1f1b", "inflight_limit='1f1b': expected an integer >= 1 or a list of 2, one per rank"),
        (0, "inflight_limit=0: expected an integer >= 1 or a list of 2, one per rank"),
        ([1, 2, 3], "inflight_limit=[1, 2, 3]: 3 limits for 2 ranks; expected one integer >= 1 per rank"),
        ([1, 0], "inflight_limit=[1, 0]: 0 is not an integer >= 1; expected one integer >= 1 per rank"),
    ]:
        with pytest.raises(ValueError) as err:
            LocalPipeline(stages, 2, lm_loss, inflight_limit=bad)
        assert str(err.value) == said


def test_split_backward_under_bf16_autocast_matches_autocasts_own_backward():
    """A split backward (I now, W deferred) of a layer run under bf16 autocast: the gradients
    equal autocast's own backward of the same layer (float32 parameters, bf16 matmuls)."""
    import copy

    import torch
    from torch import nn

    from rrfp.runtime.engine.split import WeightGradStore, deferring, enable_split_backward

    torch.manual_seed(0)
    # No bias on the first layer, as written before the routed forward ran F.linear (whose
    # biased output stays bf16 too): the second layer saves a bf16 input and gets a bf16 gradient.
    ref = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 4, bias=False))
    lay = copy.deepcopy(ref)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ref(x)
    y.float().square().sum().backward()
    assert enable_split_backward(lay) == 2
    store = WeightGradStore()
    with deferring(store, lay):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y2 = lay(x)
        y2.float().square().sum().backward()
    assert len(store) == 2 and all(p.grad is None for p in lay.parameters() if p.dim() == 2)
    store.flush()
    for (n, p), q in zip(ref.named_parameters(), lay.parameters()):
        assert q.grad.dtype == torch.float32, n
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=2e-2, msg=n)
