"""The errors every layer of rrfp may raise, in a module that imports nothing of rrfp, so
that the command line, the train loop, the runtime, the transports and the simulator can
raise and catch them without importing each other."""

from __future__ import annotations

from typing import Any

__all__ = ["PeerLost", "PipelineError", "TransportClosed", "UsageError", "WatchdogTimeout"]


class UsageError(Exception):
    """Bad input found before any process starts: printed as one line, exit code 2."""


class PipelineError(RuntimeError):
    """A message or input that a correct pipeline cannot produce (wrong job, stale step...)."""


class WatchdogTimeout(RuntimeError):
    """A rank made no progress for the watchdog's period; the message says what it waits for."""


class PeerLost(RuntimeError):
    """A peer disconnected (died, hung past the heartbeat timeout, or aborted)
    without saying goodbye. ``rank`` is the lost peer."""

    def __init__(self, rank: int, reason: str = "connection closed") -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank} lost: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (PeerLost, (self.rank, self.reason))


class TransportClosed(RuntimeError):
    """The local transport was closed or aborted; no more messages will arrive."""
