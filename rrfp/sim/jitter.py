"""Keyed randomness and the paper's injected compute jitter (RRFP §7, "Injected jitter").

Every random draw here is a pure function of a key ``(seed, step, stage, microbatch, kind)``
plus a *stream* number that separates independent draws under one key. Nothing is drawn from
a shared sequential generator, so a draw does not depend on the order in which tasks run: the
simulator, the real runtime and a benchmark that use the same seed inject identical delays into
the same tasks whatever their schedules.

The hash is SplitMix64's finaliser (Steele et al. 2014) folded over the key's integers, a few
lines in any language (a C++ backend can reproduce it bit for bit)::

    mix(z):  z = (z + 0x9E3779B97F4A7C15) mod 2^64
             z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
             z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
             return z ^ (z >> 31)
    h = mix(seed); for x in (stream, step, stage, microbatch, kind code): h = mix(h ^ x)
    uniform = (h >> 11) / 2^53                         # in [0, 1)

Integers enter modulo 2^64 (two's complement for negatives); kind codes are
:data:`KIND_CODE`.

Injected jitter (the paper's model): each F and each backward, with probability ``p``, gets an
extra delay ``d = a * max(b, e) * (0.5 + U(0, 1))``. Levels: J0 (p = 0), J1 (0.1, 5 ms, 0.5),
J2 (0.2, 10 ms, 1.0), J3 (0.3, 15 ms, 1.5).

``e`` is the paper's "running average compute time" of the task's stage, taken at its steady
state: the stage's *expected* compute per task, the mean of its expected forward and backward
(a running average ``e <- 0.9 e + 0.1 c`` over a stage that runs as many forwards as
backwards settles there). The caller passes it (:class:`rrfp.sim.duration.DurationModel`: from
the stage's costs; ``benchmarks/harness.py``: from the stage's calibrated or slept costs). An
average of the tasks actually run would depend on the order they ran in, so two hints would
meet different delays on the same task (by at most 0.16% of the suite's makespans, measured
before this rule); with ``e`` fixed per stage, every draw is a pure function of the task's key
and ``e``, and every hint, the real harness and the exact optimiser of ``benchmarks/oracle.py``
meet the same workload.

A split backward is one backward (:meth:`InjectedJitter.split_backward`): one draw keyed on kind
``B`` with the stage's ``e``, shared between ``I`` and ``W`` in proportion to their compute
times (``d_I = d * c_I / (c_I + c_W)``, ``d_W = d - d_I``). So a split-backward schedule gets the
injected work of the unsplit one on each microbatch (not two draws, each with the floor ``b``).
The benchmark harness does the same (``benchmarks/harness.py``: ``I``'s share sleeps on the
input-gradient path, ``W``'s on the weight-gradient path).

Pure module: no torch, no numpy, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..scheduler.tasks import KIND_INDEX

_M64 = (1 << 64) - 1
_TWO_53 = 1.0 / (1 << 53)

KIND_CODE: dict[str | None, int] = {**KIND_INDEX, None: 15}
"""Integer code of a task kind inside a key, the kind table's stable index
(:data:`rrfp.scheduler.tasks.KIND_INDEX`: F 0, B 1, I 2, W 3); ``None`` keys draws that belong
to no task (per-microbatch workload draws)."""

# Stream numbers: independent draws under one key. Fixed forever: changing one changes every
# recorded jitter realisation.
STREAM_INJECT_HIT = 1  # does this task get an injected delay?
STREAM_INJECT_SIZE = 2  # U(0, 1) of the delay's size
STREAM_NOISE = 3  # lognormal compute noise (3 and 4: Box-Muller pair)
STREAM_COMM_NOISE = 5  # lognormal message-time noise (5 and 6)
STREAM_COMM_HIT = 7  # injected message delay
STREAM_COMM_SIZE = 8
STREAM_SEQLEN = 9  # per-microbatch sequence-length draw
STREAM_IMAGES = 10  # per-sample image-count draws (stage field = sample index)


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def key_hash(seed: int, stream: int, step: int, stage: int, microbatch: int, kind: str | int | None) -> int:
    """64-bit hash of one key (algorithm in the module docstring).

    Raises:
        KeyError: for a kind that is not ``F``, ``B``, ``I``, ``W``, None or an int.
    """
    code = kind if isinstance(kind, int) else KIND_CODE[kind]
    h = _mix(seed & _M64)
    h = _mix(h ^ (stream & _M64))
    h = _mix(h ^ (step & _M64))
    h = _mix(h ^ (stage & _M64))
    h = _mix(h ^ (microbatch & _M64))
    return _mix(h ^ (code & _M64))


def keyed_uniform(
    seed: int, step: int, stage: int, microbatch: int, kind: str | int | None, stream: int = 0
) -> float:
    """A uniform draw in ``[0, 1)`` (53 bits) that depends only on its key and stream."""
    return (key_hash(seed, stream, step, stage, microbatch, kind) >> 11) * _TWO_53


def keyed_normal(
    seed: int, step: int, stage: int, microbatch: int, kind: str | int | None, stream: int = 0
) -> float:
    """A standard normal draw from the key (Box-Muller over streams ``stream`` and
    ``stream + 1``)."""
    u1 = 1.0 - keyed_uniform(seed, step, stage, microbatch, kind, stream)  # (0, 1]: log is finite
    u2 = keyed_uniform(seed, step, stage, microbatch, kind, stream + 1)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def lognormal_factor(
    sigma: float, seed: int, step: int, stage: int, microbatch: int, kind: str | int | None,
    stream: int = STREAM_NOISE,
) -> float:
    """Multiplicative noise ``exp(sigma * Z - sigma^2 / 2)``: lognormal with mean 1, so noise
    does not change the expected cost. ``sigma = 0`` returns exactly 1."""
    if sigma <= 0.0:
        return 1.0
    z = keyed_normal(seed, step, stage, microbatch, kind, stream)
    return math.exp(sigma * z - 0.5 * sigma * sigma)


@dataclass(frozen=True)
class JitterLevel:
    """Parameters of the injected-jitter model (RRFP §7).

    Attributes:
        name: label (``J0``..``J3`` or ``custom``).
        p: probability that a task is delayed, ``0 <= p <= 1``.
        b: floor of the delay's scale in seconds.
        a: the delay's scale factor (dimensionless).

    Raises:
        ValueError: ``p`` outside [0, 1] or a negative ``a`` or ``b``.
    """

    name: str
    p: float
    b: float
    a: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"jitter probability p={self.p}: expected 0 <= p <= 1")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"jitter a={self.a}, b={self.b}: expected non-negative values")


LEVELS: dict[str, JitterLevel] = {
    "J0": JitterLevel("J0", 0.0, 0.0, 0.0),
    "J1": JitterLevel("J1", 0.1, 0.005, 0.5),
    "J2": JitterLevel("J2", 0.2, 0.010, 1.0),
    "J3": JitterLevel("J3", 0.3, 0.015, 1.5),
}
"""The paper's four levels; ``b`` in seconds."""


def parse_jitter(text: str) -> JitterLevel:
    """``"J0"``..``"J3"`` (any case) or ``"p,b,a"`` with ``b`` in seconds
    (``"0.2,0.01,1.0"`` is J2).

    Raises:
        ValueError: one line naming the text and the accepted forms.
    """
    t = text.strip()
    if t.upper() in LEVELS:
        return LEVELS[t.upper()]
    parts = t.split(",")
    try:
        if len(parts) != 3:
            raise ValueError
        p, b, a = (float(x) for x in parts)
        if not all(math.isfinite(x) and x >= 0 for x in (p, b, a)) or p > 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"jitter {text!r}: expected J0, J1, J2, J3 or 'p,b,a' with 0 <= p <= 1 and finite b, a >= 0 "
            "(b in seconds, e.g. 0.2,0.01,1.0)"
        ) from None
    return JitterLevel("custom", p, b, a)


def injected_delay(
    level: JitterLevel, seed: int, step: int, stage: int, microbatch: int, kind: str | int | None,
    e: float, *, streams: tuple[int, int] = (STREAM_INJECT_HIT, STREAM_INJECT_SIZE),
) -> float:
    """The injected delay of one task in seconds: with probability ``level.p`` (keyed draw),
    ``level.a * max(level.b, e) * (0.5 + U)``, else 0.

    Args:
        e: the stage's expected compute per task (seconds; the module docstring).
        streams: the (hit, size) streams; messages use their own pair.
    """
    if level.p <= 0.0:
        return 0.0
    if keyed_uniform(seed, step, stage, microbatch, kind, streams[0]) >= level.p:
        return 0.0
    u = keyed_uniform(seed, step, stage, microbatch, kind, streams[1])
    return level.a * max(level.b, e) * (0.5 + u)


class InjectedJitter:
    """The paper's injected jitter (RRFP §7) at one level and seed: stateless, so any call
    order gives the same delays.

    Args:
        level: the jitter level (:data:`LEVELS` or :func:`parse_jitter`).
        seed: the run's seed.
    """

    def __init__(self, level: JitterLevel, seed: int = 0) -> None:
        self.level = level
        self.seed = seed

    def __call__(self, step: int, stage: int, microbatch: int, kind: str, e: float) -> float:
        """The injected delay (seconds) of task ``(stage, kind, microbatch)`` of step ``step``,
        ``e`` the stage's expected compute per task (seconds, module docstring)."""
        return injected_delay(self.level, self.seed, step, stage, microbatch, kind, e)

    def split_backward(self, step: int, stage: int, microbatch: int, e: float, c_i: float,
                       c_w: float) -> tuple[float, float]:
        """The injected delays ``(d_I, d_W)`` (seconds) of a split backward whose ``I`` and
        ``W`` compute ``c_i`` and ``c_w`` seconds: the full backward's draw (kind ``B``, the
        stage's ``e``), shared in proportion to ``c_i : c_w`` (half each when both are 0)."""
        d = self(step, stage, microbatch, "B", e)
        if d == 0.0:
            return 0.0, 0.0
        c = c_i + c_w
        d_i = d * (c_i / c if c > 0 else 0.5)
        return d_i, d - d_i
