"""The runtime's errors, for :mod:`rrfp.runtime.loop`; they live in :mod:`rrfp.errors`."""

from ..errors import PipelineError, WatchdogTimeout

__all__ = ["PipelineError", "WatchdogTimeout"]
