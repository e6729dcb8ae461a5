"""Callbacks at absolute ``time.monotonic()`` deadlines on an event loop, never early and late
only by the kernel's timer slack.

The inbox's injected message hold (:attr:`rrfp.runtime.engine.inbox.Inbox.hold`) releases an arrival at
its delivery time. ``loop.call_later`` is too coarse for that: uvloop (libuv) keeps timers in
whole milliseconds on a loop clock read once per iteration, so a release fired up to ~1 ms late
when the rank was idle (and early when the timer was set after a long callback), while the
benchmarks' PyTorch side waits with ``time.sleep``, precise to tens of microseconds. Measured
on the ``comm4`` benchmark (4 ranks, 2 cores): median lateness of an idle rank's release
0.3-0.7 ms (90th percentile up to 3.4 ms) against 0.16 ms for ``time.sleep``.

Where the platform has it (Linux), one ``timerfd`` on ``CLOCK_MONOTONIC`` (the clock of
``time.monotonic``), armed at the earliest deadline with ``TFD_TIMER_ABSTIME``, is watched by
the loop (``add_reader``): the loop wakes exactly when the kernel's timer expires. Elsewhere
``call_later`` stands in, re-armed until the deadline has really passed (never early).
"""

from __future__ import annotations

import asyncio
import heapq
import os
import time
from typing import Any, Callable

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)


class _TimerFd:
    """A non-blocking ``timerfd`` (``os.timerfd_*`` on Python >= 3.13, else libc through ctypes)."""

    def __init__(self) -> None:
        if hasattr(os, "timerfd_create"):
            self.fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
            self._set = self._set_os
            return
        import ctypes
        import ctypes.util

        class _Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        class _Itimerspec(ctypes.Structure):
            _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._libc, self._spec_t, self._ts_t = libc, _Itimerspec, _Timespec
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._set = self._set_ctypes

    def arm(self, when: float) -> None:
        """Expire at monotonic time ``when`` (seconds; a past time expires at once)."""
        ns = max(int(when * 1e9), 1)  # 0 would disarm
        self._set(ns)

    def _set_os(self, ns: int) -> None:
        os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=ns)

    def _set_ctypes(self, ns: int) -> None:
        import ctypes

        spec = self._spec_t(self._ts_t(0, 0), self._ts_t(ns // 1_000_000_000, ns % 1_000_000_000))
        if self._libc.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def drain(self) -> None:
        try:
            os.read(self.fd, 8)
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        os.close(self.fd)


def _timerfd() -> _TimerFd | None:
    try:
        return _TimerFd()
    except (OSError, AttributeError):  # not Linux, or no timerfd in this libc
        return None


class DeadlineTimers:
    """Callbacks at absolute monotonic deadlines, on the loop thread of ``loop``.

    Callbacks whose deadlines have passed run in deadline order (equal deadlines: in the order
    they were added), each at or after its deadline, never before. Call :meth:`close` when done
    (it frees the kernel timer; pending callbacks never run).

    Args:
        loop: the running event loop the callbacks run on.
        precise: use the kernel timer where there is one (False: ``call_later`` only).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, precise: bool = True) -> None:
        self.loop = loop
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self._armed = float("inf")  # the deadline the timer is set for
        self._handle: asyncio.TimerHandle | None = None
        self._tfd = _timerfd() if precise else None
        if self._tfd is not None:
            loop.add_reader(self._tfd.fd, self._fire)
        self.closed = False

    @property
    def precise(self) -> bool:
        """True when the kernel timer is used."""
        return self._tfd is not None

    def __len__(self) -> int:
        return len(self._heap)

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread at monotonic time ``when`` (seconds) or later."""
        if self.closed:
            raise RuntimeError("DeadlineTimers.call_at after close()")
        heapq.heappush(self._heap, (when, self._seq, fn, args))
        self._seq += 1
        if when < self._armed:
            self._arm(when)

    def _arm(self, when: float) -> None:
        self._armed = when
        if self._tfd is not None:
            self._tfd.arm(when)
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self.loop.call_later(max(when - time.monotonic(), 0.0), self._fire)

    def _fire(self) -> None:
        if self.closed:
            return
        if self._tfd is not None:
            self._tfd.drain()
        self._handle = None
        self._armed = float("inf")
        heap = self._heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, fn, args = heapq.heappop(heap)
            fn(*args)
            if self.closed:
                return
        if heap:  # the next deadline; or this one again when the fallback timer fired early
            self._arm(heap[0][0])

    def close(self) -> None:
        """Drop every pending callback and free the kernel timer (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._heap.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._tfd is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._tfd.fd)
            self._tfd.close()
            self._tfd = None
