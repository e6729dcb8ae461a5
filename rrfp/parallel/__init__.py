"""Parallel layout beyond one pipeline: PP x DP x TP coordinates, process groups, data-parallel
gradient reduction (replicated, or FSDP2-sharded stages: ``sharded.py``), tied parameters across
stages, global-norm clipping and each rank's bytes by kind (docs/architecture.md, "Layers")."""

from .layout import ParallelLayout

__all__ = ["ParallelLayout"]
