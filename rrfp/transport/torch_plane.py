"""torch.distributed point-to-point data plane: NCCL on GPU, gloo on CPU.

One process group per channel (see :mod:`.planes`: activations and gradients apart, each
way apart), all ranks in every group, so group ranks are the job's ranks. Sends and receives
use the group's own ``send``/``recv`` with tag 0: both NCCL and gloo then match the k-th
send with the k-th receive per (peer, group), the order the announcements fix.

Completion without blocking the event loop:

- NCCL (CUDA): ``work.is_completed()`` is polled from the loop (every iteration while it
  keeps finding work done, then every ~0.5 ms). ``get_future()`` is not used: for NCCL it
  completes when the work is enqueued, not when the bytes have moved.
- gloo (CPU): a gloo work never reports completion until someone calls ``wait()`` (measured,
  torch 2.13), so each (peer, channel, send/recv) queue has a helper thread that waits its
  works in order and wakes the loop with ``call_soon_threadsafe``. Works within one queue
  complete in posting order (order-matched), so waiting in order delays no one; separate
  queues keep a receive that waits on the pipeline from holding back any other completion.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .planes import N_CHANNELS, DataPlane, Done

__all__ = ["TorchDataPlane", "gloo_groups"]

log = logging.getLogger("rrfp.transport.torch")
_POLL_SPIN = 64
_POLL_INTERVAL = 0.0005


class TorchDataPlane(DataPlane):
    """Data plane over torch.distributed process groups.

    Args:
        rank: this rank (also its rank in every group).
        groups: ``N_CHANNELS`` process groups spanning all ranks, or a zero-argument callable
            returning them (called by :meth:`start` in a worker thread, since building gloo
            groups blocks until every rank joins).
        device: where receive buffers go; ``cuda`` means NCCL groups and polling.
        poll: poll ``is_completed()`` from the loop (default: on CUDA) instead of waiting in
            helper threads.

    Raises (start):
        ValueError: for a wrong number of groups.
    """

    name = "torch"

    def __init__(
        self,
        rank: int,
        groups: Sequence[Any] | Callable[[], Sequence[Any]],
        device: torch.device | str = "cpu",
        *,
        poll: bool | None = None,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self._groups_src = groups
        self._groups: list[Any] = []
        self._poll = self.device.type == "cuda" if poll is None else poll
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._waiters: dict[tuple[int, int, bool], _Waiter] = {}
        self._polled: list[tuple[Any, Tensor, Done]] = []
        self._poll_armed = False
        self._idle_polls = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        src = self._groups_src
        groups = await asyncio.to_thread(src) if callable(src) else src
        if len(groups) != N_CHANNELS:
            raise ValueError(f"the torch data plane needs {N_CHANNELS} process groups, got {len(groups)}")
        self._groups = list(groups)

    def isend(self, dst: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        self._track(self._groups[channel].send([buf], dst, 0), buf, (dst, channel, True), done)

    def irecv(self, src: int, channel: int, tag: tuple[int, int], buf: Tensor, done: Done) -> None:
        self._track(self._groups[channel].recv([buf], src, 0), buf, (src, channel, False), done)

    def _track(self, work: Any, buf: Tensor, queue_key: tuple[int, int, bool], done: Done) -> None:
        if self._poll:
            self._polled.append((work, buf, done))
            if not self._poll_armed:
                self._poll_armed = True
                self._idle_polls = 0
                assert self._loop is not None
                self._loop.call_soon(self._poll_once)
            return
        w = self._waiters.get(queue_key)
        if w is None:
            assert self._loop is not None
            w = self._waiters[queue_key] = _Waiter(self._loop, f"rrfp-gloo-{self.rank}-{queue_key}")
        w.put(work, buf, self._guard(done))

    def _guard(self, done: Done) -> Done:
        def call(exc: BaseException | None) -> None:
            if not self._closed:
                done(exc)

        return call

    def _poll_once(self) -> None:
        if self._closed:
            self._poll_armed = False
            return
        still = []
        progressed = False
        for item in self._polled:
            work, _buf, done = item
            try:
                finished = work.is_completed()
            except Exception as e:  # a failed NCCL work raises here
                done(e)
                progressed = True
                continue
            if finished:
                exc = work.exception() if hasattr(work, "exception") else None
                done(exc)
                progressed = True
            else:
                still.append(item)
        self._polled = still
        if not still:
            self._poll_armed = False
            return
        assert self._loop is not None
        self._idle_polls = 0 if progressed else self._idle_polls + 1
        if self._idle_polls < _POLL_SPIN:
            self._loop.call_soon(self._poll_once)
        else:
            self._loop.call_later(_POLL_INTERVAL, self._poll_once)

    def close(self) -> None:
        self._closed = True
        for w in self._waiters.values():
            w.stop()

    def abort(self) -> None:
        # gloo/NCCL works cannot be cancelled; their callbacks are dropped, and helper
        # threads still blocked in wait() are daemons that end with the process group.
        self.close()
        self._polled.clear()


class _Waiter:
    """A helper thread that waits gloo works in posting order and reports to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, work: Any, buf: Tensor, done: Done) -> None:
        self._q.put((work, buf, done))

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            work, _buf, done = item  # _buf: the bytes stay alive until the work is done
            exc: BaseException | None = None
            try:
                work.wait()
            except Exception as e:
                exc = e
            try:
                self._loop.call_soon_threadsafe(done, exc)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return


def gloo_groups(store: Any, rank: int, world_size: int, prefix: str, timeout_s: float = 120.0) -> list[Any]:
    """``N_CHANNELS`` gloo process groups built straight on ``store`` (no default group
    needed, so several ranks can live in one process). Blocks until every rank joins."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    t = datetime.timedelta(seconds=timeout_s)
    return [ProcessGroupGloo(PrefixStore(f"{prefix}/ch{c}", store), rank, world_size, t) for c in range(N_CHANNELS)]
