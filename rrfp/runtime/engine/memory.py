"""Activation bytes in the runtime: what each forward leaves saved for its backward, measured,
and the estimate the arbiter's memory budget admits by (RRFP, "Backpressure and the memory bound").

:class:`ForwardSizer` is the ``act_bytes(stage, mb)`` function of
:class:`~rrfp.scheduler.arbiter.Arbiter`: after ``F(stage, mb)`` ran, the bytes it measured;
before, an estimate scaled from the stage's last measured forward by the number of elements
of the microbatch's input on the rank's first virtual stage (so longer sequences or more
images count more); None until the stage was measured once (the arbiter then admits that
microbatch only when nothing is in flight, so the budget holds from the first step on).

Measured: the storages autograd saves for backward during the forward
(``torch.autograd.graph.saved_tensors_hooks``), each counted once however many saved tensors
view it, parameters excluded (the benchmarks' ActivationMeter counts the same way).

Counting runs a Python hook on every saved tensor, in the forward and again in the backward:
on stages of about a millisecond that made a budgeted step 18% slower than the same step under
the in-flight count (``BENCHMARKS.md``). Saved bytes follow the shapes and dtypes of a stage's
inputs, so a forward whose inputs have shapes already measured on that stage takes the measured
bytes without hooks; every :data:`REMEASURE_EVERY`-th forward of a stage is measured anyway, so a
stage whose saved bytes depend on values (token routing) is corrected within that many forwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch.nn import Parameter


class WeightBytes:
    """``w_bytes(stage, mb)`` of :class:`~rrfp.scheduler.arbiter.Arbiter`: after a split
    backward's ``I``, the bytes its deferred weight-gradient store holds for ``W``
    (:meth:`rrfp.runtime.engine.split.WeightGradStore.nbytes`), measured; None (everything stays held
    until ``W``, the ledger's conservative rule) when ``W`` has no store: a ``dw_builder``
    runner, or a stage whose whole backward moved to ``W``.

    Args:
        states: the compute's ``(stage, mb) -> W state`` map (``("store", store)``,
            ``("runner", fn)`` or ``("full", ...)``), read when the arbiter asks.
    """

    __slots__ = ("states",)

    def __init__(self, states: Mapping[tuple[int, int], Any]) -> None:
        self.states = states

    def __call__(self, stage: int, mb: int) -> int | None:
        state = self.states.get((stage, mb))
        if state is None or state[0] != "store":
            return None
        return state[1].nbytes()


REMEASURE_EVERY = 64
"""A stage's forwards with already-measured input shapes are measured again once in this many."""


def _shapes(inputs: Any) -> tuple:
    return tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs)


def numel(inputs: Any) -> int:
    """Elements of the tensors among ``inputs`` (an iterable; anything else in it counts 0)."""
    return sum(t.numel() for t in inputs if isinstance(t, torch.Tensor))


class SavedBytes:
    """Counts the bytes of the storages autograd saves for backward, each storage once and
    parameters excluded (``params``: their storages' ``data_ptr()``; and any ``nn.Parameter``
    or view of one, which is how an FSDP2 stage's parameters gathered for the step appear,
    in storages allocated anew each step): what a forward leaves held until its backward. Install ``pack`` with ``torch.autograd.graph.saved_tensors_hooks``
    (and ``unpack``); ``total`` is in bytes. The one measuring rule for the runtime's
    memory budget and the benchmarks' budgets."""

    __slots__ = ("params", "seen", "total")

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.seen and not (
                isinstance(t, Parameter) or isinstance(t._base, Parameter)):
            self.seen.add(ptr)
            self.total += st.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


class ForwardSizer:
    """Measures and estimates one rank's activation bytes per ``(stage, microbatch)``.

    Args:
        modules: stage index -> the stage's module (its parameters are not activations).
        first_stage: the rank's first virtual stage.
    """

    def __init__(self, modules: Mapping[int, torch.nn.Module], first_stage: int) -> None:
        self._params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()  # a DTensor: its local shard
                        for m in modules.values() for p in m.parameters()}
        self.first_stage = first_stage
        self._per_elem: dict[int, float] = {}  # stage -> bytes per element of the first stage's input
        self._inputs: dict[int, int] = {}  # mb -> elements of its first-virtual-stage input
        self._measured: dict[tuple[int, int], int] = {}
        self._by_shape: dict[tuple, int] = {}  # (stage, input shapes) -> bytes last measured
        self._count: dict[int, int] = {}  # stage -> forwards seen (for the periodic re-measure)
        self.act: Mapping[tuple[int, int], Any] | None = None  # the inbox's buffered inputs

    def begin_step(self, act: Mapping[tuple[int, int], Any]) -> None:
        """A new step: forget the last step's microbatches (the per-stage rates stay)."""
        self.act = act
        self._inputs.clear()
        self._measured.clear()

    def __call__(self, stage: int, mb: int) -> int | None:
        got = self._measured.get((stage, mb))
        if got is not None:
            return got
        rate = self._per_elem.get(stage)
        if rate is None:
            return None
        n = self._inputs.get(mb)
        if n is None:
            x = self.act.get((self.first_stage, mb)) if self.act is not None else None
            if x is None:
                return None
            n = numel(x)
        return int(rate * n)

    @contextlib.contextmanager
    def measure(self, stage: int, mb: int, inputs: Any) -> Iterator[None]:
        """Count what autograd saves inside the block as ``F(stage, mb)``'s bytes."""
        if stage == self.first_stage:
            self._inputs[mb] = numel(inputs)
        key = (stage, _shapes(inputs))
        k = self._count[stage] = self._count.get(stage, 0) + 1
        known = self._by_shape.get(key)
        if known is not None and k % REMEASURE_EVERY:
            yield
            self._measured[(stage, mb)] = known
            return
        counter = SavedBytes(self._params)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            yield
        total = counter.total
        self._measured[(stage, mb)] = self._by_shape[key] = total
        n = self._inputs.get(mb)
        if n:
            self._per_elem[stage] = total / n
