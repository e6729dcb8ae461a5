"""Split backward: I computes input gradients now, W computes the deferred weight gradients
later (RRFP §4 "BFW"; the zero-bubble papers' B/W split).

The runtime does not walk the autograd graph in Python (torch.distributed.pipelining's
``stage_backward_input`` does, which cost 40-50% on top of a full backward for a one-layer
stage here). Instead, every affine layer of a stage that declares its layout runs through
:class:`_DeferredAffine`. During I, its backward returns only ``dX``. It records ``(X, dY)``
in the active :class:`WeightGradStore`, and W later computes ``dW`` and ``db = sum(dY)``.
This is the way Megatron's zero-bubble implementation defers weight gradients. Parameters
outside such layers (norms, embeddings) get their gradients during I, as in a full backward.
They are a small share of the FLOPs.

Which layers split is a small registry (:func:`register_split_layer`): ``nn.Linear``
(``y = x W^T + b``, weight ``[out, in]``) and HuggingFace's ``Conv1D``
(``transformers.pytorch_utils.Conv1D``: ``y = x W + b``, weight ``[in, out]``, recognised by
name so that transformers need not be installed) are registered, and so are the tensor-parallel
layers of :mod:`rrfp.model.tp`, whose ``affine`` method is the local matmul inside the
forward's collectives: their weight gradients go to W too, while the collectives stay in I (a
TP group agrees on I but not on W, so W must issue none). A layer class may also declare
``rrfp_split_layout = SplitLayout(...)``. :func:`disable_split_backward` restores the user's
modules exactly (the pipeline calls it on ``close()``, and
:meth:`RankRuntime.set_hint <rrfp.runtime.engine.rank.RankRuntime.set_hint>` on a switch to a full backward).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

_active: "WeightGradStore | None" = None


@dataclass(frozen=True)
class SplitLayout:
    """How an affine layer computes ``y`` from ``x`` (the last dim is the feature dim).

    Attributes:
        weight: attribute name of the weight parameter.
        bias: attribute name of the bias parameter (its value may be None); None: the affine
            map adds no bias (a row-parallel layer adds its bias after the all-reduce).
        weight_in_out: True for a ``[in, out]`` weight (``y = x W + b``, HF ``Conv1D``);
            False for ``[out, in]`` (``y = x W^T + b``, ``nn.Linear``).
        method: the module's method that computes ``x -> y`` and that the split replaces:
            ``forward``, or the affine part a forward wraps in other work (collectives).
    """

    weight: str = "weight"
    bias: str | None = "bias"
    weight_in_out: bool = False
    method: str = "forward"


LINEAR = SplitLayout()
CONV1D = SplitLayout(weight_in_out=True)

_BY_TYPE: dict[type, SplitLayout] = {nn.Linear: LINEAR}
# Classes we recognise by their qualified name, so their library need not be imported.
_BY_NAME: dict[str, SplitLayout] = {
    "transformers.pytorch_utils.Conv1D": CONV1D,
    "rrfp.model.tp.ColumnParallelLinear": SplitLayout(method="affine"),
    "rrfp.model.tp.RowParallelLinear": SplitLayout(bias=None, method="affine"),
}


def register_split_layer(cls: type | str, layout: SplitLayout) -> None:
    """Declare that layers of exactly ``cls`` (a class, or its ``module.QualName``) are
    affine with ``layout``, so a split-backward hint defers their weight gradients to W.

    Raises:
        TypeError: ``layout`` is not a :class:`SplitLayout`.
    """
    if not isinstance(layout, SplitLayout):
        raise TypeError(f"layout {layout!r}: expected a SplitLayout")
    if isinstance(cls, str):
        _BY_NAME[cls] = layout
    else:
        _BY_TYPE[cls] = layout


def layout_of(module: nn.Module) -> SplitLayout | None:
    """The split layout of ``module``'s exact class, or None if it does not split."""
    cls = type(module)
    own = cls.__dict__.get("rrfp_split_layout")
    if isinstance(own, SplitLayout):
        return own
    return _BY_TYPE.get(cls) or _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")


class WeightGradStore:
    """The weight-gradient work of one (stage, microbatch) left for W.

    Each entry is ``(weight, bias, X[..., in], dY[..., out], weight_in_out)``; :meth:`flush`
    accumulates ``dW`` (``[out, in]``, or ``[in, out]`` for a Conv1D layout) into
    ``weight.grad`` and ``db [out]`` into ``bias.grad``.
    """

    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.calls: list[Callable[[], None]] = []  # other weight-gradient work (defer_to_weight)

    def __len__(self) -> int:
        return len(self.items) + len(self.calls)

    def nbytes(self) -> int:
        """Bytes the store keeps alive for W: the storages of every deferred ``X`` and
        ``dY``, each storage counted once (several layers may share one), in bytes."""
        seen: set[int] = set()
        total = 0
        for _, _, x, dy, _ in self.items:
            for t in (x, dy):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += st.nbytes()
        return total

    def flush(self) -> None:
        """Compute and accumulate every deferred weight gradient, run every deferred call
        (:func:`defer_to_weight`, in the order deferred), then forget them.

        Runs with autograd off, as the backward it finishes did: a deferred ``X`` past a stage's
        first layer requires grad, and ``dY^T X`` computed with grad mode on would leave
        ``weight.grad`` with a history that holds ``dY`` (and that microbatch's graph) until
        the gradients are zeroed."""
        with torch.no_grad():
            for weight, bias, x, dy, in_out in self.items:
                dw, db = _weight_grads(x, dy, bias is not None, in_out)
                _accumulate(weight, dw)
                if bias is not None:
                    _accumulate(bias, db)
            self.items.clear()
            calls, self.calls = self.calls, []
            for fn in calls:
                fn()


def defer_to_weight(param: torch.Tensor, fn: Callable[[], None]) -> bool:
    """From inside an autograd backward: run ``fn()`` with the weight gradients of ``param``'s
    module, in the split backward's ``W`` when one is deferring them (``fn`` then runs after the
    layers' deferred weight gradients), else at once (a full backward ``B``, or the first
    stage's whole backward, which runs in ``W``).

    For weight-gradient work that is not an affine layer's: a custom autograd Function whose
    backward computes a parameter's gradient by other means (the benchmark harness sleeps
    ``W``'s share of a backward's injected delay here, ``benchmarks/harness.py``).

    Returns:
        True when ``fn`` was deferred to ``W``, False when it ran now.
    """
    store = getattr(param, "_rrfp_defer", None)
    if store is None:
        store = _active
    if store is None:
        fn()
        return False
    store.calls.append(fn)
    return True


@contextlib.contextmanager
def deferring(store: WeightGradStore, module: nn.Module | None = None) -> Iterator[None]:
    """While active, split layers defer their weight gradients to ``store``.

    With ``module``, only that module's layers defer (the store is pinned on its parameters):
    several ranks of one process (``LocalPipeline`` with the thread executor) run backwards at
    once, and the autograd engine may call a layer's backward on another thread than the
    caller's (CUDA), so neither a process-wide nor a thread-local switch would name the right
    store. Without it, every split layer in the process defers (one caller at a time).
    """
    global _active
    if module is None:
        prev, _active = _active, store
        try:
            yield
        finally:
            _active = prev
        return
    params = list(module.parameters())
    for p in params:
        p._rrfp_defer = store
    try:
        yield
    finally:
        for p in params:
            p._rrfp_defer = None


def _weight_grads(x: torch.Tensor, dy: torch.Tensor, has_bias: bool, in_out: bool = False):
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dw = x2.t().matmul(dy2) if in_out else dy2.t().matmul(x2)
    return dw, (dy2.sum(0) if has_bias else None)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if g.dtype != p.dtype:  # computed in autocast's dtype (bf16); parameters keep theirs
        g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _DeferredAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, in_out):
        ctx.save_for_backward(x, weight)
        # Parameters are not modified before W runs (the optimizer steps after every W), so
        # plain references are safe where saved tensors would not let us reach the Parameter.
        ctx.params = (weight, bias, in_out)
        # The op the layers' own forwards run (nn.Linear, the TP layers' affine; for Conv1D's
        # addmm(b, x, W), F.linear(x, W^T, b) is that same addmm): one fused op, and a split
        # run's forward computes the bits of a full-backward run's.
        return F.linear(x, weight.t() if in_out else weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        w_param, b_param, in_out = ctx.params
        # Under autocast the forward's matmul ran in autocast's dtype (dy's) but saved the
        # uncast operands, and backward runs outside autocast: compute in dy's dtype, as
        # autograd's own matmul backward would (autograd casts dx back to x's dtype).
        if weight.dtype != dy.dtype:
            weight = weight.to(dy.dtype)
        if x.dtype != dy.dtype:
            x = x.to(dy.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight.t()) if in_out else dy.matmul(weight)
        if not (ctx.needs_input_grad[1] or (b_param is not None and ctx.needs_input_grad[2])):
            return dx, None, None, None
        store = getattr(w_param, "_rrfp_defer", None)
        if store is None:
            store = _active
        if store is not None:
            store.items.append((w_param, b_param, x, dy, in_out))
            return dx, None, None, None
        dw, db = _weight_grads(x, dy, b_param is not None, in_out)
        return dx, dw, db, None


def _c_apply(fn: type) -> Callable | None:
    """``fn.apply`` without ``Function.apply``'s Python wrapper (torch/autograd/function.py),
    or None where this torch has no ``_FunctionBase.apply`` to bind.

    The wrapper binds default arguments for a Function with ``setup_context`` (not ours),
    unwraps functorch wrappers left over from a finished transform (a tensor that escaped
    ``torch.func``: no stage input or parameter is one) and, while a transform is active,
    takes functorch's path (the caller checks that and uses the wrapper then). It costs ~2 us
    of the ~10 us a small layer's forward takes (``benchmarks/bench_split_backward.py``)."""
    base = getattr(torch._C, "_FunctionBase", None)
    apply = getattr(base, "__dict__", {}).get("apply")
    if getattr(torch._C, "_are_functorch_transforms_active", None) is None:
        return None
    try:
        return apply.__get__(None, fn)
    except (AttributeError, TypeError):
        return None


_apply_fast = _c_apply(_DeferredAffine)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def _deferred_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    lay = self._rrfp_split
    bias = None if lay.bias is None else getattr(self, lay.bias, None)
    if _apply_fast is None or _functorch_active():  # vmap, grad...: the public path
        return _DeferredAffine.apply(x, getattr(self, lay.weight), bias, lay.weight_in_out)
    return _apply_fast(x, getattr(self, lay.weight), bias, lay.weight_in_out)



def enable_split_backward(module: nn.Module) -> int:
    """Route every layer in ``module`` with a split layout (:func:`layout_of`) through the
    deferring affine function (its layout's ``method``).

    Outside :func:`deferring` the layers compute their weight gradients at once, so a full
    backward still works. A layer whose ``method`` the user set on the instance is left as it
    is (routing would compute the class's affine instead). Idempotent;
    :func:`disable_split_backward` undoes it.

    Returns:
        the number of layers routed.
    """
    n = 0
    for m in module.modules():
        lay = layout_of(m)
        if lay is None:
            continue
        if "_rrfp_split" not in m.__dict__:
            if lay.method in m.__dict__:
                # The user's own instance-level forward is what the model computes: routing
                # would replace it with the class's affine. Its weight gradients come in I.
                continue
            m._rrfp_split = lay
            setattr(m, lay.method, types.MethodType(_deferred_forward, m))
        n += 1
    return n


def disable_split_backward(module: nn.Module) -> int:
    """Undo :func:`enable_split_backward`: every routed layer gets back its own method (a
    forward the user set on it while it was routed stays).

    Returns:
        the number of layers restored.
    """
    n = 0
    for m in module.modules():
        lay = m.__dict__.pop("_rrfp_split", None)
        if lay is None:
            continue
        own = m.__dict__.get(lay.method)
        # A forward the user set while the layer was routed stays: only the routing goes.
        if getattr(own, "__func__", None) is _deferred_forward:
            del m.__dict__[lay.method]
        n += 1
    return n
