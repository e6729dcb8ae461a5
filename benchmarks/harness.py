"""What every benchmarked system shares: injected jitter, meters, statistics, the launcher.

Injected jitter (RRFP §7, the J0-J3 model of :mod:`rrfp.sim.jitter`): :class:`JitterStage`
wraps a stage's ``nn.Module``. Its forward sleeps for the forward's injected delay before
computing. A backward's delay is one draw (kind ``B``), shared as the simulator shares it
between a split backward's ``I`` and ``W`` (:meth:`rrfp.sim.jitter.InjectedJitter.split_backward`,
in proportion to their costs, :attr:`Injector.w_share`):

- ``I``'s share sleeps in :class:`SleepInBackward`, a node on the stage output's path, so it
  lands in whichever task computes that stage's input gradient (``B``, or ``I``);
- ``W``'s share sleeps in :class:`SleepInWeightGrad`, a branch that only leads to a parameter of
  the wrapper (:attr:`JitterStage.carrier`): rrfp's split backward defers it to ``W`` with the
  layers' weight gradients (:func:`rrfp.runtime.engine.split.defer_to_weight`), PyTorch's
  zero-bubble schedules run it in their weight pass (``stage_backward_weight``: the input pass
  computes only what the stage's inputs need), and a full backward runs both shares.

PyTorch's zero-bubble schedules and rrfp both run stage 0's whole backward in ``W``. With
sleep-based tasks (``base``), the backward's sleep is shared the same way. Draws are keyed by
(seed, step, stage, microbatch, kind), and the wrapper learns the microbatch from an int64
microbatch-id tensor that travels through the stages as an extra stage input and output, so
every system sees identical delays whatever order it runs its tasks in. The paper's ``e`` is
the stage's expected compute per task, as in the simulator: the mean of its calibrated (or
slept) forward and backward.

Everything here runs inside one rank process; :func:`benchmarks.launcher.launch` starts those
processes.
"""

from __future__ import annotations


import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from rrfp.runtime.engine.split import defer_to_weight
from rrfp.sim.jitter import JitterLevel, injected_delay



class BenchError(RuntimeError):
    """A benchmark could not produce a valid result (a rank failed, timed out, or a system's
    gradients differ from the others'). ``logs`` holds every rank's output when known."""

    def __init__(self, message: str, logs: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.logs = logs or {}


# --------------------------------------------------------------------------- injected jitter


class Injector:
    """One rank's injected delays.

    Args:
        level: the jitter level (``LEVELS["J2"]``...).
        seed: the run's seed (part of every draw's key).
        stage: the pipeline stage the draws are keyed by: this rank's stage in the
            one-stage-per-rank split (with two virtual stages per rank, both share it).
        e: ``{"F": seconds, "B": seconds}``, this stage's calibrated (or slept) forward and
            backward; the jitter's ``e`` is their mean (:attr:`e_stage`), the stage's expected
            compute per task, as the simulator's (:mod:`rrfp.sim.jitter`).
        base: ``{"F": seconds, "B": seconds}`` (optionally ``"I"`` and ``"W"``, the split
            backward's parts; default half of ``B`` each, the simulator's rule) or None: a fixed
            sleep added to every task (a setting whose compute is simulated by sleeping, so
            many ranks fit on few cores).

    Attributes:
        step: the step id in the draws' key; the harness sets it before each step.
        enabled: when False no delay is injected (warm-up, PyTorch's shape inference).
        total, count: injected seconds and delays so far (reset per step), so the harness can
            check that every system got the same.
        w_share: the fraction of a backward's delay (and sleep) that sleeps on the
            weight-gradient path: ``W / (I + W)`` of ``base``, else 1/2 (the simulator's default
            split of a backward, ``I = W = B / 2``).
    """

    def __init__(self, level: JitterLevel, seed: int, stage: int, e: dict[str, float],
                 base: dict[str, float] | None = None) -> None:
        self.level = level
        self.base = dict(base) if base else None
        self.seed = seed
        self.stage = stage
        self.e = dict(e)
        self.e_stage = 0.5 * (float(e["F"]) + float(e["B"]))
        i, w = (self.base.get("I"), self.base.get("W")) if self.base else (None, None)
        self.w_share = w / (i + w) if i is not None and w is not None and i + w > 0 else 0.5
        self.step = 0
        self.enabled = False
        self.total = 0.0
        self.count = 0

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def delay(self, mb: int, kind: str, share: float = 1.0) -> float:
        """Seconds to inject into ``kind`` (``F`` or ``B``: a whole backward, both shares) of
        microbatch ``mb``, times ``share``."""
        if not self.enabled:
            return 0.0
        d = injected_delay(self.level, self.seed, self.step, self.stage, mb, kind, self.e_stage) * share
        if d > 0:
            self.count += 1
        if self.base:
            d += self.base[kind] * share
        self.total += d
        return d


class SleepInBackward(torch.autograd.Function):
    """Identity in forward (a copy, so the output is not a view); sleeps in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class SleepInWeightGrad(torch.autograd.Function):
    """``carrier -> 0.0`` (a zero scalar a stage adds to its output); its backward, reached only
    on the way to the parameter ``carrier``, sleeps ``seconds`` with the stage's weight
    gradients: in a split backward's ``W`` (rrfp: :func:`~rrfp.runtime.engine.split.defer_to_weight`;
    PyTorch: its weight pass), at once in a full backward."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.carrier, ctx.seconds = carrier, seconds
        return carrier.detach().new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        seconds = ctx.seconds
        defer_to_weight(ctx.carrier, lambda: time.sleep(seconds))
        return torch.zeros_like(ctx.carrier), None


class _Held:
    """A tensor saved for backward, counted by :class:`ActivationMeter` while autograd holds it."""

    __slots__ = ("t", "meter", "ptr")

    def __init__(self, t: torch.Tensor, meter: "ActivationMeter", ptr: int) -> None:
        self.t, self.meter, self.ptr = t, meter, ptr

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class ActivationMeter:
    """Peak bytes of tensors autograd saves for backward on this rank.

    Counted through ``torch.autograd.graph.saved_tensors_hooks`` while :attr:`active`:
    storages are counted once however many saved tensors view them, parameters are excluded
    (those given to :meth:`exclude`, and any ``nn.Parameter`` or view of one),
    and a storage stops counting when autograd drops its last saved reference (the backward
    that used it ran, or the graph was freed). Tensors the runtimes buffer outside autograd
    (received inputs not yet consumed, outputs waiting to be sent) are not counted.
    """

    def __init__(self) -> None:
        self.active = False
        self._skip: set[int] = set()
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def exclude(self, params: Sequence[torch.Tensor]) -> None:
        self._skip.update(p.untyped_storage().data_ptr() for p in params)

    def reset_peak(self) -> None:
        self.peak = self.current

    def hooks(self):
        """Count inside the block. An enclosing pair of saved-tensor hooks (rrfp's own
        measurement for its memory budget) still sees every tensor: autograd applies only the
        innermost pair, so these call the enclosing ones."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        o_pack, o_unpack = outer

        def pack(t: torch.Tensor) -> Any:
            return (self._pack(t), o_pack(t))

        def unpack(h: Any) -> torch.Tensor:
            return o_unpack(h[1])

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def metered(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a loss function) with what autograd saves inside it counted while
        :attr:`active`. Both runtimes compute the loss outside the stage module, after the last
        stage's forward, and hold its saved tensors until that microbatch's backward; rrfp's
        ``memory_budget`` counts them as part of the last stage's forward, so the meter must
        too, or a budget set from a PyTorch schedule's peak would be short on the last rank."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            with self.hooks():
                return fn(*args, **kwargs)

        return call

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        # A parameter, or a view of one, is never an activation: FSDP2's parameters gathered
        # for a step sit in storages allocated anew each step, which exclude() cannot know.
        if ptr in self._skip or st.nbytes() == 0 or isinstance(t, torch.nn.Parameter) or \
                isinstance(t._base, torch.nn.Parameter):
            return t
        ent = self._live.get(ptr)
        if ent is None:
            n = st.nbytes()
            self._live[ptr] = [n, 1]
            self.current += n
            if self.current > self.peak:
                self.peak = self.current
        else:
            ent[1] += 1
        return _Held(t, self, ptr)

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def _release(self, ptr: int) -> None:
        ent = self._live.get(ptr)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] == 0:
            self.current -= ent[0]
            del self._live[ptr]


class JitterStage(nn.Module):
    """A stage module with injected delays and a microbatch id carried alongside.

    ``forward(*x, mb)`` returns ``(inner(*x), mb)``, or ``inner(*x)`` alone on the last stage (the
    loss function's input). ``mb`` is an int64 tensor holding the microbatch index in every
    element (shape ``[samples]`` so that splitting a batch along dim 0 splits it too). With
    ``delays`` (:class:`benchmarks.workloads.MessageDelays`) a float64 send-time stamp travels
    after ``mb`` too: ``forward(*x, mb, stamp)`` -> ``(inner(*x), mb, stamp)`` (the module
    docstring of :mod:`benchmarks.workloads` says how the delays are injected).

    Args:
        inner: the stage's module.
        injector: this rank's :class:`Injector`.
        share: the fraction of the stage's delay this module injects (1, or 1/2 for each of a
            rank's two virtual stages, so the rank's total is the same in every system).
        meter: counts saved activations while active.
        last: this is the pipeline's last stage.
        stage: the stage's index (message delays are keyed by it).
        delays: keyed message delays, or None.
        local_stages: the stages this rank holds in this system: a message between two of them
            never leaves the rank (a V placement's turn), so it gets no delay, as in the
            simulator (:mod:`rrfp.sim.engine`: a same-rank message arrives at once).
        pack: applied to ``x`` before ``inner`` (the multimodal first stage packs its images).
    """

    def __init__(self, inner: nn.Module, injector: Injector, share: float, meter: ActivationMeter, last: bool,
                 stage: int = 0, delays: Any = None, pack: Callable | None = None,
                 local_stages: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.inner = inner
        self.injector = injector
        self.share = share
        self.meter = meter
        self.last = last
        self.stage = stage
        self.delays = delays
        self.pack = pack
        self.local_prev = stage - 1 in local_stages
        self.local_next = stage + 1 in local_stages
        # Only W's share of the injected backward reads it (SleepInWeightGrad); its gradient
        # stays 0 and it is no parameter of the model the systems compare.
        self.carrier = nn.Parameter(torch.zeros(()))

    def forward(self, *inputs: torch.Tensor):
        inj = self.injector
        comm = self.delays
        if comm is not None:
            *x, mb, stamp = inputs
        else:
            *x, mb = inputs
        m = int(mb.reshape(-1)[0]) if inj.enabled else 0
        if comm is not None and self.stage > 0:
            from .workloads import F, ConsumeStamp

            if not self.local_prev:
                comm.wait(stamp, self.stage - 1, m, F)
            x[0] = ConsumeStamp.apply(x[0], stamp)
        if self.pack is not None:
            x = self.pack(*x)
        d = inj.delay(m, "F", self.share)
        if d > 0:
            time.sleep(d)
        if self.meter.active:
            with self.meter.hooks():
                y = self.inner(*x)
        else:
            y = self.inner(*x)
        d = inj.delay(m, "B", self.share)
        if d > 0:
            d_w = d * inj.w_share
            y = SleepInBackward.apply(y, d - d_w)
            if d_w > 0:  # + 0.0 exactly: the values do not change
                y = y + SleepInWeightGrad.apply(self.carrier, d_w)
        if self.last:
            return y
        if comm is not None:
            from .workloads import EmitStamp

            return y, mb, EmitStamp.apply(y, None if self.local_next else comm, m, self.stage)
        return y, mb


class ComputeTimer:
    """Sums the time spent inside wrapped methods (a PyTorch stage's compute calls)."""

    def __init__(self) -> None:
        self.busy = 0.0

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.record(name, t0, time.perf_counter())

        setattr(obj, name, timed)

    def record(self, name: str, t0: float, t1: float) -> None:
        """One call of wrapped method ``name`` from ``t0`` to ``t1`` (``perf_counter`` seconds)."""
        self.busy += t1 - t0


def calibrate(module: nn.Module, example: torch.Tensor | tuple, repeats: int = 15, q: float = 20.0) -> dict[str, float]:
    """Forward and backward seconds of ``module`` on ``example``: the ``q``-th percentile over
    ``repeats`` runs (the base compute that stands in for the jitter model's running average
    ``e``; a low percentile, because other work on the machine only ever adds time)."""
    tf, tb = [], []
    examples = example if isinstance(example, tuple) else (example,)
    for i in range(repeats + 2):
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in examples]
        t0 = time.perf_counter()
        y = module(*xs)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        if i >= 2:
            tf.append(t1 - t0)
            tb.append(t2 - t1)
    module.zero_grad(set_to_none=True)
    return {"F": float(np.percentile(tf, q)), "B": float(np.percentile(tb, q))}


# --------------------------------------------------------------------------- statistics


def summarize(xs: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max."""
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {k: float("nan") for k in ("median", "p25", "p75", "min", "max", "n")}
    p25, med, p75 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "p25": float(p25), "p75": float(p75), "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def round_order(names: Sequence[str], k: int, pairs: Sequence[Sequence[str]] = ()) -> list[str]:
    """The order the systems run in round ``k``.

    Each group of ``pairs`` (a target's rows: e.g. the default hint at 1F1B's memory, PyTorch's
    1F1B, candidate hints at that memory) is laid out side by side, so the rows a target
    compares run back to back, seconds closer than across the whole round (on a shared
    machine the per-round ratio of two systems gets noisier the further apart they run: in a
    jitter4 J2 run at load 6-8, the spread of log per-round ratios was 0.19-0.23 for neighbours
    and 0.26-0.35 for systems 4-11 places apart). The layout rotates so every system takes
    every place, and odd rounds run it backwards, so within a group each system runs first in
    half of the rounds (an order effect cancels instead of favouring one side).
    """
    base: list[str] = []
    for group in pairs:
        base += [n for n in group if n in names and n not in base]
    base += [n for n in names if n not in base]
    # Rounds 2i and 2i + 1: the layout rotated by i, forwards then backwards (so over 2n rounds
    # every system takes each of the n places twice, whatever the parity of n).
    r = (k // 2) % len(base) if base else 0
    out = base[r:] + base[:r]
    return out[::-1] if k % 2 else out


def median_ci(ratios: Sequence[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval of the median of ``ratios`` (per-round paired
    ratios), seeded so a report renders the same every time. It says how far the median of this
    many rounds moves from run to run on the same machine, i.e. whether a verdict near its
    threshold is decided by noise."""
    a = np.asarray(ratios, dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(0)
    meds = np.median(a[rng.integers(0, a.size, size=(resamples, a.size))], axis=1)
    lo, hi = np.percentile(meds, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def paired_speedup(a: Sequence[float], b: Sequence[float]) -> float:
    """Speedup of system A over system B from paired runs: the median over rounds of
    ``t_B / t_A`` (> 1: A is faster)."""
    ra = np.asarray(a, dtype=float)
    rb = np.asarray(b, dtype=float)
    return float(np.median(rb / ra)) if ra.size else float("nan")
