"""A rank's outbox: every tensor or control message it sends to another rank.

Sends never block compute: the transport encodes and enqueues at once, and the wire is its
business. A transport's ``send`` may return a handle (an object with ``done() -> bool``) that
keeps the sent tensors alive until its data plane has finished with them; the outbox holds
every such handle until it says done, so no tensor is freed while a send still reads it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..transport.base import Transport
from ..transport.keys import Direction, MsgKey


class Outbox:
    """Sends of one rank.

    Args:
        transport: the rank's transport (started by the caller).
        job: the job id put in every key.

    Attributes:
        in_flight: handles returned by the transport and not yet done.
    """

    def __init__(self, transport: Transport, job: str) -> None:
        self.transport = transport
        self.job = job
        self.in_flight: list = []

    def send(self, dst_rank: int, step: int, m: int, dst_stage: int, direction: Direction,
             tensors: Sequence[torch.Tensor | None]) -> None:
        """Send a stage's outputs (``Direction.ACT``) or input gradients (``Direction.GRAD``)
        for microbatch ``m`` to ``dst_stage`` on ``dst_rank``.

        Device tensors are copied to the host first (the zmq data plane sends host memory).
        """
        payload = [None if t is None else (t.detach().cpu() if t.device.type != "cpu" else t) for t in tensors]
        self._keep(self.transport.send(dst_rank, MsgKey(self.job, step, m, dst_stage, direction), payload))

    def send_control(self, dst: int, step: int, meta: dict[str, Any]) -> None:
        """Send a small control message (statistics, losses) to rank ``dst``."""
        self._keep(self.transport.send(dst, MsgKey(self.job, step, 0, 0, Direction.CTL), [], meta))

    def _keep(self, handle: Any) -> None:
        if handle is None:  # the transport copied or owns what it needs
            return
        if self.in_flight:
            self.in_flight = [h for h in self.in_flight if not h.done()]
        if not handle.done():
            self.in_flight.append(handle)

    async def flush(self) -> None:
        """Return once every message sent so far is handed to the wire.

        Raises:
            PeerLost: a peer was lost while waiting (from the transport)."""
        await self.transport.flush()
        if self.in_flight:
            self.in_flight = [h for h in self.in_flight if not h.done()]
