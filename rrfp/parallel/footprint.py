"""The bytes one rank holds for its stages' state, by kind: parameters, gradients, optimizer
states, and what FSDP2 gathers for a step. The one source of these figures (benchmarks, the
step line and metrics read them here).

Counted as the rank holds them: a DTensor (an FSDP2 shard, a DTensor TP shard) by its local
tensor, a replicated tensor whole, a tensor shared by several parameters or states once.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

__all__ = ["Footprint", "footprint", "gathered_bytes"]


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes one rank holds, by kind (between steps: the state that persists).

    Attributes:
        params: parameters (local shards of sharded ones).
        grads: their ``.grad`` tensors.
        optimizer: the optimizer's state tensors (e.g. AdamW's two moments: 8 bytes per fp32
            parameter element; its step counters too).
        gathered_params, gathered_grads: the largest per-stage transient FSDP2 held within the
            last step on top of the above (the gathered parameters and the unsharded gradients
            accumulating until the stage's reduction); 0 without sharded stages.
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    gathered_params: int = 0
    gathered_grads: int = 0

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer states, bytes."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The state plus the step's gathered transient, bytes (an upper bound when a rank
        has several stages: their transients are counted as if held at once)."""
        return self.state + self.gathered_params + self.gathered_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set) -> int:
    # Views into one buffer (a flat gradient bucket) each count; one tensor reached twice
    # (a tied parameter, a state shared by two entries) counts once.
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def footprint(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None,
              sharded=None) -> Footprint:
    """This rank's :class:`Footprint` for ``modules`` (its stages) and ``optimizer``.

    Args:
        modules: the rank's stage modules. Call between steps: within a step an FSDP2 stage's
            ``parameters()`` are its gathered copies.
        optimizer: the optimizer over their parameters (None: no optimizer bytes).
        sharded: the pipeline's :class:`~rrfp.parallel.sharded.ShardedGrads` (``pipe.sharded``),
            for the gathered transient; None: none.

    Returns:
        the bytes by kind (ints).
    """
    params = []
    seen_p: set[int] = set()
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen_p:
                seen_p.add(id(p))
                params.append(p)
    p_bytes = _bytes(params, set())
    g_bytes = _bytes((p.grad for p in params), set())
    o_bytes = 0
    if optimizer is not None:
        o_bytes = _bytes((v for st in optimizer.state.values() for v in st.values()), set())
    gp = gg = 0
    if sharded is not None and sharded.gathered:
        gp = max(v[0] for v in sharded.gathered.values())
        gg = max(v[1] for v in sharded.gathered.values())
    return Footprint(p_bytes, g_bytes, o_bytes, gp, gg)


def gathered_bytes(fsdp_modules: Iterable[nn.Module]) -> tuple[int, int]:
    """``(parameter bytes, gradient bytes)`` FSDP2 holds gathered now for ``fsdp_modules`` (a
    stage's ``fully_shard`` modules, :func:`rrfp.parallel.sharded.fsdp_modules`): the unsharded
    parameters whose storage is allocated, and the unsharded gradients (in the reduce dtype
    where a mixed-precision policy accumulates them apart)."""
    params, grads = [], []
    for m in fsdp_modules:
        for g in m._get_fsdp_state()._fsdp_param_groups:
            for fp in g.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                if up is None or up.untyped_storage().size() == 0:
                    continue
                params.append(up)
                grads.append(fp.unsharded_accumulated_grad)
                grads.append(up.grad)
    return _bytes(params, set()), _bytes(grads, set())
