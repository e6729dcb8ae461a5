"""Tensor-parallel agreement (RRFP §4.2), the pure part.

The ranks of one TP group must issue their collectives in the same order, so before a
collective-bearing task (F, B or I of a TP-sharded stage) each rank arbitrates locally and
*proposes* its choice (:meth:`Arbiter.propose <rrfp.scheduler.arbiter.Arbiter.propose>`,
which changes nothing); the group all-gathers the proposals. All equal: every rank commits
(takes) it and runs it. Any mismatch: nobody runs, nothing was taken, and arbitration restarts
from the top of the hint once the rank has looked at its new arrivals. There is no leader: every rank reaches the same
decision from the same gathered proposals.

The exchange itself (a gloo all-gather, or the control plane) lives in the runtime; this
module only decides. Pure: no torch, asyncio or I/O.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .arbiter import Arbiter
from .readyset import KIND_INDEX, needs_agreement as _needs_agreement
from .tasks import Task

__all__ = ["TPAgreement", "encode_task", "decode_task", "NO_TASK"]

NO_TASK = (-1, -1, -1)
"""The encoding of "no proposal"."""

_KINDS = tuple(KIND_INDEX)


def encode_task(task: Task | None) -> tuple[int, int, int]:
    """A task as three integers ``(stage, kind code, microbatch)`` for an all-gather."""
    if task is None:
        return NO_TASK
    s, k, m = task
    return (s, KIND_INDEX[k], m)


def decode_task(code: Sequence[int]) -> Task | None:
    """Inverse of :func:`encode_task`."""
    s, k, m = (int(x) for x in code)
    if (s, k, m) == NO_TASK:
        return None
    return Task(s, _KINDS[k], m)


class TPAgreement:
    """One rank's side of TP agreement over its :class:`Arbiter`.

    Args:
        arbiter: the rank's arbiter for this step.
        needs_agreement: ``task -> bool``; default: the kind table's
            (:data:`rrfp.scheduler.tasks.KINDS`: F, B and I issue collectives, W does not).

    Attributes:
        rounds: proposal exchanges so far; mismatches: those that disagreed.
    """

    def __init__(self, arbiter: Arbiter, needs_agreement: Callable[[Task], bool] | None = None) -> None:
        self.arb = arbiter
        self.needs_agreement = needs_agreement or _needs_agreement
        self.rounds = 0
        self.mismatches = 0
        self.proposed: Task | None = None

    def propose(self) -> tuple[Task | None, bool]:
        """The rank's best ready task and whether the group must agree on it first.

        Returns ``(None, False)`` when nothing is ready (wait for an event, propose again);
        ``(task, False)``: run it now (no collective); ``(task, True)``: exchange
        :func:`encode_task` of it, then call :meth:`decide`.
        """
        t = self.arb.propose()
        if t is None:
            return None, False
        if not self.needs_agreement(t):
            self.arb.commit(t)
            return t, False
        self.proposed = t
        return t, True

    def decide(self, proposals: Sequence[Task | None]) -> bool:
        """Every rank's proposal (this one's included, in TP-rank order): commit the proposed
        task if they are all equal (True); else nothing was taken and nothing needs undoing
        (False)."""
        t, self.proposed = self.proposed, None
        self.rounds += 1
        if all(p == t for p in proposals):
            self.arb.commit(t)
            return True
        self.mismatches += 1
        return False
