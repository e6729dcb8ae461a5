"""The Transport interface every transport implements (ZeroMQ, the data-plane composition, the
in-process fakes, and any registered from outside through :mod:`.registry`).

:class:`Transport`'s docstring is the contract: what a transport implements, the public members
it may call (its private state is no part of it), what the runtime calls, the loop rules and
the errors. A transport moves tagged tensor messages between the ranks of one job. Sends never
block the caller; arrivals from every peer come out of one :meth:`Transport.recv`
in arrival order (no ordering promise across messages: the runtime keys inputs by
:class:`~rrfp.transport.keys.MsgKey`). A peer that disconnects without first
saying goodbye (BYE, sent by :meth:`Transport.close`) makes ``recv`` raise
:class:`PeerLost`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor

from ..errors import PeerLost, TransportClosed
from .codec import DEFAULT_MAX_BYTES, CodecError, decode, frames_nbytes
from .keys import MsgKey

__all__ = ["START_TIMEOUT_S", "Message", "Transport"]

log = logging.getLogger("rrfp.transport")

START_TIMEOUT_S = 600.0
"""Seconds a rank's start-up waits for its peers (their endpoints, handshakes, and the
pipeline's construction check): the default ``join_timeout`` of torchrun's rendezvous, the same
kind of wait. A rank that dies is reported by the launcher at once, so this bounds only a peer
that is alive and never ready; one still importing and building its model on a loaded machine
(a Hugging Face stage at a quarter of a core took over 60 s) is waited for."""

STAT_KEYS = (
    "messages_sent",
    "bytes_sent",
    "messages_received",
    "bytes_received",
    "rejected",
    "peers_lost",
)


@dataclass(slots=True)  # slots: built once per arrival, its fields set in __init__ faster
class Message:
    """One arrival.

    Attributes:
        src: rank that sent it.
        key: the sender's key (``key.stage`` is the destination stage).
        tensors: payload; fresh tensors owned by the receiver (None entries kept).
        meta: small control dict (empty for plain tensor messages).
    """

    src: int
    key: MsgKey
    tensors: list[Tensor | None]
    meta: dict[str, Any] = field(default_factory=dict)


class _Mailbox:
    """Arrivals for one rank, plus a sticky terminal error.

    Once failed, every pending and later :meth:`get` raises the error at once,
    even if messages are still queued: a lost peer must be reported promptly, not
    after draining a backlog.
    """

    def __init__(self) -> None:
        self._items: deque[Message] = deque()
        self._waiters: deque[asyncio.Future[Message]] = deque()
        self.error: BaseException | None = None
        self._handler: Callable[[Message], None] | None = None
        self._on_error: Callable[[BaseException], None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def set_handler(self, handler: Callable[[Message], None], on_error: Callable[[BaseException], None]) -> None:
        self._handler, self._on_error = handler, on_error
        while self._items and self._handler is handler:
            handler(self._items.popleft())
        if self.error is not None:
            on_error(self.error)

    def put(self, msg: Message, front: bool = False) -> None:
        if self.error is not None:
            return
        if self._handler is not None:
            self._handler(msg)
            return
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(msg)
                return
        if front:
            self._items.appendleft(msg)
        else:
            self._items.append(msg)

    def fail(self, exc: BaseException) -> None:
        # A lost peer is the interesting error; only closing may replace it, so
        # that recv after close() says "closed".
        if self.error is not None and not isinstance(exc, TransportClosed):
            return
        first = self.error is None
        self.error = exc
        self._items.clear()
        if first and self._on_error is not None:  # once: the first error is the one to report
            self._on_error(exc)
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(exc)

    async def get(self) -> Message:
        if self.error is not None:
            raise self.error
        if self._items:
            return self._items.popleft()
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # The message may have been handed to us just before the cancel landed;
            # give it back instead of losing it.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.put(fut.result(), front=True)
            raise


class Transport(abc.ABC):
    """Moves keyed tensor messages between the ``world_size`` ranks of one job.

    Lifecycle: ``await start()``, then any number of :meth:`send` / :meth:`recv`,
    then either ``await close()`` (graceful, on every rank) or :meth:`abort`
    (error path). A malformed incoming message is rejected, counted in
    ``stats["rejected"]`` and logged; receiving continues.

    **The runtime calls** :meth:`start`, :meth:`send`, :meth:`set_handler` (or :meth:`recv`),
    :meth:`flush`, :meth:`close`, :meth:`abort`, and reads ``rank``, ``world_size``, ``job``,
    ``stats``, ``device_tensors``, ``lost_peers``. It may look for an optional
    ``async wait_lost(timeout) -> PeerLost | None`` (the first peer lost, waiting for one to be
    noticed; :class:`~rrfp.transport.zmq.ZmqTransport` has it) to name a failure's root cause.

    **An implementation implements** :meth:`start`, :meth:`send`, :meth:`flush`, :meth:`close`
    and :meth:`abort` (their docstrings are the contract), and keeps the lifecycle flags:
    ``started = True`` once :meth:`start` succeeded, ``closing = True`` when :meth:`close`
    begins, ``closed = True`` once its resources are released. It may override
    :meth:`on_peer_lost` (calling ``super()``), :meth:`wake_flush` and :meth:`close_outcome`.

    **An implementation may call** the members under "for implementations": on receipt,
    :meth:`deliver_frames` (wire frames: size, dtype and job checked, then decoded; bad ones
    refused and counted) or :meth:`deliver_message` (a message it built itself); :meth:`on_bye`
    and :meth:`on_peer_lost` as peers leave; :meth:`reject` for input it refuses itself;
    :meth:`fail` for a terminal error of its own; in ``send``, :meth:`check_send`; in ``close``,
    :meth:`await_byes` then :meth:`close_outcome`; :meth:`peers`, :meth:`said_bye`,
    ``lost_peers``, ``error`` and ``peer_event`` to wait on peers. A transport made of these
    members alone passes ``tests/test_transport_conformance.py`` (the test registers one).

    Threads and the loop: every member is called on the event loop thread that ran
    :meth:`start`, and none blocks it (``send`` encodes and enqueues; I/O waits in coroutines,
    or in threads that hand results back with ``loop.call_soon_threadsafe``). Deliveries
    reach the handler of :meth:`set_handler` synchronously, in the order delivered.

    Errors: ``send`` raises at once (CodecError, ValueError, TransportClosed) and sends nothing;
    a lost peer is reported on ``recv``/the handler's ``on_error``, on ``flush`` and on
    ``close``, never by ``send``; refused input is only counted and logged.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        job: job id; with it, arrivals for another job are refused (None: not checked).
        max_bytes: largest accepted payload per message, bytes.
        stats: counters ``messages_sent``, ``bytes_sent``, ``messages_received``,
            ``bytes_received`` (wire bytes, header included), ``rejected``,
            ``peers_lost``; implementations may add their own.
        started, closing, closed: the lifecycle flags above.
        lost_peers: read-only view, rank -> :class:`PeerLost`, of the peers lost so far.
        peer_event: set on every BYE, lost peer and close (and whenever an implementation
            sets it); a waiter clears it, re-checks its condition, then waits.
    """

    rank: int
    world_size: int
    stats: dict[str, int]
    rank_name: Callable[[int], str] | None = None
    """How log lines name a rank of this transport (``rank 2 (pp 1, dp 0, tp 0)``) where its
    ranks are not global ones (a TP group's agreement transport); None: ``rank N``."""
    device_tensors: bool = False
    """True when :meth:`send` takes device (CUDA) tensors as they are and receivers get them on
    their own device (the ``torch`` data plane); False: send host tensors (the codec would copy
    device tensors to the host synchronously)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        job: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.max_bytes = max_bytes
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.started = False
        self.closing = False
        self.closed = False
        self._lost: dict[int, PeerLost] = {}
        self.lost_peers: Mapping[int, PeerLost] = MappingProxyType(self._lost)
        self.peer_event = asyncio.Event()
        self._mailbox = _Mailbox()
        self._byes: set[int] = set()

    # -- implemented by every transport ----------------------------------------

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect to every peer, then set ``started``. Raises TimeoutError or PeerLost on
        failure (after releasing what it made, as :meth:`abort`)."""

    @abc.abstractmethod
    def send(
        self,
        dst: int,
        key: MsgKey,
        tensors: Sequence[Tensor | None],
        meta: dict[str, Any] | None = None,
    ) -> Any:
        """Encode now and enqueue for ``dst``; never blocks or yields.

        ``dst`` may be ``self.rank`` (loopback). The tensors' bytes are read
        later, from the sender coroutine or the I/O thread: do not modify them in
        place after sending (clone first if you must). Returns None, or a handle with
        ``done() -> bool`` that the runtime keeps until done (the tensors' bytes are in use
        until then; :class:`~rrfp.transport.planes.SendHandle`). Raises CodecError for an
        unencodable payload, ValueError for a bad ``dst``, TransportClosed after
        close/abort (:meth:`check_send` raises the last two).
        """

    @abc.abstractmethod
    async def flush(self) -> None:
        """Return once every message enqueued so far is handed to the wire.

        Raises PeerLost if a peer is lost while waiting."""

    @abc.abstractmethod
    async def close(self, timeout: float = 30.0) -> None:
        """Graceful shutdown; call it on every rank (concurrently).

        Sends BYE to every peer after all earlier sends, waits up to ``timeout``
        seconds for BYE from every peer (:meth:`await_byes`), then releases resources
        (``closed``, :meth:`fail` with TransportClosed). Messages not yet received are
        discarded. Always releases resources; afterwards raises (:meth:`close_outcome`)
        PeerLost if a peer vanished without BYE, or TimeoutError naming the ranks whose
        BYE never came. A second call, or one before :meth:`start`, returns at once.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Close immediately without waiting (error path). Peers see this rank as
        lost unless it already said goodbye. Pending ``recv`` raise TransportClosed
        (:meth:`fail`). Idempotent."""

    # -- called by the runtime -------------------------------------------------

    async def recv(self) -> Message:
        """Next arrival from any peer, in arrival order.

        Raises:
            PeerLost: a peer disconnected without saying goodbye (sticky: every
                later call raises it too).
            TransportClosed: after :meth:`close` or :meth:`abort`.
        """
        return await self._mailbox.get()

    def set_handler(self, handler: Callable[[Message], None], on_error: Callable[[BaseException], None]) -> None:
        """Hand every arrival to ``handler(msg)`` as it is delivered, instead of queueing it
        for :meth:`recv` (which must then not be used).

        The handler runs on the event loop thread, inside the transport's own delivery
        callback, in arrival order; messages already queued are handed over at once. This
        saves the future, the wake-up and the coroutine switch that an awaiting ``recv()``
        costs per message. ``on_error(exc)`` is called once with the terminal error
        (:class:`PeerLost` or :class:`TransportClosed`); it is called at once if the
        transport has already failed. Neither callback may block or raise.
        """
        self._mailbox.set_handler(handler, on_error)

    # -- for implementations ---------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """The terminal error :meth:`recv` raises (a PeerLost, TransportClosed, or what
        :meth:`fail` was given); None while receiving goes on."""
        return self._mailbox.error

    def peers(self) -> set[int]:
        """Every rank but this one."""
        return set(range(self.world_size)) - {self.rank}

    def said_bye(self, rank: int) -> bool:
        """True once ``rank``'s BYE arrived (its later disconnect is no loss)."""
        return rank in self._byes

    def check_send(self, dst: int) -> None:
        """The checks every ``send`` starts with.

        Raises:
            TransportClosed: after close/abort (or while closing).
            RuntimeError: before :meth:`start` succeeded.
            ValueError: ``dst`` not a rank of this transport.
        """
        if self.closed or self.closing:
            raise TransportClosed(f"rank {self.rank}: send after close")
        if not self.started:
            raise RuntimeError(f"rank {self.rank}: send before start()")
        if not isinstance(dst, int) or not 0 <= dst < self.world_size:
            raise ValueError(f"dst {dst!r} out of range for world_size {self.world_size}")

    def deliver_frames(self, src: int, frames: Sequence[Any], nbytes: int | None = None) -> None:
        """Decode wire frames (:func:`~rrfp.transport.codec.encode`'s) from ``src`` and deliver
        the message; a message that fails the codec's checks (sizes against ``max_bytes``
        before any allocation, dtypes, the header's shape) or names another job is refused
        (:meth:`reject`) and receiving continues. Dropped once ``closed``. ``nbytes``: the
        frames' total size (:func:`~rrfp.transport.codec.frames_nbytes`) where the caller
        has it already, for the statistics; None: measured here."""
        if self.closed:
            return
        if nbytes is None:
            nbytes = frames_nbytes(frames)
        try:
            key, tensors, meta = decode(frames, max_bytes=self.max_bytes)
            if self.job is not None and key.job != self.job:
                raise CodecError(f"message for job {key.job!r}, this is job {self.job!r}")
        except CodecError as e:
            self.reject(src, str(e))
            return
        stats = self.stats
        stats["messages_received"] += 1
        stats["bytes_received"] += nbytes
        # _Mailbox.put's common case inline (once per message): a handler set, no error yet.
        mb = self._mailbox
        handler = mb._handler
        if handler is not None and mb.error is None:
            handler(Message(src, key, tensors, meta))
        else:
            mb.put(Message(src, key, tensors, meta))

    def deliver_message(self, msg: Message, nbytes: int) -> None:
        """Deliver a message the implementation built and checked itself (fresh tensors
        owned by the receiver), counting ``nbytes`` received. Dropped once ``closed``."""
        if self.closed:
            return
        self.stats["messages_received"] += 1
        self.stats["bytes_received"] += nbytes
        self._mailbox.put(msg)

    def reject(self, src: int | str, why: str) -> None:
        """Count (``stats["rejected"]``) and log a refused message from ``src``."""
        n = self.stats["rejected"] = self.stats["rejected"] + 1
        # Bounded logging: a broken or hostile peer must not flood the log.
        if n <= 10 or n & (n - 1) == 0:
            log.warning("rank %d: rejected message #%d from %s: %s", self.rank, n, src, why)

    def on_bye(self, src: int) -> None:
        """``src`` said goodbye: its later disconnect is no loss."""
        self._byes.add(src)
        self.peer_event.set()

    def on_peer_lost(self, src: int, reason: str) -> None:
        """Record that ``src`` is gone (not an error if it said goodbye first, or after
        ``closed``): logged, counted, and the terminal error of :meth:`recv`."""
        if src in self._byes or src in self._lost or self.closed:
            return
        exc = PeerLost(src, reason)
        self._lost[src] = exc
        self.stats["peers_lost"] += 1
        if self.rank_name is None:
            log.error("rank %d: %s", self.rank, exc)
        else:
            log.error("%s: %s lost: %s", self.rank_name(self.rank), self.rank_name(src), reason)
        self._mailbox.fail(exc)
        self.peer_event.set()
        self.wake_flush()

    def fail(self, exc: BaseException) -> None:
        """End receiving with ``exc``: pending and later :meth:`recv` raise it, queued
        messages are dropped, the handler's ``on_error`` gets it once. A lost peer stays the
        error reported; only a TransportClosed replaces it."""
        self._mailbox.fail(exc)

    def wake_flush(self) -> None:
        """Hook: wake flush() waiters so they notice a lost peer."""

    async def await_byes(self, timeout: float) -> set[int]:
        """Wait up to ``timeout`` s for BYE or loss of every peer; return the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            missing = self.peers() - self._byes - set(self._lost)
            remaining = deadline - loop.time()
            if not missing or remaining <= 0:
                return missing
            self.peer_event.clear()
            try:
                await asyncio.wait_for(self.peer_event.wait(), remaining)
            except TimeoutError:
                pass

    def close_outcome(self, missing: set[int], timeout: float) -> None:
        """After resources are released: raise if the goodbye was not mutual.

        Raises:
            PeerLost: the lowest rank lost.
            TimeoutError: naming the ranks in ``missing``.
        """
        if self._lost:
            raise self._lost[min(self._lost)]
        if missing:
            raise TimeoutError(
                f"rank {self.rank}: no BYE from ranks {sorted(missing)} within {timeout} s"
            )
