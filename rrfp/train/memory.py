"""Memory you can watch: what each rank of ``rrfp train`` holds per step, by kind, and its
process's peak, on the step line, in the summary, the Prometheus gauges and TensorBoard.

Every rank measures, after its optimizer step (:class:`RankMemory`):

* ``params``, ``grads``, ``optimizer``: the bytes its stages' parameters, their gradients and
  the optimizer's states hold, and ``gathered``: what FSDP2 gathered on top of them within the
  step (unsharded parameters and gradients; 0 without ``--dp-shard full``), all from
  :func:`rrfp.parallel.footprint.footprint`, the one source of these figures;
* ``activations``: the most activation bytes held at once in the step, the runtime's own
  measurement (:attr:`~rrfp.runtime.engine.rank.StepStats.peak_bytes`: what each forward
  saved for its backward, :mod:`rrfp.runtime.engine.memory`);
* the process's peak of the step and the headroom left under its limit
  (:mod:`rrfp.obs.memory`: RSS on CPU; CUDA's peak allocated and reserved on a GPU).

The step line shows one number per rank, the process's peak (CUDA: peak reserved, as
torchtitan's step line does; CPU: peak RSS); the summary breaks the last step down by kind.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

__all__ = ["KINDS", "PEAKS", "RankMemory", "mem_problem", "step_text", "summary_text", "publish"]

from ..obs.metrics import MEMORY_KINDS as KINDS, MEMORY_PEAKS as PEAKS  # the gauges' labels: one list

_GIB = float(1 << 30)
_MIB = float(1 << 20)


class RankMemory:
    """One rank's memory figures, step by step.

    Args:
        modules: the rank's stage modules.
        optimizer: the optimizer over their parameters.
        pipe: the rank's :class:`~rrfp.runtime.doors.pipeline.Pipeline`: its runtimes are told
            to measure activations (:meth:`~rrfp.runtime.engine.rank.RankRuntime.measure_activations`),
            its ``sharded`` driver gives FSDP2's gathered bytes.
        device: the rank's compute device (CUDA adds the allocator's peaks).
    """

    def __init__(self, modules: Sequence[Any], optimizer, pipe, device=None) -> None:
        from ..obs.memory import PeakMeter

        self.modules, self.optimizer, self.pipe = list(modules), optimizer, pipe
        for rt in pipe.runtimes:
            rt.measure_activations()
        self.meter = PeakMeter(device)

    def begin_step(self) -> None:
        """A step starts: the process's peaks start again from now."""
        self.meter.reset()

    def fields(self, stats) -> dict[str, int | None]:
        """The step's figures in bytes (call after the optimizer step): :data:`KINDS`,
        :data:`PEAKS` (None where not measured: CUDA's off CUDA), ``limit`` and ``headroom``
        (:class:`~rrfp.obs.memory.ProcessPeak`; None where no limit can be read).

        Args:
            stats: the step's :class:`~rrfp.runtime.engine.rank.StepStats` (``peak_bytes``).
        """
        from ..parallel.footprint import footprint

        fp = footprint(self.modules, self.optimizer, getattr(self.pipe, "sharded", None))
        peak = self.meter.read()
        return {"params": fp.params, "grads": fp.grads, "optimizer": fp.optimizer,
                "activations": int(stats.peak_bytes), "gathered": fp.gathered_params + fp.gathered_grads,
                "rss": peak.rss, "cuda_allocated": peak.cuda_allocated, "cuda_reserved": peak.cuda_reserved,
                "limit": peak.limit, "headroom": peak.headroom}

    def sources(self) -> str:
        """How the peak and the limit are read here, for the summary."""
        peak = self.meter.read()
        where = f"CUDA peak reserved; RSS {peak.rss_source}" if self.meter.cuda else f"RSS {peak.rss_source}"
        return f"{where}; headroom under the {peak.limit_source or 'unknown'} limit"


def mem_problem(mem: Any) -> str | None:
    """Why a peer's memory figures are refused (a dict of every key of
    :meth:`RankMemory.fields`, each an int, non-negative but ``headroom``; None allowed for
    the peaks, the limit and the headroom), or None."""
    if not isinstance(mem, dict):
        return f"mem={mem!r} is not a dict"
    for k in (*KINDS, *PEAKS, "limit", "headroom"):
        v = mem.get(k)
        if v is None and k not in KINDS:
            continue
        if type(v) is not int or (v < 0 and k != "headroom"):
            return f"mem.{k}={v!r} is not a{' non-negative' if k != 'headroom' else 'n'} integer byte count"
    return None


def process_peak(mem: Mapping[str, Any]) -> int:
    """The number the step line shows for a rank: CUDA's peak reserved, else peak RSS."""
    return mem["cuda_reserved"] if mem.get("cuda_reserved") is not None else (mem.get("rss") or 0)


def step_text(mems: Sequence[Mapping[str, Any] | None]) -> str:
    """The step line's field, ``mem/rank [0.41 0.40] GiB`` (each rank's process peak), or ""
    when no rank sent figures."""
    if not any(mems):
        return ""
    return "mem/rank [" + " ".join("-" if m is None else f"{process_peak(m) / _GIB:.2f}" for m in mems) + "] GiB"


def _row(mems: Sequence[Mapping[str, Any] | None], key: str, unit: float, digits: int) -> str:
    return "[" + " ".join("-" if m is None or m.get(key) is None else f"{m[key] / unit:.{digits}f}" for m in mems) + "]"


def summary_text(mems: Sequence[Mapping[str, Any] | None], sources: str = "") -> str:
    """The summary's breakdown of the last step, per rank: bytes by kind (MiB), the process's
    peaks and the headroom (GiB)."""
    parts = [f"{k} {_row(mems, k, _MIB, 2)}" for k in KINDS]
    peaks = [f"{k} {_row(mems, k, _GIB, 2)}" for k in PEAKS if any(m and m.get(k) is not None for m in mems)]
    peaks.append(f"headroom {_row(mems, 'headroom', _GIB, 2)}")
    how = f" ({sources})" if sources else ""
    return f"memory/rank at the last step, MiB: {'  '.join(parts)}; peak GiB: {'  '.join(peaks)}{how}"


def publish(writer, mems: Sequence[Mapping[str, Any] | None], step: int) -> None:
    """One step's figures to TensorBoard, in bytes: ``rank/R/memory/KIND`` for :data:`KINDS`,
    :data:`PEAKS` (those measured) and ``headroom``."""
    for r, m in enumerate(mems):
        if m is None:
            continue
        for k in (*KINDS, *PEAKS, "headroom"):
            v = m.get(k)
            if v is not None and math.isfinite(v):
                writer.add_scalar(f"rank/{r}/memory/{k}", v, step)
