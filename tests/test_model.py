"""Tests of rrfp.model: the GPT, its pipeline split, the loss and the toy model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rrfp.data import make_microbatches, pad_batch
from rrfp.model import (
    GPT,
    GPT_PRESETS,
    IGNORE_INDEX,
    GPTConfig,
    ToyConfig,
    ToyModel,
    build_stage,
    build_toy_stage,
    count_tokens,
    lm_loss,
    split_gpt,
    split_toy,
    stage_layer_ranges,
    toy_batch,
    toy_loss,
)

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)


@pytest.fixture(autouse=True)
def _one_thread():
    # One thread keeps results reproducible and avoids oversubscribing the CI box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(CFG, seed=0)


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _samples(lengths: list[int], seed: int = 0) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    return [bytes(torch.randint(1, 256, (n,), generator=gen).tolist()) for n in lengths]


def _chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


# --- construction -------------------------------------------------------------


def test_presets():
    assert set(GPT_PRESETS) == {"tiny", "small", "medium"}
    sizes = {k: (c.n_layer, c.d_model, c.n_head) for k, c in GPT_PRESETS.items()}
    assert sizes == {"tiny": (4, 64, 2), "small": (8, 128, 4), "medium": (12, 256, 8)}
    for cfg in GPT_PRESETS.values():
        assert cfg.vocab_size == 256 and cfg.ff_width == 4 * cfg.d_model


def test_config_validation():
    with pytest.raises(ValueError, match="n_head=3 must divide d_model=32"):
        GPTConfig(n_head=3, d_model=32)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(n_layer=0)


def test_forward_shape_and_errors(model):
    logits = model(_tokens(2, 10))
    assert logits.shape == (2, 10, 256) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="T=65 exceeds max_len=64"):
        model(_tokens(1, 65))
    with pytest.raises(ValueError, match="int64"):
        model(_tokens(1, 5).to(torch.int32))


def test_init_is_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = GPT(CFG, seed=7), GPT(CFG, seed=7), GPT(CFG, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "weight" in name and "ln" not in name:
            assert not torch.equal(pa, pc), name


# --- pipeline split -----------------------------------------------------------


def test_stage_layer_ranges_are_even_and_contiguous():
    for n_layer in range(1, 13):
        for n_stages in range(1, n_layer + 1):
            ranges = stage_layer_ranges(n_layer, n_stages)
            assert [i for r in ranges for i in r] == list(range(n_layer))
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
            expected = [len(t) for t in torch.tensor_split(torch.arange(n_layer), n_stages)]
            assert sizes == expected


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_split_gpt_copies_weights_and_shares_nothing(model, n_stages):
    stages = split_gpt(model, n_stages)
    assert len(stages) == n_stages
    full = dict(model.named_parameters())
    storages = {p.data_ptr() for p in model.parameters()}
    seen_full_names = []
    for s, stage in enumerate(stages):
        assert stage.stage_index == s and stage.n_stages == n_stages
        assert stage.is_first == (s == 0) and stage.is_last == (s == n_stages - 1)
        names = dict(stage.named_parameters())
        assert set(stage.stage_param_names) == set(names)
        for name, p in names.items():
            ref = full[stage.stage_param_names[name]]
            assert torch.equal(p, ref), name
            assert p.data_ptr() not in storages, f"stage {s} shares {name}"
            storages.add(p.data_ptr())
        seen_full_names.extend(stage.stage_param_names.values())
    # Every parameter of the full model belongs to exactly one stage.
    assert sorted(seen_full_names) == sorted(full)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_build_stage_matches_split(model, n_stages):
    stages = split_gpt(model, n_stages)
    for s in range(n_stages):
        built = build_stage(CFG, n_stages, s, seed=0)
        assert built.stage_param_names == stages[s].stage_param_names
        ref = stages[s].state_dict()
        got = built.state_dict()
        assert list(got) == list(ref)
        for name in ref:
            assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_chained_stages_equal_full_forward_exactly(model, n_stages):
    tokens = _tokens(3, 17)
    with torch.no_grad():
        expected = model(tokens)
        got = _chain(split_gpt(model, n_stages), tokens)
    assert torch.equal(got, expected)


def test_stage_io_shapes(model):
    first, middle, last = split_gpt(model, 3)
    tokens = _tokens(2, 9)
    hidden = first(tokens)
    assert hidden.shape == (2, 9, CFG.d_model) and hidden.dtype == torch.float32
    hidden = middle(hidden)
    assert hidden.shape == (2, 9, CFG.d_model)
    assert last(hidden).shape == (2, 9, CFG.vocab_size)
    with pytest.raises(ValueError, match="expects hidden"):
        middle(tokens)


def test_bad_n_stages_messages(model):
    with pytest.raises(ValueError) as err:
        split_gpt(model, 5)
    assert str(err.value) == (
        "n_stages=5 exceeds n_layer=4: each stage needs at least one transformer block"
    )
    with pytest.raises(ValueError, match=r"^n_stages=0 must be >= 1$"):
        split_gpt(model, 0)
    with pytest.raises(ValueError, match="n_stages=5 exceeds n_layer=4"):
        build_stage(CFG, 5, 0)
    with pytest.raises(ValueError, match=r"^stage_index=2 is outside 0\.\.1$"):
        build_stage(CFG, 2, 2)
    with pytest.raises(ValueError, match="stage_index=-1"):
        build_stage(CFG, 2, -1)


# --- loss and padding ---------------------------------------------------------


def test_lm_loss_and_count_tokens():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [4, IGNORE_INDEX, IGNORE_INDEX]])
    assert count_tokens(targets) == 3
    real = targets != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[real], targets[real])
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    # No real position: zero loss with zero gradient, never NaN.
    logits.requires_grad_(True)
    empty = lm_loss(logits, torch.full((2, 3), IGNORE_INDEX))
    empty.backward()
    assert empty.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    with pytest.raises(ValueError, match="lm_loss expects"):
        lm_loss(logits, targets[:, :2])


def test_padding_invariance(model):
    samples = _samples([5, 12, 30, 2])
    tokens, targets = pad_batch(samples)  # padded to its own max: T = 29
    longer = torch.zeros(len(samples), 50, dtype=torch.int64)
    longer[:, : tokens.shape[1]] = tokens
    with torch.no_grad():
        short_logits, long_logits = model(tokens), model(longer)
    for i, s in enumerate(samples):
        n = len(s) - 1
        torch.testing.assert_close(short_logits[i, :n], long_logits[i, :n], rtol=1e-5, atol=1e-6)
    # Padding each microbatch to its own max is the same kind of change.
    row = 0
    for mb in make_microbatches(samples, 3):
        with torch.no_grad():
            mb_logits = model(mb.tokens)
        for j in range(mb.size):
            n = len(samples[row]) - 1
            torch.testing.assert_close(mb_logits[j, :n], short_logits[row, :n], rtol=1e-5, atol=1e-6)
            row += 1


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("n_microbatches", [1, 2, 3, 5])
def test_weighted_microbatch_loss_matches_full_batch(n_microbatches):
    model = GPT(CFG, seed=1)
    samples = _samples([3, 40, 9, 22, 17, 2, 31], seed=n_microbatches)
    tokens, targets = pad_batch(samples)
    ref_loss = lm_loss(model(tokens), targets)
    ref_loss.backward()
    ref_grads = _grads(model)

    # Pipeline emulation: each microbatch flows through the stages and is
    # backpropagated with weight n_tokens / total.
    stages = split_gpt(GPT(CFG, seed=1), 3)
    microbatches = make_microbatches(samples, n_microbatches)
    total = sum(mb.n_tokens for mb in microbatches)
    assert total == count_tokens(targets)
    loss = 0.0
    for mb in microbatches:
        weighted = lm_loss(_chain(stages, mb.tokens), mb.targets) * (mb.n_tokens / total)
        weighted.backward()
        loss += weighted.item()
    torch.testing.assert_close(torch.tensor(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for stage in stages:
        for name, p in stage.named_parameters():
            full_name = stage.stage_param_names[name]
            torch.testing.assert_close(p.grad, ref_grads[full_name], rtol=1e-5, atol=1e-6, msg=full_name)


# --- toy model ----------------------------------------------------------------


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_toy_chain_equals_reference(n_stages):
    cfg = ToyConfig()
    model = ToyModel(cfg, seed=3)
    inputs, targets = toy_batch(cfg, 6, seed=0)
    stages = split_toy(model, n_stages)
    with torch.no_grad():
        expected = model(inputs)
        assert torch.equal(_chain(stages, inputs), expected)
        # The runtime's calling convention: stage(*outputs_of_previous_stage).
        io = inputs
        for stage in stages:
            io = stage(*io) if isinstance(io, tuple) else stage(io)
        assert torch.equal(io, expected)
        assert torch.equal(model(*inputs), expected)
    for s, stage in enumerate(stages):
        built = build_toy_stage(cfg, n_stages, s, seed=3)
        for (name, p), q in zip(stage.named_parameters(), built.parameters()):
            assert torch.equal(p, q), name
    names = [n for st in stages for n in st.stage_param_names.values()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_toy_tuple_io_and_gradients():
    cfg = ToyConfig()
    model = ToyModel(cfg, seed=0)
    first, last = split_toy(model, 2)
    inputs, targets = toy_batch(cfg, 5, seed=1)
    x, ids, mask, scale = inputs
    assert x.dtype == torch.float32 and ids.dtype == torch.int64
    assert mask.dtype == torch.bool and scale.dtype == torch.float32
    assert mask.any() and not mask.all()

    out = first(inputs)
    assert isinstance(out, tuple) and len(out) == 4
    hx, hids, hmask, hscale = out
    assert hx.requires_grad and hx.shape == (5, cfg.d)
    assert not hscale.requires_grad and hscale is scale
    assert hids.dtype == torch.int64 and not torch.equal(hids, ids)  # ids change per layer
    assert hmask.dtype == torch.bool

    # Stage-boundary emulation: the receiver gets a leaf activation.
    received = (hx.detach().requires_grad_(True), hids, hmask, hscale)
    logits = last(received)
    assert logits.shape == (5, cfg.n_out) and logits.dtype == torch.float32
    toy_loss(logits, targets).backward()
    hx.backward(received[0].grad)
    reference = ToyModel(cfg, seed=0)
    toy_loss(reference(inputs), targets).backward()
    ref_grads = dict(reference.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[stage.stage_param_names[name]].grad)
    # Every input is used: the embedding gets gradient only through ids/mask.
    assert all(torch.count_nonzero(l.embedding.weight.grad) > 0 for l in first.layers)


def test_toy_errors():
    cfg = ToyConfig(n_layer=2)
    with pytest.raises(ValueError, match="n_stages=3 exceeds n_layer=2"):
        split_toy(ToyModel(cfg), 3)
    with pytest.raises(ValueError, match="stage_index=2"):
        build_toy_stage(cfg, 2, 2)
    model = ToyModel(cfg)
    (x, ids, mask, scale), _ = toy_batch(cfg, 3)
    with pytest.raises(ValueError, match="expected"):
        model((x, ids.float(), mask, scale))
    with pytest.raises(ValueError, match="four tensors or one tuple"):
        model(x)
    with pytest.raises(ValueError, match="four tensors or one tuple"):
        model(x, ids, mask)
    with pytest.raises(ValueError, match="ToyConfig.d=0"):
        dataclasses.replace(cfg, d=0)
