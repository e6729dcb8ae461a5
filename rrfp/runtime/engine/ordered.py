"""Deterministic weight-gradient accumulation (``--deterministic``): microbatch order, whatever
order the backwards ran in."""

from __future__ import annotations

import torch

from ...errors import PipelineError


class _OrderedGrads:
    """Deterministic weight-gradient accumulation for one stage (``--deterministic``).

    Each microbatch's weight gradients are computed into fresh ``.grad`` tensors and added to
    the accumulated gradient in microbatch order ``0..M-1``; a contribution that finishes early
    is held until every lower microbatch has been added. Floating-point addition is not
    associative, so this fixes the summation order and makes the result independent of
    execution order. Cost: one extra gradient buffer per microbatch finished ahead of its turn
    (at most ``M - 1`` per stage, typically the in-flight count), and one extra add per
    parameter per microbatch.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.params = self.current()
        self.held: dict[int, list] = {}
        self.partial: dict[int, list] = {}
        self.next_mb = 0
        self.held_bytes = 0
        self.peak_held_bytes = 0  # extra gradient memory this mode has needed at once

    def current(self) -> list:
        # Read at every capture: an FSDP2 stage computes with its gathered parameters, other
        # objects than those it holds between steps (rrfp.parallel.sharded).
        return [p for p in self.module.parameters() if p.requires_grad]

    def capture(self, mb: int, final: bool = True):
        return _Capture(self, mb, final)

    def _add(self, contrib: list) -> None:
        for p, g in zip(self.params, contrib):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def put(self, mb: int, contrib: list, final: bool = True) -> None:
        first = self.partial.pop(mb, None)
        if first is not None:  # I's part (norms, embeddings) then W's part, in that order
            contrib = [b if a is None else (a if b is None else a + b) for a, b in zip(first, contrib)]
        if not final:
            self.partial[mb] = contrib
            self._count(contrib, +1)
            return
        if first is not None:
            self._count(first, -1)
        self.held[mb] = contrib
        self._count(contrib, +1)
        while self.next_mb in self.held:
            done = self.held.pop(self.next_mb)
            self._add(done)
            self._count(done, -1)
            self.next_mb += 1

    def _count(self, contrib: list, sign: int) -> None:
        self.held_bytes += sign * sum(g.numel() * g.element_size() for g in contrib if g is not None)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def finish(self, n_microbatches: int) -> None:
        """End of step: every microbatch's contribution must have been added."""
        if self.next_mb != n_microbatches or self.held or self.partial:
            raise PipelineError(
                f"deterministic accumulation saw microbatches 0..{self.next_mb - 1} of {n_microbatches}, "
                f"holding {sorted(self.held)}"
            )
        self.next_mb = 0


class _Capture:
    def __init__(self, acc: _OrderedGrads, mb: int, final: bool) -> None:
        self.acc, self.mb, self.final = acc, mb, final

    def __enter__(self) -> None:
        self.acc.params = self.acc.current()
        self.saved = [p.grad for p in self.acc.params]
        for p in self.acc.params:
            p.grad = None

    def __exit__(self, *exc) -> None:
        contrib = [p.grad for p in self.acc.params]
        for p, g in zip(self.acc.params, self.saved):
            p.grad = g
        if exc[0] is None:
            self.acc.put(self.mb, contrib, self.final)
