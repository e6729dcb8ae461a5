"""PP2 x TP2 on 4 gloo processes under every split-backward hint family (tests/par_worker.py
``tp-hints``: bfw-mem, bfw, wfloat, strict-split, zb-h1), two SGD steps each, against the
single-process GPT (fp32, rtol 1e-5, atol 1e-6).

A TP group agrees on F and I but not on W, so a TP collective inside W pairs with whatever the
TP peer runs at that moment. Before the fix the first stage ran its whole backward, the TP
layers' all-reduces included, in W: ``rrfp train --stages 2 --tp 2 --hint bfw-mem`` (and
``auto``, which picks bfw-mem) hung until gloo's timeout on some runs. The worker injects
delays (``par_worker.w_race``) that bring that moment about in the first step of every hint,
so on the old code this launch hangs (the timeout below ends it) instead of passing by luck.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from rrfp.model.tp import tp_slice

sys.path.insert(0, str(Path(__file__).parent))
import par_worker as W  # noqa: E402
from handover import AGENT_STORE, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
TOL = dict(rtol=1e-5, atol=1e-6)
LAUNCH_TIMEOUT_S = 300  # a fixed run takes ~20-60 s on 2 loaded cores; bounds a hang only


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_hints")
    # Forks of the session's zygote (tests/handover.py); their output goes to the test's own.
    codes = run_ranks(W.main, 4, str(out), "tp-hints", timeout_s=LAUNCH_TIMEOUT_S, env={"OMP_NUM_THREADS": "1", **AGENT_STORE})
    done = sorted(f.name.split(".")[0] for f in out.glob("*.rank0.pt"))
    assert -signal.SIGKILL not in codes, f"PP2 x TP2 hung (killed after {LAUNCH_TIMEOUT_S} s); scenarios done: {done}"
    assert codes == [0] * 4, codes
    return out


@pytest.mark.parametrize("hint", W.TP_HINTS)
def test_pp2_tp2_split_hint_matches_reference(results, hint):
    """Both steps' losses and the second step's gradients (each TP rank's slice) equal the
    single-process model's; stage by stage the TP ranks ran their F and I tasks (the
    collective-bearing ones) in one order."""
    losses, _, grads = W.reference(steps=2)
    parts = [torch.load(results / f"tp-{hint}.rank{r}.pt") for r in range(4)]
    for part in parts:
        pp, _, tp = part["coords"]
        for name, g in part["grads"].items():
            want = tp_slice(name, grads[name], tp, 2, W.CFG.d_model, W.CFG.n_head)
            torch.testing.assert_close(g, want, **TOL, msg=lambda m: f"{hint}: pp {pp} tp {tp} {name}: {m}")
        if pp == 1:
            assert len(part["losses"]) == 2
            for got, want in zip(part["losses"], losses):
                torch.testing.assert_close(got, want, **TOL)
    for tp in range(2):  # each TP coordinate's pipeline holds every parameter once
        assert {n for part in parts if part["coords"][2] == tp for n in part["grads"]} == set(grads)
    by = {part["coords"]: part["orders"] for part in parts}
    for step in range(2):
        for pp in range(2):
            agreed = [[t for t in by[(pp, 0, tp)][step] if "W" not in t] for tp in range(2)]
            assert agreed[0] == agreed[1], (hint, step, pp)
            assert len(agreed[0]) == 2 * W.M, (hint, step, pp)


def test_the_injected_delays_bring_the_w_race_about(results):
    """The control: in the first step the delays made stage 0's TP ranks order W(0, 0) and
    I(0, 1) differently under the hints that float W (TP rank 0 ran W(0, 0) first, rank 1
    I(0, 1) first), the moment at which a collective in W deadlocked; the strict orders run
    one order on both."""
    raced = {}
    for hint in W.TP_HINTS:
        parts = {p["coords"]: p for p in (torch.load(results / f"tp-{hint}.rank{r}.pt") for r in range(4))}
        orders = [parts[(0, 0, tp)]["orders"][0] for tp in range(2)]
        raced[hint] = [o.index("0W0") < o.index("0I1") for o in orders]
    assert raced == {"bfw-mem": [True, False], "bfw": [True, False], "wfloat": [True, False],
                     "strict-split": [True, True], "zb-h1": [True, True]}
