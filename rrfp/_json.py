"""Strict JSON for the files rrfp writes (standard library only).

Python's ``json`` writes ``inf`` and ``nan`` as ``Infinity`` and ``NaN``, which are not JSON:
``jq``, JavaScript's ``JSON.parse`` and most other readers refuse the whole file. Every
``--json`` output goes through :func:`dumps`, which writes a non-finite float as the string
``"inf"``, ``"-inf"`` or ``"nan"`` (what ``float()`` reads back); :func:`restore` turns those
strings back into floats for a reader of rrfp's own files (``rrfp bench --from-json``).
"""

from __future__ import annotations

import json
import math
from typing import Any

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes only strict JSON (``allow_nan=False``): non-finite floats
    become ``"inf"``/``"-inf"``/``"nan"``. Objects handed to ``default`` are not searched."""
    return json.dumps(_encode(obj), allow_nan=False, **kwargs)


def restore(obj: Any) -> Any:
    """The inverse of :func:`dumps`'s encoding: ``"inf"``, ``"-inf"``, ``"nan"`` strings (in
    dicts and lists, at any depth) back to floats."""
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [restore(v) for v in obj]
    return obj
