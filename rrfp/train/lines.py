"""``say`` for the train loop's modules; it lives in :mod:`rrfp.lines`, below every layer."""

from ..lines import say

__all__ = ["say"]
