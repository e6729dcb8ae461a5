"""TP agreement on real steps (RRFP §4.2): the driver that exchanges each proposal with the
rank's TP group before a collective-bearing task runs.

The decision is pure and lives in :mod:`rrfp.scheduler.agreement`
(:class:`~rrfp.scheduler.agreement.TPAgreement`: propose without taking, decide from the
gathered proposals); the exchange (a gloo all-gather or ZeroMQ control messages between the TP
ranks) is :mod:`rrfp.parallel.exchange`. This module joins them on a rank as its scheduler
loop's decider (:meth:`~rrfp.runtime.engine.loop.SchedulerLoop.set_decider`): each decision
proposes; a task that needs no agreement (``W``, kept collective-free: :func:`attach`) runs
at once; otherwise the group's proposals are gathered and, all equal, the task is committed
and runs, else nothing is taken and the loop looks at its arrivals and decides again
(:data:`~rrfp.runtime.engine.loop.AGAIN`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

from ...scheduler.agreement import TPAgreement, decode_task, encode_task
from ..engine.loop import AGAIN

Exchange = Callable[[Sequence[int]], Awaitable[list]]
"""``await exchange(code)``: every TP rank's encoded proposal, in TP rank order."""

NAME = "tp-agreement"
"""The feature's name in ``RankRuntime.features``."""


class AgreementDriver:
    """One rank's TP agreement: the decider its scheduler loop awaits for every task.

    Args:
        exchange: gathers the group's proposals (:mod:`rrfp.parallel.exchange`).

    Attributes:
        agreement: the running (or last) step's :class:`~rrfp.scheduler.agreement.TPAgreement`
            (``rounds``, ``mismatches``), None before the first decision.
    """

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.agreement: TPAgreement | None = None

    async def __call__(self, arb: Any):
        """The task this rank's TP group agreed on (committed on ``arb``), a task that needs no
        agreement, None when nothing is ready, or ``AGAIN`` after a mismatch (nothing
        committed, no state advanced)."""
        ag = self.agreement
        if ag is None or ag.arb is not arb:
            ag = self.agreement = TPAgreement(arb)
        task, need = ag.propose()
        if not need:
            return task
        codes = await self.exchange(encode_task(task))
        return task if ag.decide([decode_task(c) for c in codes]) else AGAIN

    async def aclose(self) -> None:
        """Say goodbye on the exchange's own transport, where it has one (the control exchange)."""
        if hasattr(self.exchange, "aclose"):
            await self.exchange.aclose()

    def close(self) -> None:
        """Free the exchange's helpers (threads, sockets), where it has any."""
        if hasattr(self.exchange, "close"):
            self.exchange.close()


def attach(runtime: Any, exchange: Exchange) -> AgreementDriver:
    """Make ``runtime`` (a :class:`~rrfp.runtime.engine.rank.RankRuntime`) agree with its TP
    group before every collective-bearing task; registered as ``runtime.features["tp-agreement"]``.

    The group does not agree on ``W`` (:data:`~rrfp.scheduler.readyset.KINDS`), so each TP rank
    runs its ``W`` tasks when its own ready set says, and a collective in one would pair with
    whatever the peer runs then: another microbatch's collective (wrong gradients) or an
    agreement exchange (a deadlock). So ``W`` is kept collective-free here: the first stage
    does not move its whole backward, collectives included, to ``W``
    (``TaskCompute.whole_backward_in_w``); ``I`` runs it and ``W`` gets the deferred weight
    gradients, local matmuls, as on every other stage (the TP layers' ``affine`` part,
    :mod:`rrfp.runtime.engine.split`). A ``dw_builder`` callable runs in ``W`` too: it must not
    issue collectives under TP.

    Raises:
        ValueError: the rank's loop already has a decider.
    """
    driver = AgreementDriver(exchange)
    runtime.loop.set_decider(driver)
    runtime.compute.whole_backward_in_w = False
    runtime.features[NAME] = driver
    return driver
