"""``auto``'s gathered items and shared figures from a peer that this code cannot send (a peer
running other code): every process refuses them with the same PipelineError naming the item,
before any ranking, not an IndexError, ValueError or TypeError from deep in the controller (or a
figure taken as it came: a rank the pipeline lacks, a time that is a string)."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from rrfp.errors import PipelineError
from rrfp.runtime.features.auto import AutoHint
from test_auto_sizes import M, _process, _Share, _stats


def _forge(kind, bad):
    class Forged(_Share):
        async def gather(self, items):
            if self.r == 1 and items and isinstance(items[0], tuple):  # rank 1's first item of `kind`
                i = next(j for j, x in enumerate(items) if x[0] == kind)
                items = [*items[:i], *bad(items[i]), *items[i + 1:]]
            return await _Share.gather(self, items)
    return Forged


@pytest.mark.parametrize("kind,bad,what", [
    ("r", lambda x: [x[:6]], "('r', 1, 'F', 0, 0.0, 0.0009765625)"),          # cut short
    ("r", lambda x: [(*x[:4], "0", *x[5:])], "('r', 1, 'F', 0, '0', "),         # a start that is a string
    ("r", lambda x: [(*x[:4], math.nan, *x[5:])], "('r', 1, 'F', 0, nan, "),    # not a finite time
    ("r", lambda x: [(*x[:4], 1.0, *x[5:])], "('r', 1, 'F', 0, 1.0, 0.0009765625, "),  # ends before it starts
    ("r", lambda x: [(x[0], 7, *x[2:])], "('r', 7, 'F', 0, "),                   # a stage it lacks
    ("r", lambda x: [(*x[:2], "X", *x[3:])], "('r', 1, 'X', 0, "),               # no task kind
    ("r", lambda x: [(*x[:3], M, *x[4:])], f"('r', 1, 'F', {M}, "),             # a microbatch it lacks
    ("l", lambda x: [(x[0], 5, *x[2:])], "('l', 5, 4, 10000)"),                 # a rank it lacks
    ("l", lambda x: [(*x[:2], 0, x[3])], "('l', 1, 0, 10000)"),                 # no in-flight limit
    ("l", lambda x: [(*x[:3], "big")], "('l', 1, 4, 'big')"),                   # a budget that is no size
    ("a", lambda x: [(x[0], x[1], -1)], "('a', 1, -1)"),                        # negative bytes
    ("a", lambda x: [(x[0], 9, x[2])], "('a', 9, "),                            # a stage it lacks
    ("a", lambda x: [x, ()], "()"),                                             # an empty item
    ("a", lambda x: [x, 5], "5"),                                               # not a sequence
    ("a", lambda x: [x, ("z", 1)], "('z', 1)"),                                 # no item kind
])
def test_a_malformed_item_is_one_error_naming_it_on_every_process(kind, bad, what):
    parts: dict = {}
    pipes = [_process(r) for r in range(2)]
    ctls = [AutoHint(p, _forge(kind, bad)(parts, r), recheck_every=0) for r, p in enumerate(pipes)]

    async def both(k):
        return await asyncio.gather(*(c.after_step(k, [_stats(p, r)]) for r, (c, p) in enumerate(zip(ctls, pipes))),
                                    return_exceptions=True)

    for c in ctls:
        c.before_step(0)
    assert asyncio.run(both(0)) == [None, None]  # the warm-up step gathers nothing
    for c in ctls:
        c.before_step(1)
    got = asyncio.run(both(1))
    assert [type(e) for e in got] == [PipelineError, PipelineError], got
    assert str(got[0]) == str(got[1])
    assert re.match(r"auto: a malformed (\w+ )?item " + re.escape(what), str(got[0])), str(got[0])
    assert "expected" in str(got[0])
    assert all(c.ranking is None for c in ctls)


@pytest.mark.parametrize("part,what", [([], "[]"), (["1.5"], "['1.5']"), ([1.0, 2.0], "[1.0, 2.0]"),
                                        ([True], "[True]")])
def test_a_peers_malformed_figure_is_refused_naming_it(part, what):
    """ControlShare's max and sum: each peer's part is one number (an empty part was an
    IndexError, a string a TypeError, two numbers the first taken)."""
    import torch.nn.functional as F

    import rrfp
    import test_auto_front_doors as fd
    from rrfp.runtime.features import share

    for op in ("max", "sum"):
        with rrfp.LocalPipeline(fd._modules(), fd.M, F.mse_loss, hint="bf") as pipe:
            pipe.step(*fd._batch(0)[:1], target=fd._batch(0)[1])  # the ranks receive from their first step on
            rts = pipe.runtimes
            ctl = share.ControlShare(rts[0], 2, timeout=60)  # a hang bound only

            async def peer_sends():
                rts[1].send_control(0, 1, {"kind": share.KIND, "rrfp-auto": 1, "part": 0, "of": 1, "items": part})

            pipe.run(peer_sends())
            with pytest.raises(PipelineError, match=re.escape(f"rank 1 sent a malformed auto message (exchange 1): "
                                                              f"'items' {what}: expected one number")):
                pipe.run(getattr(ctl, op)(1.0))
