"""A rank's outbox: every tensor or control message it sends to another rank.

Sends never block compute: the transport encodes and enqueues at once, and the wire is its
business. A transport's ``send`` may return a handle (an object with ``done() -> bool``) that
keeps the sent tensors alive until its data plane has finished with them; the outbox holds
every such handle until it says done, so no tensor is freed while a send still reads it.

Device tensors (a CUDA stage's outputs) are copied to pinned host memory by the executor's
``to_host`` (non-blocking, on the compute stream, with an event); the outbox queues the message
and sends it from a loop callback once the event has fired, keeping the send order. Without a
``to_host`` (an inline or thread executor on a device) the copy is a plain ``.cpu()``. A
transport whose ``device_tensors`` is True (the ``torch`` data plane, NCCL) takes the device
tensors themselves: no copy, but the send still waits for the executor's ``ready_event`` (the
kernels that produced them ran on the rank's compute stream, which the data plane's own stream
does not wait for).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable, Sequence

import torch

from ...transport.base import Transport
from ...transport.keys import Direction, MsgKey


class Outbox:
    """Sends of one rank.

    Args:
        transport: the rank's transport (started by the caller).
        job: the job id put in every key.

    Attributes:
        in_flight: handles returned by the transport and not yet done.
    """

    def __init__(self, transport: Transport, job: str,
                 to_host: Callable[[Sequence[torch.Tensor | None]], tuple[list, Any]] | None = None,
                 ready_event: Callable[[], Any] | None = None) -> None:
        self.transport = transport
        self.job = job
        self.to_host = to_host
        self.ready_event = ready_event
        self.device_tensors = transport.device_tensors
        self.in_flight: list = []
        self._copying: deque = deque()  # (event, dst, key, host tensors), in send order
        self._timer: asyncio.Handle | None = None
        self._drained: asyncio.Event | None = None
        self._error: BaseException | None = None

    def send(self, dst_rank: int, step: int, m: int, dst_stage: int, direction: Direction,
             tensors: Sequence[torch.Tensor | None]) -> None:
        """Send a stage's outputs (``Direction.ACT``) or input gradients (``Direction.GRAD``)
        for microbatch ``m`` to ``dst_stage`` on ``dst_rank``.

        Device tensors are copied to host memory first (see the module docstring).
        """
        key = MsgKey(self.job, step, m, dst_stage, direction)
        if not self._copying:
            for t in tensors:  # all on the host? (inline: once per message)
                if t is not None and not t.is_cpu:  # is_cpu: a bool; device.type builds a device (5x the time)
                    break
            else:
                handle = self.transport.send(dst_rank, key, tensors)
                if handle is not None:  # None: the transport copied or owns what it needs
                    self._keep(handle)
                return
        self._send_from_device(dst_rank, key, tensors)

    def _send_from_device(self, dst: int, key: MsgKey, tensors: Sequence[torch.Tensor | None]) -> None:
        if self.device_tensors:
            if self.ready_event is None and not self._copying:  # no stream of its own: ordered already
                self._keep(self.transport.send(dst, key, tensors))
                return
            event = self.ready_event() if self.ready_event is not None else _Fired
            self._copying.append((event, dst, key, list(tensors)))
        elif self.to_host is None:
            payload = [None if t is None or t.device.type == "cpu" else _host_copy(t) for t in tensors]
            self._keep(self.transport.send(dst, key, payload))
            return
        else:
            host, event = self.to_host(tensors)
            self._copying.append((event, dst, key, host))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_soon(self._poll)

    def _poll(self) -> None:
        self._timer = None
        q = self._copying
        try:
            while q and q[0][0].query():
                _, dst, key, host = q.popleft()
                self._keep(self.transport.send(dst, key, host))
        except Exception as e:  # noqa: BLE001 - a closed transport, a lost peer: flush raises it
            self._error = self._error or e
            q.clear()
        if q:
            self._timer = asyncio.get_running_loop().call_soon(self._poll)
        elif self._drained is not None:
            self._drained.set()

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
        if self._copying:
            self._drained = asyncio.Event()
            await self._drained.wait()
            self._drained = None
        if self._error is not None:
            raise self._error
        await self.transport.flush()
        if self.in_flight:
            self.in_flight = [h for h in self.in_flight if not h.done()]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A blocking host copy that keeps ``requires_grad`` (the next stage needs the flag)."""
    h = t.detach().cpu()
    return h.requires_grad_(True) if t.requires_grad else h


class _Fired:
    """An event that has fired (keeps the send order behind queued device sends)."""

    @staticmethod
    def query() -> bool:
        return True
