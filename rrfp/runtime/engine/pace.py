"""Forward-only steps keep a rank within one step of the ranks it sends activations to.

The inbox admits a message of the running step or of the next one, and refuses any other
(:meth:`~rrfp.runtime.engine.inbox.Inbox.on_message`): in a training step a peer needs this
rank's outputs (activations one way, gradients the other) to finish, so it is never more than
one step ahead. A forward-only step (``Pipeline.eval()``, ``step()`` without a ``loss_fn``)
breaks that argument: a rank sends its activations and waits for nothing back, so it can finish
several forward-only steps in a row and send the step after them while its receiver is still
in the first. The receiver refuses those messages and both ranks wait until the watchdog fires
(``rrfp train --eval-every 1`` with its two evaluation batches per evaluation, seen under
``--dp 2 --grad-accum 2``, whose all-reduces hold the last stage's rank back).

So a forward-only step ends on a rank only once every rank it sends activations to has begun
that step. As it begins a forward-only step, each rank sends every rank it receives
activations from a *begun* notice, a control message (key ``(job, step, 0, 0, CTL)``, meta
``{"kind": "begun"}``, :meth:`~rrfp.runtime.engine.outbox.Outbox.send_control`); the sender
ends the step once each of its receivers' notice for it is in. Usually it is in already (the
receiver began the step before the sender's last activation reached it); the wait is the
backpressure a training step gets from its gradients. By induction a rank's step-``k``
message then finds its receiver in step ``k - 1`` or later: the step before ``k`` was either a
training step (finished only with the receiver's gradients of it) or a forward-only one (ended
only after the receiver began it).

A notice that a correct pipeline cannot send (from a rank this rank sends no activations to,
extra meta, a step not after the sender's last notice or beyond the next step) is refused and
counted with the inbox's refusals.
"""

from __future__ import annotations

import asyncio

from ...errors import WatchdogTimeout
from ...transport.base import Message
from ...transport.keys import Direction
from .inbox import Inbox
from .router import Router

__all__ = ["BEGUN", "ForwardPace"]

BEGUN = "begun"
"""The ``kind`` of a begun notice's meta."""


class ForwardPace:
    """One rank's begun notices: those it sends as it begins a forward-only step, those it
    waits for before ending one.

    Args:
        router: the rank's stage graph (who sends it activations, whom it sends them to).
        inbox: the rank's inbox (its control handlers, ``wake`` and ``error``).
        send: ``send(dst_rank, step, meta)``, a control message (the outbox's).

    Attributes:
        upstream: the other ranks that send this rank activations (they hear its notices).
        downstream: the other ranks this rank sends activations to (it waits for theirs).
        begun: ``rank -> step`` of the last notice each downstream rank sent.
    """

    def __init__(self, router: Router, inbox: Inbox, send) -> None:
        act = Direction.ACT
        me = router.rank
        peer = lambda s: None if s is None or router.rank_of[s] == me else router.rank_of[s]  # noqa: E731
        self.upstream = sorted({r for s in router.stages if (r := peer(router.producer(s, act))) is not None})
        self.downstream = sorted({r for s in router.stages if (r := peer(router.consumer(s, act))) is not None})
        self.begun: dict[int, int] = {}
        self._inbox, self._send, self._rank = inbox, send, me
        inbox.on_control(BEGUN, self.receive)

    def begins(self, step: int) -> None:
        """This rank begins forward-only step ``step``: tell the ranks sending it activations."""
        for r in self.upstream:
            self._send(r, step, {"kind": BEGUN})

    def receive(self, msg: Message, current: int) -> str | None:
        """The inbox's handler of begun notices (while this rank runs, or is about to run,
        step ``current``); returns why one is refused, or None when it is taken."""
        src, step = msg.src, msg.key.step
        if src not in self.downstream:
            return f"begun notice from rank {src}, which receives no activations from rank {self._rank}"
        if len(msg.meta) != 1:
            return "begun notice: expected only its kind"
        if not self.begun.get(src, -1) < step <= current + 1:
            return (f"begun notice for step {step} from rank {src} while in step {current} "
                    f"(its last was step {self.begun.get(src)})")
        self.begun[src] = step
        self._inbox.wake.set()
        return None

    async def ends(self, step: int, timeout: float) -> None:
        """Return once every rank this rank sends activations to has begun forward-only step
        ``step``.

        Raises:
            WatchdogTimeout: not within ``timeout`` seconds (0: no limit).
            the inbox's error (a lost peer, a closed rank) as soon as it happens.
        """
        inbox = self._inbox
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout > 0 else None
        while True:
            if inbox.error is not None:
                raise inbox.error
            missing = [r for r in self.downstream if self.begun.get(r, -1) < step]
            if not missing:
                return
            inbox.wake.clear()
            try:
                await asyncio.wait_for(inbox.wake.wait(), None if deadline is None else deadline - loop.time())
            except TimeoutError:
                raise WatchdogTimeout(
                    f"rank {self._rank} made no progress for {timeout:g} s at the end of forward-only step {step}: "
                    f"waiting for rank(s) {missing}, which receive its activations, to begin it") from None
