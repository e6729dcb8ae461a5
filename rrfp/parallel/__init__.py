"""Parallel layout beyond one pipeline: PP x DP x TP coordinates, process groups, data-parallel
gradient reduction, tied parameters across stages and global-norm clipping (docs/architecture.md,
"Layers")."""

from .layout import ParallelLayout

__all__ = ["ParallelLayout"]
