"""The per-task path's merged layers do what the layered ones do (issue 33, the per-task cost).

- The inbox admits a running step's input from its one allowed sender in one call
  (``Inbox.handle``; for a plain stage on the host it buffers the tensors itself, without
  ``_admit``); everything else goes through ``Inbox.on_message``. Fed the same arrivals,
  ``handle`` and the layered path (``on_message`` under ``_safely``, as ``handle`` was before)
  end in the same state, and that state is the hand-computed one.
- The scheduler loop runs an inline executor's task itself instead of through
  ``InlineExecutor.launch``: the same dispatch order, losses and gradients as the launch path
  (the loop forced onto it), and each strict hint's order is its schedule's, by hand.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from rrfp.runtime.doors.local import LocalPipeline
from rrfp.runtime.engine import loop as loop_module
from rrfp.runtime.engine.inbox import Inbox
from rrfp.runtime.engine.router import Router
from rrfp.runtime.engine.stage import PipelineStage
from rrfp.scheduler.arbiter import Arbiter
from rrfp.scheduler.hints import resolve_hint
from rrfp.scheduler.tasks import Placement
from rrfp.transport.base import Message
from rrfp.transport.keys import Direction, MsgKey

ACT, GRAD, CTL = Direction.ACT, Direction.GRAD, Direction.CTL


class _CpuStage:
    device = torch.device("cpu")

    def to_device(self, tensors):
        return tuple(tensors)


def _inbox(stage: str = "stub") -> tuple[Inbox, Arbiter]:
    """Rank 1 of 4 (stage 1), 4 microbatches, running step 5; stage 1 a stub with its own
    ``to_device`` (``stub``) or a plain PipelineStage on the CPU (``host``)."""
    spec, hint, _ = resolve_hint("bf", Placement(4), 4)
    arb = Arbiter(spec, 1, hint)
    st = _CpuStage() if stage == "stub" else PipelineStage(nn.Linear(1, 1), 1, 4)
    inbox = Inbox(Router(Placement(4), 1), "j", {1: st}, 4)
    inbox.last_step = 4
    inbox.begin_step(5, arb)
    return inbox, arb


def _arrivals() -> list[Message]:
    t = torch.ones(1)
    return [
        Message(0, MsgKey("j", 5, 0, 1, ACT), [t]),          # admitted
        Message(2, MsgKey("j", 5, 3, 1, GRAD), [t]),         # admitted (its forward has not run: not ready)
        Message(0, MsgKey("j", 5, 0, 1, ACT), [t]),          # a duplicate: refused
        Message(0, MsgKey("other", 5, 1, 1, ACT), [t]),      # another job: refused
        Message(2, MsgKey("j", 5, 1, 1, ACT), [t]),          # the wrong sender: refused
        Message(0, MsgKey("j", 5, 1, 2, ACT), [t]),          # a stage of rank 2: refused
        Message(0, MsgKey("j", 5, 1, 7, ACT), [t]),          # no such stage: refused
        Message(0, MsgKey("j", 6, 2, 1, ACT), [t]),          # the next step: kept early
        Message(0, MsgKey("j", 3, 2, 1, ACT), [t]),          # a past step: refused
        Message(0, MsgKey("j", 5, 9, 1, ACT), [t]),          # no such microbatch: refused
        Message(0, MsgKey("j", 5, 0, 0, CTL), [], {"kind": "x"}),  # control: queued
        Message(0, MsgKey("j", 5, 2, 1, ACT), [t]),          # admitted
    ]


def _state(inbox: Inbox, arb: Arbiter) -> dict:
    buffered = {**inbox.router.waiting(ACT), **{(s, m, "g"): v for (s, m), v in inbox.router.waiting(GRAD).items()}}
    return {"act": sorted(inbox.router.waiting(ACT)), "grad": sorted(inbox.router.waiting(GRAD)),
            "buffered": {k: (type(v).__name__, [id(t) for t in v]) for k, v in buffered.items()},
            "rejected": inbox.rejected, "early": {s: [m.key for m in ms] for s, ms in inbox.pending.items()},
            "control": [m.key for m in inbox.poll_control()], "error": inbox.error,
            "ready": [str(t) for t in _drain(arb)]}


def _drain(arb: Arbiter) -> list:
    out = []
    while (t := arb.next()) is not None:
        out.append(t)
        arb.complete(t)
    return out


@pytest.mark.parametrize("stage", ["stub", "host"])
def test_the_inbox_admits_what_its_layered_path_admits(caplog, monkeypatch, stage):
    caplog.set_level(logging.CRITICAL, logger="rrfp")
    fast, fast_arb = _inbox(stage)
    layered, layered_arb = _inbox(stage)
    arrivals = _arrivals()
    admitted = []
    admit, place_on, placed = fast._admit, fast.place_on, []
    monkeypatch.setattr(fast, "_admit", lambda msg: (admitted.append(msg.key), admit(msg))[1])
    monkeypatch.setattr(fast, "place_on", lambda st, ts: (placed.append(1), place_on(st, ts))[1])
    for msg in arrivals:
        fast.handle(msg)
        layered._safely(layered.on_message, msg)
    got, want = _state(fast, fast_arb), _state(layered, layered_arb)
    assert got == want
    # Every input of the step from its sender goes to _admit in one call (a microbatch out of
    # range too, which it refuses). A plain stage on the host takes the arrivals' tensors as
    # they are (no place_on); a stub's own to_device is not skipped: it places the 3 inputs
    # that pass mark_input (the second copy of microbatch 0 and microbatch 9 do not). The
    # buffers hold the arrivals' tensors, a tuple for a forward, a list for a backward.
    t = arrivals[0].tensors[0]
    out_of_range = MsgKey("j", 5, 9, 1, ACT)
    assert admitted == [MsgKey("j", 5, 0, 1, ACT), MsgKey("j", 5, 3, 1, GRAD), MsgKey("j", 5, 0, 1, ACT),
                        out_of_range, MsgKey("j", 5, 2, 1, ACT)]
    assert len(placed) == (0 if stage == "host" else 3)
    assert got.pop("buffered") == {(1, 0): ("tuple", [id(t)]), (1, 2): ("tuple", [id(t)]),
                                   (1, 3, "g"): ("list", [id(t)])}
    # By hand: forwards of microbatches 0 and 2 arrived and run (bf: the lowest first); the
    # gradient of microbatch 3 waits for its forward.
    assert got == {"act": [(1, 0), (1, 2)], "grad": [(1, 3)], "rejected": 7,
                   "early": {6: [MsgKey("j", 6, 2, 1, ACT)]}, "control": [MsgKey("j", 5, 0, 0, CTL)],
                   "error": None, "ready": ["1F0", "1F2"]}


def test_an_arrival_that_breaks_the_inbox_fails_the_step_on_both_paths():
    # A direction no stage table has (a transport that skips the codec's checks): the
    # layered path raised inside _safely, which hands the error to the scheduler loop.
    for feed in ("handle", "layered"):
        inbox, _ = _inbox()
        msg = Message(0, MsgKey("j", 5, 0, 1, 7), [torch.ones(1)])
        inbox.handle(msg) if feed == "handle" else inbox._safely(inbox.on_message, msg)
        assert isinstance(inbox.error, IndexError), feed


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _run(hint: str, n_virtual: int, encode: bool) -> tuple[list, list, list]:
    torch.manual_seed(0)
    mods = [_Tiny() for _ in range(4 * n_virtual)]
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    orders, losses = [], []
    with LocalPipeline(mods, 8, lambda o, t: ((o - t) ** 2).mean(), hint=hint, encode=encode, n_virtual=n_virtual,
                       record=True, watchdog=60) as pipe:
        for _ in range(2):
            losses.append(float(pipe.step(x, target=y)))
            orders.append([[str(r.task) for r in s.records] for s in pipe.last_stats])
    return orders, losses, [p.grad.clone() for m in mods for p in m.parameters()]


class _ThroughLaunch:
    """Not InlineExecutor: the loop takes the launch path for the inline executor's tasks."""


@pytest.mark.parametrize("hint, n_virtual, encode", [pytest.param("bf", 1, True, marks=pytest.mark.slow),
                                                     pytest.param("bfw", 1, False, marks=pytest.mark.slow),
                                                     pytest.param("bf", 2, True, marks=pytest.mark.slow),
                                                     ("strict-1f1b", 1, True)])
def test_the_loop_runs_inline_tasks_in_the_order_of_the_launch_path(monkeypatch, hint, n_virtual, encode):
    merged = _run(hint, n_virtual, encode)
    monkeypatch.setattr(loop_module, "InlineExecutor", _ThroughLaunch)
    layered = _run(hint, n_virtual, encode)
    assert merged[0] == layered[0] and merged[1] == layered[1]
    for a, b in zip(merged[2], layered[2]):
        assert torch.equal(a, b)
    if hint == "strict-1f1b":  # by hand: rank 0 warms up with 4 forwards, then alternates
        assert merged[0][1][0] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2",
                                   "0F6", "0B3", "0F7", "0B4", "0B5", "0B6", "0B7"]


def test_between_steps_every_arrival_takes_the_layered_path(caplog):
    caplog.set_level(logging.CRITICAL, logger="rrfp")
    states = []
    for feed in ("handle", "layered"):
        inbox, arb = _inbox()
        inbox.end_step(5)
        for msg in (Message(0, MsgKey("j", 6, 0, 1, ACT), [torch.ones(1)]),   # the next step: kept early
                    Message(0, MsgKey("j", None, 1, 1, ACT), [torch.ones(1)])):  # no step at all: refused
            inbox.handle(msg) if feed == "handle" else inbox._safely(inbox.on_message, msg)
        states.append(_state(inbox, arb))
    assert states[0] == states[1]
    assert states[0]["rejected"] == 1 and states[0]["act"] == [] and list(states[0]["early"]) == [6]
