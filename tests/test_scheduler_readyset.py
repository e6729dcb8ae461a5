"""The ready set (rrfp.scheduler.readyset) and the arbiter's inlined updates of it.

The arbiter's ``mark_input`` and ``complete`` update the ready set's flags and heaps inline
(the simulator calls them once per message and task). Property: driven by any causally
possible sequence of inputs, completions, decisions and TP-style commits of any ready task,
the arbiter's ready set equals a :class:`ReadySet` fed only through :meth:`ReadySet.add` and
:meth:`ReadySet.take`, with readiness computed here from the dependency rules alone.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rrfp.scheduler import Arbiter, Placement, Task, resolve_hint
from rrfp.scheduler.readyset import ReadySet
from rrfp.scheduler.tasks import B, F, I, KINDS, W

EXAMPLES = int(os.environ.get("RRFP_HYPOTHESIS_EXAMPLES", "300"))


def scanned_later_forward(r: ReadySet):
    """The best ready forward past the first virtual stage, by a scan of every forward flag
    (independent of the heaps): the entry ``(virtual index * fsign, mb, stage)``."""
    found = [(v * r.fsign, mb, s) for v, s in enumerate(r.stages) if v
             for mb in range(r.n_mb) if r.ready[KINDS[F].code][v * r.n_mb + mb]]
    return min(found, default=None)


def same(arb_ready: ReadySet, ref: ReadySet) -> None:
    assert [bytes(x) for x in arb_ready.ready] == [bytes(x) for x in ref.ready]
    assert (arb_ready.f, arb_ready.b, arb_ready.w) == (ref.f, ref.b, ref.w)
    assert arb_ready.stale == ref.stale and arb_ready.n_stale == ref.n_stale
    if arb_ready.queues:
        # later_forward reads the breadth-first heap fl (or f's top): equal to a scan of the flags
        want = scanned_later_forward(ref)
        assert arb_ready.later_forward() == ref.later_forward() == want


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 4),
    v=st.integers(1, 3),
    kind=st.sampled_from(["loop", "v"]),
    m=st.integers(1, 6),
    rank=st.integers(0, 3),
    name=st.sampled_from(["bf", "fb", "bfw", "bfw-df", "bfw-mem", "b-priority", "gpipe", "1f1b"]),
    split=st.sampled_from([None, True, False]),
    limit=st.integers(1, 6),
    backpressure=st.sampled_from(["admission", "completion-order"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_arbiters_inlined_updates_leave_the_ready_set_that_add_leaves(p, v, kind, m, rank, name, split, limit,
                                                                           backpressure, seed):
    assume(rank < p)
    place = Placement(p, v, kind)
    try:
        spec, hint, _ = resolve_hint(name, place, m, split, backpressure=backpressure)
    except ValueError:
        assume(False)  # a schedule that does not fit the shape
    rng = random.Random(seed)
    arb = Arbiter(spec, rank, hint, inflight_limit=limit)
    mine, last, bk = arb.stages, spec.n_stages - 1, spec.backward_kind
    ref = ReadySet(mine, m, queues=arb.ready.queues, depth_first=arb.ready.fsign < 0)
    act, grad, done, added = set(), set(), set(), set()

    def add_ready() -> None:
        # Readiness from the dependency rules (RRFP §3), independent of the arbiter's code.
        for s in mine:
            for mb in range(m):
                cands = [(Task(s, F, mb), (s, mb) in act),
                         (Task(s, bk, mb), Task(s, F, mb) in done and (s == last or (s, mb) in grad))]
                if spec.split_backward:
                    cands.append((Task(s, W, mb), Task(s, I, mb) in done))
                for t, ok in cands:
                    if ok and t not in added:
                        added.add(t)
                        ref.add(t)

    def deliver(s: int, mb: int, g: bool) -> None:
        (grad if g else act).add((s, mb))
        arb.mark_input(s, mb, g)
        add_ready()

    for mb in range(m):  # the step's inputs, as the arbiter marks them at construction
        if mine[0] == 0:
            act.add((0, mb))
    add_ready()
    same(arb.ready, ref)
    for _ in range(40 * len(spec.tasks_of(rank)) + 50):
        if arb.finished:
            break
        remote = [(s, mb, False) for s in mine for mb in range(m)
                  if s > 0 and place.rank_of(s - 1) != rank and (s, mb) not in act]
        remote += [(s, mb, True) for s in mine for mb in range(m)
                   if s < last and place.rank_of(s + 1) != rank and (s, mb) not in grad
                   and Task(s, F, mb) in done]
        roll = rng.random()
        if arb.running is not None and (roll < 0.5 or not remote):
            t = arb.running
            arb.complete(t)
            done.add(t)
            c, i = ref.key(t)
            ref.done[c][i] = 1
            add_ready()
            nxt = spec.consumer(t)
            if nxt is not None and place.rank_of(nxt.stage) == rank:  # own stage: at once, as the runtime
                deliver(nxt.stage, nxt.mb, nxt.kind != F)
        elif remote and (arb.running is not None or roll < 0.75):
            deliver(*rng.choice(remote))
        else:
            ready = sorted(t for t in added if t not in done and t != arb.running and ref.is_ready(t))
            if ready and rng.random() < 0.3:
                t = rng.choice(ready)  # a TP group agreed on another ready task
                arb.commit(t)
            else:
                t = arb.next()
            if t is not None:
                ref.take(t)
        same(arb.ready, ref)
    assert arb.finished, f"rank {rank} did not finish: waits for {arb.waiting_for()}"


def test_configure_is_for_an_empty_ready_set():
    r = ReadySet([0, 2], 2)
    r.configure(queues=True, depth_first=True)
    assert r.queues and r.fsign == -1
    r.add(Task(2, F, 1))
    r.add(Task(0, F, 0))
    assert r.f == [(-1, 1, 2), (0, 0, 0)]  # depth-first: the later virtual stage first
    with pytest.raises(ValueError, match="configure it first"):
        r.configure(queues=False, depth_first=False)


def test_kind_codes_are_the_tables():
    assert KINDS[B].code == KINDS[I].code  # a step has one backward form: they share a code
    r = ReadySet([0], 3, queues=True)
    for k in (F, B, W):
        r.add(Task(0, k, 1))
        assert r.ready[KINDS[k].code][1] and r.key(Task(0, k, 1)) == (KINDS[k].code, 1)
    assert r.heaps == (r.f, r.b, r.w) and (r.f, r.b, r.w) == ([(0, 1, 0)], [(0, 1, 0)], [(1, 0, 0)])
    r.take(Task(0, B, 1))
    assert r.b == [] and r.ready[KINDS[B].code][1] == 0
