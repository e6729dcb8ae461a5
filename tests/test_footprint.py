"""A rank's bytes by kind (rrfp.parallel.footprint) against hand counts: parameters, gradients
and AdamW states, a shared parameter once, views into one buffer each."""

from __future__ import annotations

import torch
from torch import nn

from rrfp.parallel.footprint import Footprint, footprint


def test_parameters_gradients_and_adamw_states_by_hand():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 3, bias=False)
    shared = nn.Sequential(a, a, b)  # a twice: its parameters count once
    opt = torch.optim.AdamW(shared.parameters(), lr=0.1)
    shared(torch.randn(2, 4)).sum().backward()
    n = 4 * 4 + 4 + 4 * 3  # elements: a.weight, a.bias, b.weight
    assert footprint([shared]) == Footprint(params=4 * n, grads=4 * n)
    opt.step()
    # AdamW: exp_avg and exp_avg_sq per element, a float32 step counter per parameter (3).
    assert footprint([shared], opt) == Footprint(params=4 * n, grads=4 * n, optimizer=2 * 4 * n + 3 * 4)
    assert footprint([shared], opt).state == 4 * n * 4 + 12


def test_views_into_one_gradient_buffer_each_count():
    p, q = nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(7))
    flat = torch.ones(12)
    p.grad, q.grad = flat[:5], flat[5:]  # a flat bucket, as gradient buffers are laid out
    m = nn.Module()
    m.p, m.q = p, q
    got = footprint([m, m])  # a module listed twice: its parameters once
    assert got.params == 12 * 4 and got.grads == 12 * 4
    assert got.peak == got.state == 24 * 4
