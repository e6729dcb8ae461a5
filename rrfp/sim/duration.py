"""Duration models: seconds per task and per message, seeded and order-independent.

:class:`DurationModel` is the ``duration(step, rank, task) -> seconds`` function the simulator
calls (and the real runtime can call to pad or delay its tasks to the same durations, so that
simulated and measured runs can be compared task by task). :class:`CommModel` is the
``delay(step, src, dst, task) -> seconds`` of a message.

A task's duration, for stage ``s`` and microbatch ``m`` in step ``k``::

    c = cost[s][kind]                     (CostModel: flags, TOML or a profile JSON)
        * encoder_scale                   (first `encoder_stages` stages only: encoder/LLM imbalance)
        * images(k, m) / E[images]        (the same stages, when an image-count distribution is set)
        * seqlen(k, m)                    (a per-microbatch sequence-length ratio, mean ~1)
        * straggler[rank]                 (slowdown factor of a straggler rank, default 1)
        * lognormal(k, s, m, kind)        (compute noise, mean 1)
    duration = c + injected(k, s, m, kind, e_s)   (RRFP §7 jitter)

``e_s`` is the stage's *expected* compute per task: the mean of its ``F`` and ``B`` costs, times
the factors whose mean is not 1 (``encoder_scale``, the straggler factor, the sequence-length
distribution's mean), the steady state of the paper's running average (:mod:`rrfp.sim.jitter`).
It does not depend on which tasks ran before, so every duration is a pure function of the task:
any call order, any hint, gives the same durations (what :func:`rrfp.sim.engine.simulate`, the
suite and the exact optimiser of ``benchmarks/oracle.py`` rely on).

A split backward's ``I`` and ``W`` share one injected draw, the full backward's (keyed ``B``),
in proportion to their ``c`` (:meth:`rrfp.sim.jitter.InjectedJitter.split_backward`), so every
hint gets the same injected work per microbatch whether or not it splits the backward.

A message from the task that produced it (``F`` of stage ``s``: ``msg_bytes[s]``; ``B``/``I`` of
stage ``s``: ``msg_bytes[s - 1]``, the gradient of that stage's output)::

    delay = (latency + bytes / bandwidth) * slow[edge] * lognormal(...) + injected(..., e = that nominal time)

``slow[edge]`` is a persistent slowdown of one link between two ranks (default 1).

Every compute draw is keyed by ``(seed, step, stage, microbatch, kind)`` (:mod:`rrfp.sim.jitter`),
so policies compared under one seed see the same workload and the same noise for each task. A
message's draws are keyed by the message alone, ``(seed, step, producing stage, microbatch,
direction)`` with direction ``F`` (an activation) or ``B`` (a gradient), never by the kind of
the task that sent it: the gradient a split backward sends after ``I`` draws the same delay as
the one a full backward sends after ``B``, so split and unsplit hints meet the same network.

Pure module: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Mapping

from ..scheduler.tasks import B, F, I, W, Task
from .costs import CostModel
from .jitter import (
    STREAM_COMM_HIT,
    STREAM_COMM_NOISE,
    STREAM_COMM_SIZE,
    STREAM_IMAGES,
    STREAM_NOISE,
    STREAM_SEQLEN,
    InjectedJitter,
    JitterLevel,
    injected_delay,
    keyed_uniform,
    lognormal_factor,
)

_NORMAL = NormalDist()


@dataclass(frozen=True)
class Dist:
    """A distribution over non-negative numbers, sampled by inverse CDF from one uniform (so a
    keyed uniform gives a keyed sample).

    Text forms (:meth:`parse`): ``fixed:x``, ``uniform:lo,hi``, ``lognormal:sigma`` (mean 1),
    ``poisson:lam``, ``randint:lo,hi`` (inclusive), ``choice:a,b,...`` (equally likely).

    Raises:
        ValueError: for a bad form or parameters.
    """

    kind: str
    params: tuple[float, ...]

    _ARITY = {"fixed": 1, "uniform": 2, "lognormal": 1, "poisson": 1, "randint": 2, "choice": -1}

    def __post_init__(self) -> None:
        k, p = self.kind, self.params
        if k not in self._ARITY:
            raise ValueError(f"distribution {k!r}: expected one of {', '.join(self._ARITY)}")
        n = self._ARITY[k]
        if (n >= 0 and len(p) != n) or (n < 0 and not p):
            raise ValueError(f"distribution {k}: expected {n if n >= 0 else 'one or more'} parameters, got {len(p)}")
        if any(x < 0 or not math.isfinite(x) for x in p):
            raise ValueError(f"distribution {k}:{','.join(map(str, p))}: parameters must be finite and >= 0")
        if k in ("uniform", "randint") and p[0] > p[1]:
            raise ValueError(f"distribution {k}: lo={p[0]} > hi={p[1]}")
        if k == "poisson" and p[0] > 500:
            raise ValueError(f"distribution poisson: lam={p[0]} too large (at most 500)")

    @classmethod
    def parse(cls, text: str) -> "Dist":
        """Parse ``kind:p1,p2,...``.

        Raises:
            ValueError: one line naming the text and the accepted forms.
        """
        kind, _, rest = text.strip().partition(":")
        try:
            params = tuple(float(x) for x in rest.split(",")) if rest else ()
        except ValueError:
            raise ValueError(
                f"distribution {text!r}: expected kind:numbers, e.g. uniform:0.5,1.5, lognormal:0.3, poisson:2"
            ) from None
        return cls(kind.strip().lower(), params)

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(f'{x:g}' for x in self.params)}"

    @property
    def mean(self) -> float:
        k, p = self.kind, self.params
        if k in ("fixed", "poisson"):
            return p[0]
        if k in ("uniform", "randint"):
            return (p[0] + p[1]) / 2
        if k == "lognormal":
            return 1.0
        return sum(p) / len(p)

    def sample(self, u: float) -> float:
        """The value at quantile ``u`` in ``[0, 1)``."""
        k, p = self.kind, self.params
        if k == "fixed":
            return p[0]
        if k == "uniform":
            return p[0] + u * (p[1] - p[0])
        if k == "lognormal":
            z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
            return math.exp(p[0] * z - 0.5 * p[0] * p[0])
        if k == "randint":
            lo, hi = int(p[0]), int(p[1])
            return float(min(hi, lo + int(u * (hi - lo + 1))))
        if k == "choice":
            return p[min(len(p) - 1, int(u * len(p)))]
        lam = p[0]  # poisson: walk the CDF
        n, term = 0, math.exp(-lam)
        cdf = term
        while u >= cdf and n < 10_000:
            n += 1
            term *= lam / n
            cdf += term
        return float(n)


class DurationModel:
    """``duration(step, rank, task) -> seconds`` (formula in the module docstring).

    Stateless (its caches hold pure functions of the key): call it any number of times, in
    any order; one model serves every run being compared.

    Args:
        costs: per-stage costs, one entry per stage of the pipeline.
        seed: seeds every draw.
        jitter: the injected-jitter level (None or J0: none).
        noise: sigma of the lognormal compute noise (0: none).
        seqlen: per-microbatch sequence-length ratio distribution (mean about 1), or None.
        images: per-sample image-count distribution (multimodal), or None.
        samples_per_microbatch: samples drawing an image count each.
        encoder_stages: how many leading stages form the image encoder (scaled by
            ``encoder_scale`` and by the image count).
        encoder_scale: cost multiplier of the encoder stages (encoder/LLM imbalance).
        stragglers: rank -> slowdown factor (``>= 0``).

    Attributes:
        fixed: with no jitter, noise, sequence lengths, images or stragglers, every task's
            seconds by stage and kind (``fixed[stage][kind]``, the simulator reads it instead
            of calling the model); else None.

    Raises:
        ValueError: for a negative factor or count, or an image distribution with mean 0.
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        seed: int = 0,
        jitter: JitterLevel | None = None,
        noise: float = 0.0,
        seqlen: Dist | None = None,
        images: Dist | None = None,
        samples_per_microbatch: int = 1,
        encoder_stages: int = 1,
        encoder_scale: float = 1.0,
        stragglers: Mapping[int, float] | None = None,
    ) -> None:
        if noise < 0 or encoder_scale < 0 or encoder_stages < 0 or samples_per_microbatch < 1:
            raise ValueError(
                f"noise={noise}, encoder_scale={encoder_scale}, encoder_stages={encoder_stages}, "
                f"samples_per_microbatch={samples_per_microbatch}: expected noise, scale, stages >= 0 "
                "and at least one sample per microbatch"
            )
        if images is not None and images.mean <= 0:
            raise ValueError(f"image-count distribution {images}: mean must be > 0")
        stragglers = dict(stragglers or {})
        for r, f in stragglers.items():
            if f < 0 or not math.isfinite(f):
                raise ValueError(f"straggler rank {r}: factor {f}: expected a finite number >= 0")
        self.costs = costs
        self.seed = seed
        self.jitter = jitter if jitter is not None and jitter.p > 0 else None
        self.noise = noise
        self.seqlen = seqlen
        self.images = images
        self.samples_per_microbatch = samples_per_microbatch
        self.encoder_stages = encoder_stages
        self.encoder_scale = encoder_scale
        self.stragglers = stragglers
        self._tab = costs.table()
        for s in range(min(encoder_stages, len(self._tab))):
            self._tab[s] = {k: v * encoder_scale for k, v in self._tab[s].items()}
        self._inject = InjectedJitter(self.jitter, seed) if self.jitter else None
        self._plain = self.jitter is None and noise == 0 and seqlen is None and images is None and not stragglers
        # Read by the simulator (rrfp.sim.engine): every task takes its stage and kind's time.
        self.fixed: list[dict[str, float]] | None = self._tab if self._plain else None
        self._e: dict[tuple[int, int], float] = {}  # (stage, rank) -> expected compute per task
        self._mb_scale: dict[tuple[int, int], float] = {}
        self._img_scale: dict[tuple[int, int], float] = {}

    def expected(self, stage: int, rank: int) -> float:
        """Seconds of compute a task of ``stage`` (on ``rank``) takes on average, the mean of
        its ``F`` and ``B``: the injected jitter's ``e`` (module docstring)."""
        key = (stage, rank)
        e = self._e.get(key)
        if e is None:
            t = self._tab[stage]
            e = 0.5 * (t[F] + t[B])
            if self.seqlen is not None:
                e *= self.seqlen.mean
            if self.stragglers:
                e *= self.stragglers.get(rank, 1.0)
            e = self._e[key] = e
        return e

    def seqlen_ratio(self, step: int, microbatch: int) -> float:
        """Microbatch ``microbatch``'s sequence-length ratio in step ``step`` (1 without a
        distribution). The same for every stage."""
        if self.seqlen is None:
            return 1.0
        key = (step, microbatch)
        r = self._mb_scale.get(key)
        if r is None:
            r = self._mb_scale[key] = self.seqlen.sample(
                keyed_uniform(self.seed, step, -1, microbatch, None, STREAM_SEQLEN)
            )
        return r

    def image_count(self, step: int, microbatch: int) -> float:
        """Total images in the microbatch (sum over its samples' draws); the distribution's
        mean times the sample count without a distribution."""
        if self.images is None:
            return self.samples_per_microbatch * 1.0
        return sum(
            self.images.sample(keyed_uniform(self.seed, step, i, microbatch, None, STREAM_IMAGES))
            for i in range(self.samples_per_microbatch)
        )

    def _image_scale(self, step: int, microbatch: int) -> float:
        key = (step, microbatch)
        r = self._img_scale.get(key)
        if r is None:
            r = self._img_scale[key] = self.image_count(step, microbatch) / (
                self.samples_per_microbatch * self.images.mean  # type: ignore[union-attr]
            )
        return r

    def input_size(self, step: int, microbatch: int) -> float:
        """Microbatch ``microbatch``'s input size in step ``step`` relative to an average one:
        its sequence-length ratio, times its image count over the mean where stage 0 encodes
        images (1 without either). What the elements of a real microbatch's input tensors
        follow (``auto``'s measure of a batch's work, :func:`rrfp.sim.auto.batch_work`), as
        stage 0's activation does (:meth:`act_bytes`)."""
        return self._size_ratio(step, 0, microbatch)

    def _size_ratio(self, step: int, stage: int, microbatch: int) -> float:
        r = 1.0
        if self.images is not None and stage < self.encoder_stages:
            r *= self._image_scale(step, microbatch)
        if self.seqlen is not None:
            r *= self.seqlen_ratio(step, microbatch)
        return r

    def act_bytes(self, step: int, stage: int, microbatch: int) -> int:
        """Bytes ``F(stage, microbatch)`` holds until its input backward in step ``step``: the
        stage's ``act_bytes`` times the microbatch's sequence-length ratio and, on the encoder
        stages, its image count over the mean (what an activation's size follows)."""
        b = self.costs.stages[stage].act_bytes
        return int(round(b * self._size_ratio(step, stage, microbatch))) if b else 0

    def compute(self, step: int, rank: int, task: Task) -> float:
        """Seconds of ``task`` without the injected jitter (stateless)."""
        s, kind, m = task
        c = self._tab[s][kind]
        if self._plain:
            return c
        if self.images is not None and s < self.encoder_stages:
            c *= self._image_scale(step, m)
        if self.seqlen is not None:
            c *= self.seqlen_ratio(step, m)
        if self.stragglers:
            c *= self.stragglers.get(rank, 1.0)
        if self.noise:
            c *= lognormal_factor(self.noise, self.seed, step, s, m, kind, STREAM_NOISE)
        return c

    def __call__(self, step: int, rank: int, task: Task) -> float:
        if self._plain:
            return self._tab[task[0]][task[1]]
        c = self.compute(step, rank, task)
        inject = self._inject
        if inject is not None:
            s, kind, m = task
            e = self.expected(s, rank)
            if kind == I or kind == W:
                other = self.compute(step, rank, Task(s, W if kind == I else I, m))
                c_i, c_w = (c, other) if kind == I else (other, c)
                d_i, d_w = inject.split_backward(step, s, m, e, c_i, c_w)
                c += d_i if kind == I else d_w
            else:
                c += inject(step, s, m, kind, e)
        return c


class CommModel:
    """``delay(step, src, dst, task) -> seconds`` of the message ``task`` produced (formula in
    the module docstring). Stateless: any call order gives the same delays.

    Args:
        costs: per-stage ``msg_bytes``.
        latency: seconds per message.
        bandwidth: bytes per second (``math.inf``: size costs nothing).
        noise: sigma of the lognormal noise on each message (0: none).
        jitter: injected-jitter level for messages (None: none); its ``e`` is the message's
            nominal time.
        seed: seeds every draw.
        slow_links: ``{(rank_a, rank_b): factor}``, a persistent slowdown of the link between
            two ranks (either direction; factor ``>= 1`` typically), multiplying the nominal time.

    Raises:
        ValueError: negative latency or noise, a bandwidth that is not positive, or a slow
            link factor that is not a finite number > 0.
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        latency: float = 0.0,
        bandwidth: float = math.inf,
        noise: float = 0.0,
        jitter: JitterLevel | None = None,
        seed: int = 0,
        slow_links: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        if latency < 0 or noise < 0 or not bandwidth > 0:
            raise ValueError(
                f"latency={latency}, bandwidth={bandwidth}, noise={noise}: expected latency >= 0, "
                "bandwidth > 0, noise >= 0"
            )
        self.costs = costs
        self.latency = latency
        self.bandwidth = bandwidth
        self.noise = noise
        self.jitter = jitter if jitter is not None and jitter.p > 0 else None
        self.seed = seed
        self._msg = [c.msg_bytes for c in costs.stages]
        self.slow: dict[tuple[int, int], float] = {}
        for (a, b), f in (slow_links or {}).items():
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"slow link {a}-{b}: factor {f}: expected a finite number > 0")
            self.slow[(min(a, b), max(a, b))] = float(f)

    @property
    def is_zero(self) -> bool:
        """True when every message takes no time (the simulator then skips the calls)."""
        sizes_free = self.bandwidth == math.inf or not any(self._msg)
        return self.latency == 0 and sizes_free and self.jitter is None and not self.slow

    def message_bytes(self, task: Task) -> int:
        """Bytes of the message ``task`` sends: a forward's output, or a backward's gradient
        for the previous stage's output."""
        s = task[0]
        return self._msg[s] if task[1] == F else self._msg[s - 1]

    def nominal(self, task: Task) -> float:
        """Seconds of the message without noise or jitter."""
        b = self.message_bytes(task)
        return self.latency + (b / self.bandwidth if b else 0.0)

    def link_factor(self, src: int, dst: int) -> float:
        """The persistent slowdown of the link between ranks ``src`` and ``dst`` (1: none)."""
        return self.slow.get((min(src, dst), max(src, dst)), 1.0) if self.slow else 1.0

    def __call__(self, step: int, src: int, dst: int, task: Task) -> float:
        s, kind, m = task
        # Keyed by the message (its direction), not by the kind of the task that produced it.
        direction = F if kind == F else B
        nominal = self.nominal(task) * self.link_factor(src, dst)
        d = nominal
        if self.noise:
            d *= lognormal_factor(self.noise, self.seed, step, s, m, direction, STREAM_COMM_NOISE)
        if self.jitter is not None:
            d += injected_delay(
                self.jitter, self.seed, step, s, m, direction, nominal,
                streams=(STREAM_COMM_HIT, STREAM_COMM_SIZE),
            )
        return d
