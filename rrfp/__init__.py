"""rrfp: a readiness-driven runtime for pipeline-parallel training (RRFP, arXiv 2605.18750)."""

__version__ = "0.1.0"
