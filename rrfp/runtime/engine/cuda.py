"""The CUDA executor: tasks launched on one compute stream per rank, completion polled from the
event loop, host-device copies that never block the loop thread.

How a task runs: :meth:`CudaExecutor.launch` runs the task's Python on the loop thread under
``torch.cuda.stream(stream)``, which only queues its kernels, records a ``torch.cuda.Event``
after them and returns. The arbiter is told the task is complete at once: every later task of
this rank is queued on the same stream, so stream order already makes it wait for this one's
kernels (same-rank virtual stages hand over device tensors directly). The loop may launch up to
``window`` tasks ahead of the device; beyond that it waits for the oldest event. While tasks
are pending, a cheap loop callback queries the oldest event (``event.query()`` never blocks)
and, when it has fired, marks the task done (its busy time ends, its stage's gradients count
towards the step hooks) and wakes the scheduler loop; the callback stops when nothing is
pending.

Copies: arrivals go host -> device through pinned memory with ``non_blocking=True`` on the
compute stream (:meth:`CudaExecutor.to_device`); outputs go device -> host into pinned memory
with ``non_blocking=True`` on the compute stream plus an event (:meth:`CudaExecutor.to_host`),
and the outbox sends them once that event has fired. Nothing calls a blocking ``.cpu()`` or
``synchronize()`` on the loop thread during a step.

The launch-ahead window defaults to 1 (the next task launches when the previous one is done on
the device, so the arbiter decides each task with the freshest ready set); 2 lets the host
queue the next task while the device runs the current one, hiding launch latency. Which is
faster depends on the kernels' length against the Python launch time and could not be measured
on the CPU-only machine this was written on: measure both with ``python -m rrfp.gpu_check``.

Every CPU-testable part takes fakes: ``stream``, ``new_event`` (objects with ``record(stream)``
and ``query() -> bool``) and ``stream_context``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from ...scheduler.tasks import Task
from .pending import Pending, RunFn


class CudaExecutor:
    """Launches tasks on a compute stream; see the module docstring.

    Args:
        device: the CUDA device (``torch.device("cuda", i)``).
        window: tasks launched ahead of the device, 1 or 2.
        poll_interval: seconds between event queries while a task is pending; 0 queries once
            per loop turn (under uvloop any interval below 1 ms is once per turn too: its timers
            have millisecond resolution).
        stream, new_event, stream_context: fakes for tests; default a new
            ``torch.cuda.Stream(device)``, ``torch.cuda.Event`` and ``torch.cuda.stream``.

    Raises:
        ValueError: a window other than 1 or 2.
        RuntimeError: no CUDA (and no fake stream).
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | None = None, *, window: int = 1, poll_interval: float = 0.0,
                 stream: Any = None, new_event: Callable[[], Any] | None = None,
                 stream_context: Callable[[Any], Any] | None = None) -> None:
        if window not in (1, 2):
            raise ValueError(f"launch-ahead window {window!r}: expected 1 or 2")
        self.window = window
        self.poll_interval = poll_interval
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        if stream is None:
            if not torch.cuda.is_available():
                raise RuntimeError("the cuda executor needs CUDA, and torch.cuda.is_available() is False")
            stream = torch.cuda.Stream(self.device)
        self.stream = stream
        self._new_event = new_event or torch.cuda.Event
        self._ctx = stream_context or torch.cuda.stream
        self._fake = new_event is not None
        self._queue: deque[Pending] = deque()  # launched, event not yet fired, in launch order
        self._timer: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] = lambda: None
        self.polls = 0  # event queries so far (the polling's cost, for benchmarks and tests)

    def bind(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    # ------------------------------------------------------------ tasks
    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        p = Pending(task, time.perf_counter())
        with self._ctx(self.stream):
            p.outputs = run_fn(task)
        ev = self._new_event()
        ev.record(self.stream)
        p.handle = ev
        p.launched = True
        self._queue.append(p)
        self._arm()
        return p

    def _arm(self) -> None:
        if self._timer is not None:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self.poll_interval > 0:
            self._timer = self._loop.call_later(self.poll_interval, self._poll)
        else:
            self._timer = self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        self._timer = None
        q = self._queue
        fired = False
        while q:
            self.polls += 1
            if not q[0].handle.query():  # events on one stream fire in launch order
                break
            q.popleft().done = True
            fired = True
        if fired:
            self._wake()
        if q:
            self._arm()

    @property
    def pending(self) -> int:
        """Tasks launched whose event has not fired yet."""
        return len(self._queue)

    def release(self, pending: Pending) -> None:
        pending.handle = None
        pending.outputs = []

    def begin_step(self) -> None:
        # The optimizer (and the user's input preparation) ran on the current stream: this
        # step's kernels must see their results.
        if not self._fake:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def end_step(self) -> None:
        # Every event has fired, so this is free; it keeps later work on the current stream
        # (the optimizer) ordered after the step even if that ever changes.
        if not self._fake:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------ copies
    @property
    def copies(self) -> CudaExecutor:
        """This executor makes its own copies, on its compute stream
        (:class:`~rrfp.runtime.engine.executor.DeviceCopies`)."""
        return self

    def to_device(self, device: torch.device, tensors: Sequence[torch.Tensor | None]) -> tuple:
        """Host -> ``device`` on the compute stream, from pinned memory, without blocking.

        A pageable host tensor is first copied into pinned memory on the host (a memcpy, not a
        device wait); requires_grad is kept."""
        out = []
        with self._ctx(self.stream):
            for t in tensors:
                if t is None or t.device == device:
                    if t is not None and t.is_cuda and not self._fake:
                        # Received on a data plane's stream (NCCL): the caching allocator must
                        # not reuse its memory before this stream is done with it.
                        t.record_stream(self.stream)
                    out.append(t)
                    continue
                rg = t.requires_grad
                src = t.detach()
                if src.device.type == "cpu" and not src.is_pinned():
                    src = src.pin_memory()
                d = src.to(device, non_blocking=True)
                out.append(d.requires_grad_(True) if rg else d)
        return tuple(out)

    def ready_event(self) -> Any:
        """An event recorded on the compute stream now: fires once every task launched so far
        is done (what a device-tensor send waits for)."""
        ev = self._new_event()
        ev.record(self.stream)
        return ev

    def to_host(self, tensors: Sequence[torch.Tensor | None]) -> tuple[list, Any]:
        """Device -> pinned host memory on the compute stream (after the kernels that produced
        the tensors), without blocking.

        Returns:
            the host tensors (valid once the event has fired; requires_grad kept) and the
            event to poll."""
        host = []
        with self._ctx(self.stream), torch.no_grad():
            for t in tensors:
                if t is None or t.device.type == "cpu":
                    host.append(t)
                    continue
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t.detach(), non_blocking=True)
                host.append(h.requires_grad_(True) if t.requires_grad else h)
        ev = self._new_event()
        ev.record(self.stream)
        return host, ev


@contextlib.contextmanager
def no_stream(stream: Any):
    """A stream context that does nothing (fakes for CPU tests)."""
    yield
