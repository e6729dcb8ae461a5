"""Tied-weight models of the gradient-accumulation tests (``tests/test_tied_accumulation.py``
and the multi-process ``tests/par_worker.py``): rrfp's GPT with its LM head tied to the token
embedding, and tiny random Hugging Face GPT-2 and Qwen2 (built from their config classes here,
nothing downloads). Each comes as the whole model, one shared ``nn.Parameter`` (the
reference), and as stage modules holding copies of it, with the ``tied=`` that names them."""

from __future__ import annotations

import os

import torch

from rrfp.data.batches import pad_batch
from rrfp.model.gpt import GPT, GPTConfig, IGNORE_INDEX, lm_loss, split_gpt

CASES = ("gpt", "gpt2", "qwen2")
GPT_CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_len=64)
SEED = 11
ROWS = 4  # the batch of one step (every DP replica together)


def build(case: str, n_stages: int):
    """``(whole model, stage modules, tied)`` of ``case``: the whole model's head and
    embedding are one parameter; the stages hold independent copies of equal value."""
    if case == "gpt":
        model = GPT(GPT_CFG, seed=SEED)
        model.head.weight = model.tok_emb.weight
        return model, split_gpt(model, n_stages), {"wte": {0: "tok_emb.weight", -1: "head.weight"}}
    os.environ["HF_HUB_OFFLINE"] = "1"
    from rrfp.hf import hf_model, hf_ties, split_hf

    model = hf_model(case, seed=SEED, max_len=32)
    ties = hf_ties(model, n_stages)
    assert ties is not None, f"{case}: no tie to test"
    return model, split_hf(model, n_stages), ties


def batch(case: str, step: int):
    """Step ``step``'s whole batch: ``(input ids [ROWS, T], attention mask or None, targets)``,
    different for every step (padded rows, so token counts differ between rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    if case == "gpt":
        lengths = torch.randint(6, 20, (ROWS,), generator=g).tolist()
        samples = [bytes(torch.randint(32, 127, (n,), generator=g).tolist()) for n in lengths]
        tokens, targets = pad_batch(samples)
        return tokens, None, targets
    ids = torch.randint(0, 256, (ROWS, 10), generator=g)
    targets = torch.randint(0, 256, (ROWS, 10), generator=g)
    mask = torch.ones(ROWS, 10, dtype=torch.int64)
    mask[1, 6:] = 0  # right padding: masked keys, no loss there
    targets[mask == 0] = IGNORE_INDEX
    return ids, mask, targets


def forward_loss(model, ids, mask, targets) -> torch.Tensor:
    """The whole model's loss on a batch: the mean over its real target tokens."""
    out = model(ids) if mask is None else model(ids, attention_mask=mask).logits
    return lm_loss(out, targets)


def reference_grads(case: str, steps: int) -> dict[str, torch.Tensor]:
    """The whole model's gradients after ``steps`` backwards without zeroing in between (each
    step's loss its own batch's mean): the sum of the steps' gradients, by parameter name,
    a tie's names sharing one gradient."""
    model, _, _ = build(case, 2)
    for k in range(steps):
        forward_loss(model, *batch(case, k)).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def stage_grads(modules) -> dict[int, dict[str, torch.Tensor]]:
    """``{stage index: {whole-model parameter name: gradient}}`` of stage modules."""
    return {m.stage_index: {m.stage_param_names[n]: p.grad for n, p in m.named_parameters()} for m in modules}
