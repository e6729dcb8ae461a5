"""rrfp: a readiness-driven runtime for pipeline-parallel training (RRFP, arXiv 2605.18750).

Public API (imported lazily, so ``rrfp simulate`` never loads torch):

- :class:`Pipeline`: this rank's part of a multi-process pipeline (``torch.distributed.pipelining``
  shape: ``Pipeline(stage, n_microbatches, loss_fn, hint="bf").step(x, target=y)``).
- :class:`LocalPipeline`: every rank of a pipeline in one process over the fake transport.
- :class:`PipelineStage`: wraps one stage's ``nn.Module``.
- :class:`RuntimeConfig`: every runtime setting of either front door, in one record.
- :class:`ParallelLayout`: PP x DP x TP coordinates (``layout=``; a torch ``DeviceMesh`` works too).
- :class:`StepHooks`: code joining a rank's step (``RankRuntime.add_step_hooks``).
- Errors to catch: :class:`PipelineError`, :class:`WatchdogTimeout`, :class:`PeerLost`.
"""

__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "rrfp.runtime.doors.pipeline",
    "LocalPipeline": "rrfp.runtime.doors.local",
    "PipelineStage": "rrfp.runtime.engine.stage",
    "RuntimeConfig": "rrfp.runtime.doors.config",
    "ParallelLayout": "rrfp.parallel.layout",
    "StepHooks": "rrfp.runtime.engine.hooks",
    "PipelineError": "rrfp.errors",
    "WatchdogTimeout": "rrfp.errors",
    "PeerLost": "rrfp.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rrfp' has no attribute {name!r}")
