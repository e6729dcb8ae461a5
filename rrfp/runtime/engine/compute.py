"""The tasks of one rank: F, B, I and W on its stage modules (RRFP, "Execution model"), and
``run_backward``.

:class:`TaskCompute` is what the :class:`~rrfp.runtime.engine.rank.RankRuntime`'s executor runs for a
task: a forward on the stage module (the loss on the last stage), a full backward (B), its
input-gradient half (I) or weight-gradient half (W, from what I left: a
:class:`~rrfp.runtime.engine.split.WeightGradStore`, a ``dw_builder`` runner, or the whole backward
deferred). It takes the step's inputs from the router's receive buffers, asks the router which
stage consumes what a task produces, and keeps what the tasks hand each other within the rank (outputs awaiting their backward, the W state, loss seeds); the
rank runtime sets the step's targets, weights and options and sends what a task returns.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch

from ...scheduler.readyset import ACT, GRAD, KINDS
from ...scheduler.tasks import Task
from ...transport.keys import Direction
from ...errors import PipelineError
from .router import Router
from .split import WeightGradStore, deferring
from .stage import PipelineStage, as_tuple, detach_for_next

__all__ = ["TaskCompute", "run_backward", "LossFn"]

# Read per task: a module global costs a tenth of an enum class's attribute lookup.
_ACT, _GRAD = Direction.ACT, Direction.GRAD

try:  # the C++ engine call that torch.autograd.backward ends in (torch >= 2.4)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older or newer torch without it: the public path
    _engine_run_backward = None


def run_backward(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                 where: tuple[int, int, int] | None = None) -> None:
    """``torch.autograd.backward(outs, grads)`` without its Python argument handling.

    ``torch.autograd.backward`` spends about 45 us per call in Python (``_make_grads``
    re-checks every gradient's shape through symbolic-shape helpers) before the engine runs;
    on small stages that is as much as the backward itself (``benchmarks/micro.py``). Here the
    one check that matters for a pipeline, shapes, is a tuple comparison, and the engine is
    called directly. Tensor subclasses (``__torch_function__``, e.g. DTensor) take the public
    path so that their overrides still apply.

    Args:
        outs: a stage's outputs that require grad (or its scalar loss).
        grads: one gradient per output, the same shape; ``None`` for a scalar loss (ones).
        where: ``(rank, stage, microbatch)``, to name the task in errors.

    Raises:
        PipelineError: a gradient whose shape or dtype differs from its output's.
    """
    outs = tuple(outs)
    plain = _engine_run_backward is not None
    if grads is None:
        grads = tuple(torch.ones_like(o) for o in outs)
    else:
        grads = tuple(grads)
        for o, g in zip(outs, grads):
            if o.shape != g.shape or o.dtype != g.dtype:
                # A correct pipeline sends an output's gradient in that output's shape and
                # dtype; the engine would cast another dtype silently, or fail deep inside.
                r, st, mb = where or ("?", "?", "?")
                what = (f"shape {tuple(g.shape)} for an output of shape {tuple(o.shape)}" if o.shape != g.shape
                        else f"dtype {g.dtype} for an output of dtype {o.dtype}")
                raise PipelineError(f"rank {r} stage {st} microbatch {mb}: gradient of {what}")
            if type(g) is not torch.Tensor:
                plain = False
    for o in outs:
        if type(o) is not torch.Tensor:
            plain = False
    if not plain:
        torch.autograd.backward(outs, grads)
        return
    _engine_run_backward(outs, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


LossFn = Callable[[Any, Any], torch.Tensor]


def _detached(x: Any) -> Any:
    """An output (tensor, or tuple/list/dict of them) without its autograd graph."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


class TaskCompute:
    """F, B, I and W of one rank's stages, and the state they share within a step.

    Args:
        rank: the rank's pipeline index (for errors).
        stages: the rank's :class:`PipelineStage` objects by stage index.
        last_stage: the pipeline's last stage index (its forward computes the loss).
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (last stage; None: no loss).
        router: the rank's :class:`~rrfp.runtime.engine.router.Router`: tasks take their inputs from its
            buffers (a forward's inputs are kept here until its backward) and hand their
            outputs to the stage it names.
        ordered: per stage, a :class:`~rrfp.runtime.engine.ordered._OrderedGrads` (deterministic
            weight-gradient accumulation), or None.
        sizer: a :class:`~rrfp.runtime.engine.memory.ForwardSizer` measuring each forward's
            activation bytes (memory budget), or None.

    Attributes (set by the rank runtime for each step):
        kwargs: per microbatch, keyword inputs of the stage forwards, or None.
        outputs: last stage: filled with ``microbatch -> output`` (detached), or None.
        forward_only: forwards under ``torch.no_grad()`` only.
        targets: last stage: one target per microbatch, or None (no loss).
        weights: last stage: each microbatch's loss weight (the backward's seed gradient).
        mb_losses: last stage: each microbatch's unweighted loss (detached), filled by F.
        whole_backward_in_w: a stage whose inputs need no gradient (the first) runs its whole
            backward in W under a split backward (True, the default), or runs it in I and
            defers only the weight gradients, as every other stage does (False: TP agreement
            sets it, since the whole backward holds the TP layers' collectives and a TP group
            does not agree on W).
    """

    def __init__(self, rank: int, stages: Mapping[int, PipelineStage], last_stage: int, loss_fn: LossFn | None,
                 router: Router, ordered: dict | None = None, sizer=None) -> None:
        self.rank = rank
        self.stages = stages
        self.last_stage = last_stage
        self.loss_fn = loss_fn
        self._take = router.take
        # The router's buffers themselves (Router.buffers): a task empties its slot in its own
        # frame, and take() runs only to raise the router's error for an empty one.
        self._act_in, self._grad_in = router.buffers(Direction.ACT), router.buffers(Direction.GRAD)
        self._next = router.consumers(Direction.ACT)  # by stage: the consumer of its activations
        self._prev = router.consumers(Direction.GRAD)  # by stage: the consumer of its input gradients
        self._inputs: dict[tuple[int, int], tuple] = {}  # a forward's inputs, until its backward
        self._ordered = ordered
        self.sizer = sizer
        self._out: dict[tuple[int, int], tuple] = {}
        self._wstate: dict[tuple[int, int], Any] = {}
        self._seed: dict[int, float] = {}  # last stage: microbatch -> loss weight
        self.kwargs: Sequence[dict] | None = None
        self.outputs: dict[int, Any] | None = None
        self.forward_only = False
        self.targets: Sequence[Any] | None = None
        self.weights: list[float] | None = None
        self.mb_losses: list[torch.Tensor | None] = []
        self.whole_backward_in_w = True

    def begin_step(self, kwargs: Sequence[dict] | None, outputs: dict[int, Any] | None, forward_only: bool) -> None:
        """A new step: its options, and nothing left from the last one."""
        self.kwargs, self.outputs, self.forward_only = kwargs, outputs, forward_only
        self._out.clear(), self._wstate.clear(), self._seed.clear(), self._inputs.clear()

    def end_step(self) -> None:
        """The step's tasks are over (or failed): drop its options."""
        self.kwargs, self.outputs, self.forward_only = None, None, False

    def run(self, task: Task) -> list:
        """Task ``(stage, kind, microbatch)``'s compute (on the executor's thread).

        Returns:
            ``[(destination stage, microbatch, Direction, tensors)]``: what to hand on (an F's
            activations, a B's or I's input gradients; nothing from the first stage's backward,
            the last stage's forward, or a W).

        Raises:
            PipelineError: a ``loss_fn`` that returns no scalar tensor, a gradient count or
                shape that does not match the stage's outputs (``run_backward``).
        """
        s, kind, m = task
        k = KINDS[kind]
        if k.input == ACT:
            return self._forward(s, m)
        if k.input == GRAD:  # B finalises the weight gradients; I leaves them to W
            return self._backward(s, m, split=not k.finalises)
        self._weight(s, m)
        return []

    def _forward(self, s: int, m: int) -> list:
        stage = self.stages[s]
        if self.forward_only:
            # No backward follows: no graph, and the inputs go at once.
            with torch.no_grad():
                out = self._forward_graph(stage, s, m, self._take(s, m, _ACT))
            dst = self._next[s]
            return [] if out is None or dst is None else [(dst, m, _ACT, list(as_tuple(out)))]
        try:
            inputs = self._act_in.pop((s, m))
        except KeyError:
            inputs = self._take(s, m, _ACT)
        self._inputs[(s, m)] = inputs
        if self.sizer is not None:
            with self.sizer.measure(s, m, inputs), torch.enable_grad():
                out = self._forward_graph(stage, s, m, inputs)
        elif torch.is_grad_enabled():  # entering enable_grad() costs more than the check
            out = self._forward_graph(stage, s, m, inputs)
        else:
            with torch.enable_grad():
                out = self._forward_graph(stage, s, m, inputs)
        if out is None:
            return []
        outs = out if type(out) is tuple else (out,) if type(out) is torch.Tensor else as_tuple(out)
        self._out[(s, m)] = outs
        sent = []
        for o in outs:  # a loop, not a comprehension (a call in this Python): once per forward
            sent.append(detach_for_next(o))
        return [(self._next[s], m, _ACT, sent)]

    def _forward_graph(self, stage, s: int, m: int, inputs):
        kw = self.kwargs
        out = stage.submod(*inputs, **kw[m]) if kw is not None and kw[m] else stage.submod(*inputs)
        if s != self.last_stage:
            return out
        if self.outputs is not None:
            self.outputs[m] = _detached(out)
        if self.targets is None:  # forward-only without a target or a loss_fn
            return None
        loss = self.loss_fn(out, self.targets[m])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        self.mb_losses[m] = loss.detach()
        if self.forward_only:
            return None
        # The microbatch's weight enters as the backward's seed gradient, d(w L) = w dL: the
        # same values as backpropagating through ``loss * w``, without that extra node.
        self._out[(s, m)] = (loss,)
        self._seed[m] = self.weights[m]
        return None

    def _grad_pairs(self, s: int, m: int) -> tuple[list, list | None]:
        outs = self._out.pop((s, m))
        if s == self.last_stage:
            return list(outs), [torch.full_like(outs[0], self._seed.pop(m))]
        try:
            grads = self._grad_in.pop((s, m))
        except KeyError:
            grads = self._take(s, m, _GRAD)
        if len(grads) != len(outs):
            raise PipelineError(
                f"rank {self.rank}: stage {s} microbatch {m} got {len(grads)} gradients for {len(outs)} outputs"
            )
        # One loop, not three comprehensions (each a call in this Python): once per backward.
        outs_, grads_ = [], []
        for o, g in zip(outs, grads):
            if g is not None and o.requires_grad:
                outs_.append(o)
                grads_.append(g)
        return outs_, grads_

    def _backward(self, s: int, m: int, split: bool) -> list:
        inputs = self._inputs.pop((s, m))
        outs, grads = self._grad_pairs(s, m)
        dw_builder = self.stages[s].dw_builder
        if dw_builder is not None:
            # PyTorch's meaning (PipelineStage(dw_builder=)): the module's own backward leaves
            # out the weight-gradient part, and the callable dw_builder() returns, built right
            # after that backward, computes it: at W when the backward is split, else at once.
            with self._capture(s, m, final=not split):
                if outs:
                    run_backward(outs, grads, (self.rank, s, m))
                if not split:
                    dw_builder()()
            if split:
                self._wstate[(s, m)] = ("runner", dw_builder())
        elif split and (not self.whole_backward_in_w
                        or any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)):
            # I: input gradients now; the linear layers' weight gradients wait in a store for W.
            store = WeightGradStore()
            with deferring(store, self.stages[s].submod), self._capture(s, m, final=False):
                if outs:
                    run_backward(outs, grads, (self.rank, s, m))
            self._wstate[(s, m)] = ("store", store)
        elif split:
            # No input needs a gradient (stage 0): nothing is on the critical path, so the
            # whole backward moves to W, as PyTorch's zero-bubble schedules do.
            self._wstate[(s, m)] = ("full", outs, grads)
        elif self._ordered is None:
            if outs:
                run_backward(outs, grads, (self.rank, s, m))
        else:
            with self._capture(s, m):
                if outs:
                    run_backward(outs, grads, (self.rank, s, m))
        dst = self._prev[s]
        if dst is None:
            return []
        in_grads = []
        for x in inputs:  # a loop, not a comprehension: once per backward
            in_grads.append(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None)
        return [(dst, m, _GRAD, in_grads)]

    def _weight(self, s: int, m: int) -> None:
        state = self._wstate.pop((s, m))
        with self._capture(s, m):
            if state[0] == "store":
                state[1].flush()
            elif state[0] == "runner":
                state[1]()
            elif state[1]:
                run_backward(state[1], state[2], (self.rank, s, m))

    def _capture(self, s: int, m: int, final: bool = True):
        if self._ordered is None:
            return contextlib.nullcontext()
        return self._ordered[s].capture(m, final)
