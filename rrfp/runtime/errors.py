"""The runtime's errors, in a leaf module so that every part of the runtime can raise them
without importing :mod:`rrfp.runtime.rank` (which imports those parts). Re-exported there."""

from __future__ import annotations


class WatchdogTimeout(RuntimeError):
    """A rank made no progress for the watchdog's period; the message says what it waits for."""


class PipelineError(RuntimeError):
    """A message or input that a correct pipeline cannot produce (wrong job, stale step...)."""
