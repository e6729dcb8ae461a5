"""Joining a launched job, for the callers that import it from here (the train loop,
:mod:`rrfp.runtime.pipeline`); it lives in :mod:`rrfp.parallel.bootstrap`."""

from ..parallel.bootstrap import default_store, default_transport, in_launched_worker, init_distributed

__all__ = ["default_store", "default_transport", "in_launched_worker", "init_distributed"]
