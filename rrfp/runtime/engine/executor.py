"""Executors: where and how a rank's compute tasks run, observed without blocking the loop.

The protocol (docs/architecture.md, "One rank"):

- ``launch(task, run_fn) -> Pending``: start ``run_fn(task)`` (the task's compute; it returns
  the task's outputs, a list the runtime hands on afterwards). Called on the event loop thread.
- completion is observed without blocking the loop: the executor sets ``pending.launched``
  (the host part is over: the arbiter may be told and the outputs handed on) and
  ``pending.done`` (the device part is over too: its time counts, its gradients are final),
  then calls the ``wake`` function given to :meth:`Executor.bind`, on the loop thread.
- ``release(pending)``: the runtime has handed the outputs on; the executor drops what it kept
  for the task (events, references to tensors), so memory frees when the transport is done.

Which executor, and why: an inline dispatch costs microseconds where a hop to a worker thread
and back costs about 90 us on a 2-core machine, so inline is the CPU default; the worker thread
keeps the loop answering during long tasks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import torch

from ...scheduler.tasks import Task
from . import autocast
from .pending import Pending, RunFn

class DeviceCopies(Protocol):
    """Host <-> device copies an executor makes on its own stream, never blocking the loop."""

    def to_device(self, device: torch.device, tensors: Sequence[torch.Tensor | None]) -> tuple:
        """An arrival's tensors on ``device`` (requires_grad kept)."""

    def to_host(self, tensors: Sequence[torch.Tensor | None]) -> tuple[list, Any]:
        """Host copies of a task's outputs and an event (``query() -> bool``) that fires once
        they are valid."""

    def ready_event(self) -> Any:
        """An event that fires once every task launched so far is done."""


class Executor(Protocol):
    """What the rank runtime and its scheduler loop need from an executor (see the module
    docstring).

    Attributes:
        name: ``inline``, ``thread`` or ``cuda``.
        window: how many launched tasks may be unfinished at once (the launch-ahead window;
            1 means the next task launches only when the previous one is done).
        copies: the executor's own host <-> device copies (:class:`DeviceCopies`), or None:
            arrivals then go through the stage's ``to_device`` and sends through ``.cpu()``.
    """

    name: str
    window: int
    copies: DeviceCopies | None

    def bind(self, wake: Callable[[], None]) -> None:
        """Called once on the loop thread before the first launch: ``wake()`` (loop thread
        only) tells the scheduler loop that a pending task changed state."""

    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        """Start ``run_fn(task)``; an exception from it may raise here or land in
        ``pending.error``."""

    def release(self, pending: Pending) -> None:
        """Forget ``pending`` (its outputs were handed on)."""

    def begin_step(self) -> None:
        """A step starts (CUDA: order the step after the host's earlier device work, e.g. the
        optimizer)."""

    def end_step(self) -> None:
        """Every task of the step is done (CUDA: order later device work after the step)."""

    def close(self) -> None:
        """Free the executor's resources (threads, streams); idempotent."""


class _NoDeviceWork:
    """Step boundaries, releases and copies for executors whose tasks leave no device work
    behind."""

    copies = None

    def release(self, pending: Pending) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass


class InlineExecutor(_NoDeviceWork):
    """Runs each task to completion inside :meth:`launch`, on the loop thread (the CPU default).

    ZeroMQ keeps receiving in its own I/O thread while Python computes, and the arrivals are
    routed as soon as the task returns, so inline costs nothing per task beyond the call. The
    loop answers nothing (control messages, heartbeats) while a task runs.
    """

    name = "inline"
    window = 1

    def bind(self, wake: Callable[[], None]) -> None:
        pass

    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        p = Pending(task, time.perf_counter())
        p.outputs = run_fn(task)
        p.launched = p.done = True
        return p

    def close(self) -> None:
        pass


class ThreadExecutor(_NoDeviceWork):
    """Runs tasks on one CPU worker thread, so the loop keeps answering during long tasks
    (control messages, heartbeats, TP agreement).

    One thread, one task at a time (the arbiter runs one task at a time anyway): the task's
    compute runs on the worker while the loop thread routes arrivals and runs other coroutines;
    the worker hands the result back with ``loop.call_soon_threadsafe``, which wakes the loop.
    Costs a thread hop and back per task (``benchmarks/bench_executor.py``). PyTorch releases
    the GIL inside its kernels, so the loop thread gets the interpreter while they run; a task
    spending its time in Python code shares the GIL with the loop.

    The worker is a daemon thread (not a ``ThreadPoolExecutor``'s, which the interpreter joins
    at exit): a task that never returns, reported by the watchdog
    (:mod:`rrfp.runtime.engine.watchdog`), cannot keep the process from exiting.
    """

    name = "thread"
    window = 1

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] = lambda: None

    def bind(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def launch(self, task: Task, run_fn: RunFn) -> Pending:
        if self._jobs is None:
            self._loop = asyncio.get_running_loop()
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(self._jobs,), name="rrfp-task", daemon=True).start()
        p = Pending(task, time.perf_counter())
        # The caller's autocast around step() is thread-local: carried to the worker (engine/autocast.py).
        self._jobs.put((p, run_fn, autocast.capture()))
        return p

    def _work(self, jobs: queue.SimpleQueue) -> None:  # the worker thread
        while (job := jobs.get()) is not None:
            self._run(*job)
            del job  # the task's tensors go with its outputs, not with this frame

    def _run(self, p: Pending, run_fn: RunFn, amp: autocast.AutocastState | None = None) -> None:  # on the worker
        try:
            with autocast.entered(amp):
                out, err = run_fn(p.task), None
        except BaseException as e:  # noqa: BLE001 - re-raised by the loop
            out, err = [], e
        try:
            self._loop.call_soon_threadsafe(self._finished, p, out, err)
        except RuntimeError:  # the loop closed while the task ran (an aborted step): nobody waits
            pass

    def _finished(self, p: Pending, out: list, err: BaseException | None) -> None:  # on the loop
        p.outputs, p.error = out, err
        p.launched = p.done = True
        self._wake()

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)  # the worker ends after its task; one that never returns is a daemon
            self._jobs = None


EXECUTORS = ("inline", "thread", "cuda")


def make_executor(name: str, device: torch.device | str | None = None, window: int = 1) -> Executor:
    """An executor by name: ``inline``, ``thread`` or ``cuda`` (on ``device``, with a
    launch-ahead ``window`` of 1 or 2 tasks); ``auto`` is ``cuda`` on a CUDA device, else
    ``inline``.

    Raises:
        ValueError: an unknown name, or ``cuda`` for a non-CUDA device.
        RuntimeError: ``cuda`` without CUDA.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if name == "auto":
        name = "cuda" if dev.type == "cuda" else "inline"
    if name == "inline":
        return InlineExecutor()
    if name == "thread":
        return ThreadExecutor()
    if name == "cuda":
        if dev.type != "cuda":
            raise ValueError(f"executor 'cuda' on device {str(dev)!r}: expected a CUDA device")
        from .cuda import CudaExecutor

        return CudaExecutor(dev, window=window)
    raise ValueError(f"executor {name!r}: expected one of auto, {', '.join(EXECUTORS)}")
