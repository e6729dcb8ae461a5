"""Transport contract v2: a control plane for announcements, a data plane for tensor bytes.

:class:`PlaneTransport` is a :class:`~rrfp.transport.base.Transport` (same ``send``, same
delivery callback) composed of

- a *control plane*: any Transport (ZeroMQ, or the in-process fake) that carries control
  messages and, for every tensor message, an **announcement**: the message's key, its meta
  and, per tensor, ``[dtype, shape, requires_grad]`` (the codec's descriptor), plus a
  sequence number per (peer, channel);
- a *data plane* (:class:`DataPlane`): moves the tensors' bytes, order-matched and tagless
  like NCCL. The k-th buffer sent from ``a`` to ``b`` on a channel lands in the k-th buffer
  ``b`` posts for ``a`` on that channel, whatever the sizes.

Protocol (one announcement, then the data)::

    sender:   control.send(dst, key, [], {ANNOUNCE: {"seq": n, "tensors": [desc...]}, ...meta})
              data.isend(dst, channel, bytes of tensor i)        for each tensor with data
    receiver: announcements of (src, channel) taken in seq order (held back if early);
              for each: allocate buffers from the descriptors on the plane's device,
              data.irecv(src, channel, buffer i) in the announced order;
              deliver Message(src, key, tensors, meta) once all its receives completed.

Channels: one per (direction, orientation): ``2 * direction + (dst < src)``. Activations and
gradients never share a channel, and a channel only ever carries traffic one way between a
pair of ranks (with 2 ranks and virtual stages, activations flow both ways), so a blocked
send can never wait on a receive queued behind it in the same communicator.

Announcements are checked with the codec's limits (dtype, ndim, sizes, payload cap, the
message's job) before anything is allocated; a bad one is refused and counted in
``stats["rejected"]`` (the control plane counts what its codec refuses in its own stats).
Source: docs/architecture.md ("Facts": NCCL matches point-to-point messages by order).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import PeerLost, TransportClosed
from .base import Message, Transport
from .codec import wire_bytes
from .header import CodecError, descriptor, parse_descriptors
from .keys import Direction, MsgKey

__all__ = ["ANNOUNCE", "DataPlane", "PlaneTransport", "SendHandle", "channel_of"]

log = logging.getLogger("rrfp.transport.planes")

ANNOUNCE = "rrfp.announce"
"""Meta key of an announcement; reserved (a user meta with this key is a ValueError)."""
N_CHANNELS = 4
MAX_EARLY = 4096
"""Most announcements held back per (peer, channel) while an earlier one is missing."""

Done = Callable[[BaseException | None], None]
"""Completion callback of a data-plane operation; called once, on the event loop thread."""


def channel_of(direction: Direction, src: int, dst: int) -> int:
    """The data-plane channel (0..3) of a message from ``src`` to ``dst``."""
    return 2 * int(direction) + (dst < src)


class DataPlane(abc.ABC):
    """Moves raw bytes between ranks, matched by order per (src, dst, channel).

    Implementations: :class:`~rrfp.transport.torch_plane.TorchDataPlane` (NCCL/gloo),
    :class:`~rrfp.transport.fake_plane.FakeDataPlane` (in-process).

    Attributes:
        name: ``torch``, ``fake``, ...
        device: where receive buffers are allocated.
    """

    name: str = "?"
    device: torch.device = torch.device("cpu")

    async def start(self) -> None:
        """Connect (may block in a thread); called once before any isend/irecv."""

    @abc.abstractmethod
    def isend(self, dst: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        """Start sending ``buf`` (flat uint8, non-empty); never blocks. ``tag`` identifies the
        buffer (seq, index) for planes that match by tag; order-matched planes ignore it."""

    @abc.abstractmethod
    def irecv(self, src: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        """Post a receive into ``buf`` (flat uint8, non-empty); never blocks."""

    def close(self) -> None:
        """Release resources once nothing is in flight (graceful)."""

    def abort(self) -> None:
        """Release resources at once; pending callbacks are dropped."""


class SendHandle:
    """What :meth:`PlaneTransport.send` returns: keeps the sent tensors' bytes alive until the
    data plane is done with them.

    The runtime's outbox holds it until :meth:`done` (rrfp.runtime.engine.outbox).

    Attributes:
        error: the failure, or None.
    """

    __slots__ = ("_bufs", "_pending", "_future", "error")

    def __init__(self, bufs: list[Tensor]) -> None:
        self._bufs: list[Tensor] | None = bufs
        self._pending = len(bufs)
        self._future: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        """True once every buffer has been sent (or the send failed)."""
        return self._pending == 0

    def _one_done(self, exc: BaseException | None) -> None:
        if exc is not None and self.error is None:
            self.error = exc
        self._pending -= 1
        if self._pending == 0:
            self._bufs = None
            if self._future is not None and not self._future.done():
                self._future.set_result(None)

    async def wait(self) -> None:
        """Return once every buffer is sent; raises the data plane's error if one failed."""
        if self._pending:
            if self._future is None:
                self._future = asyncio.get_running_loop().create_future()
            await self._future
        if self.error is not None:
            raise self.error


_DONE = SendHandle([])


class _Inbound:
    """One announced message whose receives are in flight."""

    __slots__ = ("msg", "pending", "bufs", "nbytes")

    def __init__(self, msg: Message, bufs: list[Tensor], nbytes: int) -> None:
        self.msg, self.bufs, self.nbytes = msg, bufs, nbytes
        self.pending = len(bufs)


class PlaneTransport(Transport):
    """A Transport made of a control-plane Transport and a :class:`DataPlane`.

    Args:
        control: carries announcements and control messages (not started yet).
        plane: carries tensor bytes.

    ``send`` returns a :class:`SendHandle`; tensors stay on their device end to end and
    arrive on ``plane.device``. Raises as :meth:`Transport.send`, plus ValueError for a meta
    using the reserved key :data:`ANNOUNCE`.
    """

    device_tensors = True

    def __init__(self, control: Transport, plane: DataPlane) -> None:
        super().__init__(control.rank, control.world_size, job=control.job, max_bytes=control.max_bytes)
        self.control = control
        self.plane = plane
        self._tx_seq = [[0] * N_CHANNELS for _ in range(self.world_size)]
        self._rx_next = [[0] * N_CHANNELS for _ in range(self.world_size)]
        self._rx_early: dict[tuple[int, int], dict[int, tuple[Message, list]]] = {}
        self._inflight_rx: set[_Inbound] = set()
        self._inflight_tx: set[SendHandle] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def data_plane(self) -> str:
        return self.plane.name

    async def start(self) -> None:
        if self.started or self.closed:
            raise RuntimeError(f"rank {self.rank}: start() called twice")
        try:
            await self.plane.start()
            await self.control.start()
        except BaseException:
            self.abort()
            raise
        self.control.set_handler(self._on_control, self._on_control_error)
        self.started = True

    # -- send ------------------------------------------------------------------

    def send(
        self,
        dst: int,
        key: MsgKey,
        tensors: Sequence[Tensor | None],
        meta: dict[str, Any] | None = None,
    ) -> SendHandle:
        self.check_send(dst)
        if meta and ANNOUNCE in meta:
            raise ValueError(f"meta key {ANNOUNCE!r} is reserved for the transport")
        if key.direction == Direction.CTL or all(t is None for t in tensors):
            self.control.send(dst, key, tensors, meta)
            return _DONE
        if dst == self.rank:
            return self._loopback(key, tensors, meta)
        descs: list[list | None] = []
        bufs: list[Tensor] = []
        for i, t in enumerate(tensors):
            if t is None:
                descs.append(None)
                continue
            if not isinstance(t, Tensor):
                raise CodecError(f"tensor {i}: expected a Tensor or None, got {type(t).__name__}")
            descs.append(descriptor(i, t))
            if t.numel():
                bufs.append(wire_bytes(t))
        ch = channel_of(key.direction, self.rank, dst)
        seq = self._tx_seq[dst][ch]
        cmeta = dict(meta) if meta else {}
        cmeta[ANNOUNCE] = {"seq": seq, "tensors": descs}
        self.control.send(dst, key, [], cmeta)  # raises before anything is on the data plane
        self._tx_seq[dst][ch] = seq + 1
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += sum(b.numel() for b in bufs)
        if not bufs:
            return _DONE
        h = SendHandle(bufs)
        self._inflight_tx.add(h)
        self._idle.clear()
        for i, b in enumerate(bufs):
            self.plane.isend(dst, ch, (seq, i), b, lambda exc, h=h: self._sent(h, dst, exc))
        return h

    def _sent(self, h: SendHandle, dst: int, exc: BaseException | None) -> None:
        h._one_done(exc)
        if exc is not None:
            self.on_peer_lost(dst, f"data plane send failed: {_one_line(exc)}")
        if h.done():
            self._inflight_tx.discard(h)
            self._check_idle()

    def _loopback(self, key: MsgKey, tensors: Sequence[Tensor | None], meta: dict | None) -> SendHandle:
        # Same device, fresh storage, like any arrival: the receiver must not alias the sender.
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            c = t.detach().clone()
            out.append(c.requires_grad_(True) if t.requires_grad and c.is_floating_point() else c)
        nbytes = sum(t.nbytes for t in out if t is not None)
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += nbytes
        self.deliver_message(Message(self.rank, key, out, dict(meta) if meta else {}), nbytes)
        return _DONE

    # -- receive ---------------------------------------------------------------

    def _on_control(self, msg: Message) -> None:
        ann = msg.meta.pop(ANNOUNCE, None) if msg.meta else None
        if ann is None:
            self.deliver_message(msg, 0)
            return
        src = msg.src
        try:
            if msg.tensors:
                raise CodecError("an announcement carries no tensors")
            if msg.key.direction == Direction.CTL or src == self.rank:
                raise CodecError("announcement on the control direction or from this rank")
            if type(ann) is not dict or set(ann) != {"seq", "tensors"}:
                raise CodecError("announcement: expected a map with seq and tensors")
            seq = ann["seq"]
            if type(seq) is not int:
                raise CodecError("announcement.seq: expected an int")
            descs = parse_descriptors(ann["tensors"], self.max_bytes)
        except CodecError as e:
            self.reject(src, str(e))
            return
        ch = channel_of(msg.key.direction, src, self.rank)
        nxt = self._rx_next[src][ch]
        early = self._rx_early.setdefault((src, ch), {})
        if seq < nxt or seq in early:
            self.reject(src, f"replayed announcement seq {seq} on channel {ch}")
            return
        if seq - nxt >= MAX_EARLY:
            self.reject(src, f"announcement seq {seq} too far ahead of {nxt} on channel {ch}")
            return
        early[seq] = (msg, descs)
        # The data plane matches by order: post receives strictly in the sender's order.
        while nxt in early:
            m, d = early.pop(nxt)
            self._post(m, d, ch, nxt)
            nxt += 1
        self._rx_next[src][ch] = nxt

    def _post(self, msg: Message, descs: list, ch: int, seq: int) -> None:
        dev = self.plane.device
        tensors: list[Tensor | None] = []
        bufs: list[Tensor] = []
        for d in descs:
            if d is None:
                tensors.append(None)
                continue
            dtype, shape, _rg, nbytes = d
            try:
                t = torch.empty(shape, dtype=dtype, device=dev)
            except RuntimeError as e:  # a zero-size shape whose other dims overflow torch's arithmetic
                self.reject(msg.src, f"shape {shape} not allocatable: {_one_line(e)}")
                return
            tensors.append(t)
            if nbytes:
                bufs.append(t.view(-1).view(torch.uint8))
        msg.tensors = tensors
        inb = _Inbound(msg, bufs, sum(b.numel() for b in bufs))
        if not bufs:
            self._complete(inb, descs)
            return
        self._inflight_rx.add(inb)
        self._idle.clear()
        for i, b in enumerate(bufs):
            self.plane.irecv(msg.src, ch, (seq, i), b, lambda exc, inb=inb, d=descs: self._received(inb, d, exc))

    def _received(self, inb: _Inbound, descs: list, exc: BaseException | None) -> None:
        if inb not in self._inflight_rx:
            return
        if exc is not None:
            self._inflight_rx.discard(inb)
            self.on_peer_lost(inb.msg.src, f"data plane receive failed: {_one_line(exc)}")
            self._check_idle()
            return
        inb.pending -= 1
        if inb.pending == 0:
            self._inflight_rx.discard(inb)
            self._complete(inb, descs)
            self._check_idle()

    def _complete(self, inb: _Inbound, descs: list) -> None:
        msg = inb.msg
        for i, (t, d) in enumerate(zip(msg.tensors, descs)):
            if t is None:
                continue
            if t.dtype is torch.bool and t.device.type == "cpu" and t.numel() and int(t.view(torch.uint8).max()) > 1:
                # torch assumes bool bytes are 0 or 1; anything else is not a bool.
                self.reject(msg.src, f"tensor {i}: bool data holds bytes other than 0 and 1")
                return
            if d[2]:
                t.requires_grad_(True)
        self.deliver_message(msg, inb.nbytes)

    def _on_control_error(self, exc: BaseException) -> None:
        if isinstance(exc, PeerLost):
            self.on_peer_lost(exc.rank, exc.reason)
        elif not self.closing:
            self.fail(exc)
            self._idle.set()

    def on_peer_lost(self, src: int, reason: str) -> None:
        super().on_peer_lost(src, reason)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._busy():
            self._idle.set()

    def _busy(self) -> bool:
        lost = self.lost_peers
        return any(i.msg.src not in lost for i in self._inflight_rx) or (bool(self._inflight_tx) and not lost)

    # -- flush / close ---------------------------------------------------------

    async def flush(self) -> None:
        await self.control.flush()
        if self.lost_peers:
            raise self.lost_peers[min(self.lost_peers)]

    async def close(self, timeout: float = 30.0) -> None:
        if self.closed or self.closing:
            return
        if not self.started:
            self.abort()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.closing = True
        err: BaseException | None = None
        try:
            await self.control.close(timeout)
        except (PeerLost, TimeoutError) as e:
            err = e
        # Bytes announced before the goodbye are still moving: let them land (or fail) so the
        # data plane is not torn down under them.
        if self._busy():
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                log.warning("rank %d: closing with data-plane transfers still in flight", self.rank)
                self.plane.abort()
        self.plane.close()
        self._finish(TransportClosed(f"rank {self.rank}: closed"))
        if self.lost_peers:
            raise self.lost_peers[min(self.lost_peers)]
        if err is not None:
            raise err

    def abort(self) -> None:
        if self.closed:
            return
        self.control.abort()
        self.plane.abort()
        self._finish(TransportClosed(f"rank {self.rank}: aborted"))

    def _finish(self, exc: BaseException) -> None:
        self.closed = True
        self._inflight_rx.clear()
        self._inflight_tx.clear()
        self._rx_early.clear()
        self.fail(exc)
        self._idle.set()
        self.peer_event.set()


def _one_line(exc: BaseException) -> str:
    s = str(exc).strip().splitlines()
    return (s[0] if s else type(exc).__name__)[:300]
