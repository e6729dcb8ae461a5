"""An asyncio event loop on simulated time, for tests whose outcome depends on time.

Time stands still while the loop has work, and jumps to the next timer when the loop would
otherwise wait for one: a message delay of 0.1 s or a watchdog period of 0.5 s costs no real
time, and whatever a test asserts about them depends on the scheduled times alone, never on
how loaded the machine is. (The runtime's watchdog and the fake transport's message delays
both read the event loop's clock, ``loop.time()``.)

Only for code whose work all runs on the loop thread (the inline executor, the fake
transport): while a thread or a socket is awaited the loop waits in real time, as usual, but
a timer due meanwhile would fire early in simulated time.
"""

from __future__ import annotations

import asyncio
import selectors


class _JumpSelector(selectors.DefaultSelector):
    """Polls without waiting; where the loop would wait up to ``timeout`` for a timer with no
    I/O ready, moves the loop's clock ``timeout`` on instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0:
            # Nothing scheduled at all: only I/O (a thread's wake-up) can move the loop on.
            return ready if ready or timeout is not None else super().select(None)
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` starts at 0.0 and moves only to the next due timer.

    ``loop.now`` is that time in seconds.
    """

    def __init__(self) -> None:
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now
