"""Per-stage task costs: the deterministic part of the simulator's duration model.

Three sources, one type (:class:`CostModel`):

- flags: one :class:`StageCost` for every stage (:meth:`CostModel.uniform`);
- a TOML file (:func:`load_toml`): top-level keys are defaults, ``[[stages]]`` tables override
  them stage by stage::

      F = 0.010          # seconds per microbatch
      B = 0.020
      act_bytes = 8388608
      [[stages]]         # stage 0: an image encoder
      F = 0.030
      B = 0.060
      [[stages]]         # stage 1 takes the defaults

- a profile JSON (:func:`load_profile`), the format ``rrfp train --trace DIR`` writes from
  measured runs (:func:`save_profile`; its ``act_bytes`` is the median of what the stage's
  forwards saved for their backward, ``msg_bytes`` the median size of their outputs; see
  ``rrfp.train.tracing.profile_from_records``)::

      {"stages": [{"F": 0.010, "B": 0.021, "I": 0.011, "W": 0.010, "act_bytes": 8388608}, ...],
       "meta": {...}}

Field meanings (per stage, per microbatch): ``F`` forward seconds; ``B`` full-backward seconds;
``I`` / ``W`` the split backward's input-gradient and weight-gradient seconds; ``act_bytes`` the
activation memory one in-flight microbatch holds on the stage (bytes); ``msg_bytes`` the size of
the stage's output message (bytes; default ``act_bytes``); ``w_bytes`` what a split backward's
``W`` still reads once ``I`` has run (bytes, at most ``act_bytes``; default unknown: the memory
ledger then keeps all of ``act_bytes`` until ``W``, the conservative rule,
:mod:`rrfp.scheduler.memory`). The gradient a stage sends back to
stage ``s - 1`` has the size of stage ``s - 1``'s output.

Missing fields are derived: ``B = I + W`` when only the split is given; ``I = W = B / 2`` when
only ``B`` is (the issue's rule; zero-bubble papers measure W close to I); one of ``I``/``W``
given: the other is ``B`` minus it. A file with one stage applies to every stage. The derived
split is an assumption: the real runtime runs stage 0's whole backward in ``W`` (its ``I`` is a
no-op) and a small transformer stage's ``I`` costs most of a ``B``; a profile measured in place
(``auto``'s, :func:`rrfp.sim.calibration.stage_costs`) carries what really happens.

Every given time is at most :data:`MAX_SECONDS` and every size at most :data:`MAX_BYTES`, so
that no product of a cost with the simulator's bounded factors overflows to ``inf``.

Pure module: no torch (``tomllib`` and ``json`` from the standard library).
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from ..scheduler.tasks import KINDS

_SECONDS = tuple(KINDS)
_FIELDS = (*_SECONDS, "act_bytes", "msg_bytes", "w_bytes")

MAX_SECONDS = 1e9
"""Largest accepted time of one task or message, in seconds (about 31 years). Real costs are
far below it; the cap keeps a simulated makespan (a finite sum of bounded products) finite."""

MAX_BYTES = 2**53
"""Largest accepted size in bytes (8 PiB): every such integer is exact as a float."""


def short(x: float) -> str:
    """``x`` as a short number for messages: ``1e9``, not ``1e+09`` (``%g`` without the
    exponent's sign and padding)."""
    return re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{x:g}")


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage for one microbatch (seconds; bytes).

    Raises:
        ValueError: for a negative or non-finite value, a time above :data:`MAX_SECONDS`, a
            size above :data:`MAX_BYTES`, or ``I + W`` inconsistent with ``B`` when one of
            them has to be derived.
    """

    F: float
    B: float
    I: float
    W: float
    act_bytes: int = 0
    msg_bytes: int = 0
    w_bytes: int | None = None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], where: str = "stage") -> "StageCost":
        """Build from a dict with ``F`` and ``B`` (or ``I`` and ``W``), deriving the rest
        (module docstring).

        Raises:
            ValueError: naming ``where`` and the field, for an unknown field, a missing
                forward or backward cost, or a bad value.
        """
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r}: expected {', '.join(_FIELDS)}")
        vals: dict[str, float | None] = {}
        for k in _FIELDS:
            v = d.get(k)
            if v is not None:
                # Not math.isfinite on an int: a JSON or TOML integer may be too big for a float.
                if (isinstance(v, bool) or not isinstance(v, (int, float))
                        or (isinstance(v, float) and not math.isfinite(v)) or v < 0):
                    raise ValueError(f"{where}: {k}={v!r}: expected a non-negative number")
                shown = repr(v) if len(repr(v)) <= 24 else f"{repr(v)[:12]}... ({len(repr(v))} digits)"
                if k in _SECONDS and v > MAX_SECONDS:
                    raise ValueError(f"{where}: {k}={shown}: expected seconds <= {short(MAX_SECONDS)}")
                if k not in _SECONDS and v > MAX_BYTES:
                    raise ValueError(f"{where}: {k}={shown}: expected bytes <= {MAX_BYTES} (2**53)")
            vals[k] = v
        if vals["F"] is None:
            raise ValueError(f"{where}: missing F (forward seconds per microbatch)")
        b, i, w = vals["B"], vals["I"], vals["W"]
        if b is None:
            if i is None or w is None:
                raise ValueError(f"{where}: missing B (or both I and W)")
            b = i + w
        if i is None and w is None:
            i = w = b / 2
        elif i is None:
            i = b - w  # type: ignore[operator]
        elif w is None:
            w = b - i
        if i < -1e-12 or w < -1e-12:  # type: ignore[operator]
            raise ValueError(f"{where}: I={i}, W={w} do not fit in B={b}")
        act = int(vals["act_bytes"] or 0)
        msg = int(vals["msg_bytes"]) if vals["msg_bytes"] is not None else act
        wb = None if vals["w_bytes"] is None else int(vals["w_bytes"])
        if wb is not None and wb > act:
            raise ValueError(f"{where}: w_bytes={wb}: expected at most act_bytes={act} (W reads part of what F saved)")
        return cls(float(vals["F"]), float(b), max(0.0, float(i)), max(0.0, float(w)), act, msg, wb)  # type: ignore[arg-type]

    def cost(self, kind: str) -> float:
        """Seconds of a task of ``kind`` (``F``, ``B``, ``I`` or ``W``)."""
        return getattr(self, kind)


@dataclass(frozen=True)
class CostModel:
    """Costs of every stage, indexed by global stage (virtual stages included).

    Raises:
        ValueError: for an empty list.
    """

    stages: tuple[StageCost, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a cost model needs at least one stage")

    @classmethod
    def uniform(
        cls, n_stages: int, F: float, B: float, I: float | None = None, W: float | None = None,
        act_bytes: int = 0, msg_bytes: int | None = None,
    ) -> "CostModel":
        """Every stage the same (flags)."""
        c = StageCost.from_mapping(
            {"F": F, "B": B, "I": I, "W": W, "act_bytes": act_bytes, "msg_bytes": msg_bytes}, "costs"
        )
        return cls((c,) * n_stages)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def for_stages(self, n_stages: int, source: str = "cost model") -> "CostModel":
        """This model fitted to a pipeline of ``n_stages`` stages: itself, or its single
        stage repeated.

        Raises:
            ValueError: when the counts differ and this model has more than one stage.
        """
        if self.n_stages == n_stages:
            return self
        if self.n_stages == 1:
            return CostModel(self.stages * n_stages)
        raise ValueError(
            f"{source} has {self.n_stages} stages but the pipeline has {n_stages} "
            "(ranks x virtual stages); give one entry per stage, or one for all"
        )

    def table(self) -> list[dict[str, float]]:
        """Per stage, seconds per kind: ``table()[stage]["F"]``. A list of dicts is the
        fastest lookup in the simulator's inner loop."""
        return [{"F": c.F, "B": c.B, "I": c.I, "W": c.W} for c in self.stages]

    def to_profile(self, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The profile JSON object (module docstring)."""
        out: dict[str, Any] = {"stages": [{k: v for k, v in asdict(c).items() if v is not None} for c in self.stages]}
        if meta:
            out["meta"] = dict(meta)
        return out

    @classmethod
    def from_profile(cls, obj: Mapping[str, Any], source: str = "profile") -> "CostModel":
        """Parse a profile JSON object.

        Raises:
            ValueError: one line naming ``source``, the stage and the field.
        """
        if not isinstance(obj, Mapping) or not isinstance(obj.get("stages"), list):
            raise ValueError(f"{source}: expected an object with a 'stages' list")
        return cls(_parse_stages(obj["stages"], {}, source))


def _parse_stages(entries: Iterable[Any], defaults: Mapping[str, Any], source: str) -> tuple[StageCost, ...]:
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            raise ValueError(f"{source}: stage {i}: expected a table of costs, got {type(e).__name__}")
        out.append(StageCost.from_mapping({**defaults, **e}, f"{source}: stage {i}"))
    return tuple(out)


def load_profile(path: str | os.PathLike) -> CostModel:
    """Read a profile JSON (module docstring).

    Raises:
        OSError: the file cannot be read.
        ValueError: invalid JSON or an invalid entry, naming the file.
    """
    return CostModel.from_profile(read_json(path), str(path))


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file ``path`` (a profile, a calibration).

    Raises:
        OSError: the file cannot be read.
        ValueError: not valid JSON, naming the file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None


def save_profile(costs: CostModel, path: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> None:
    """Write ``costs`` as a profile JSON that :func:`load_profile` reads back.

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(costs.to_profile(meta), f, indent=1)
        f.write("\n")


def load_toml(path: str | os.PathLike) -> CostModel:
    """Read a TOML cost file (module docstring): top-level defaults, optional ``[[stages]]``.

    Raises:
        OSError: the file cannot be read.
        ValueError: invalid TOML or an invalid entry, naming the file.
    """
    with open(path, "rb") as f:
        try:
            obj = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    stages = obj.pop("stages", None)
    if stages is None:
        return CostModel((StageCost.from_mapping(obj, str(path)),))
    if not isinstance(stages, list) or not stages:
        raise ValueError(f"{path}: 'stages' must be a non-empty array of tables ([[stages]])")
    return CostModel(_parse_stages(stages, obj, str(path)))


def load_costs(path: str | os.PathLike) -> CostModel:
    """Read a cost file by its suffix: ``.json`` (profile) or ``.toml``.

    Raises:
        ValueError: another suffix, or an invalid file.
        OSError: the file cannot be read.
    """
    p = os.fspath(path)
    if p.endswith(".json"):
        return load_profile(p)
    if p.endswith(".toml"):
        return load_toml(p)
    raise ValueError(f"cost file {p!r}: expected a .json profile or a .toml file")
