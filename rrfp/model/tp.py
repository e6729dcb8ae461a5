"""Tensor parallelism for the GPT's attention and MLP (Megatron style: column-, then
row-parallel), in two implementations chosen by measurement (``benchmarks/bench_tp.py``):

- ``impl="manual"``: :class:`ColumnParallelLinear` / :class:`RowParallelLinear`, two autograd
  functions around ``torch.distributed.all_reduce`` (Megatron's ``f`` and ``g``);
- ``impl="dtensor"``: torch's ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on a ``DeviceMesh``.

Both shard the same way, so a TP rank holds the same slice of every weight either way
(:func:`tp_slice`): attention heads ``[t*H/tp, (t+1)*H/tp)`` of q, k and v (the fused ``qkv``
rows are regrouped so that rank ``t``'s rows are contiguous) and the matching input columns of
``attn.proj``; MLP hidden units ``[t*F/tp, (t+1)*F/tp)`` of ``mlp.fc`` rows and ``mlp.proj``
columns. Row-parallel biases, LayerNorms, embeddings and the head stay replicated: every TP
rank holds them whole and computes the same gradient for them.

A TP-sharded parameter carries ``param._rrfp_tp_shard = True`` (global-norm clipping sums
those over TP, and counts the replicated ones once).

Under a split backward the collectives run in F and I, on which the TP group agrees (RRFP §4.2),
and never in W, on which it does not: the manual layers' weight gradients (their ``affine``
part) are deferred to W as local matmuls, and the first stage keeps its backward in I
(``rrfp.runtime.features.agreement``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .gpt import GPTStage

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPAttention", "TPMLP", "shard_gpt_stage", "tp_slice",
           "TP_IMPLS"]

TP_IMPLS = ("manual", "dtensor")


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ColumnParallelLinear(nn.Module):
    """``y_t = x @ W_t^T + b_t``: this TP rank's ``out_local`` output features.

    Shapes: ``[..., in_features] -> [..., out_local]``. The input gradient is all-reduced over
    ``group`` in backward (every rank's slice contributes to it).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.weight._rrfp_tp_shard = True
        if self.bias is not None:
            self.bias._rrfp_tp_shard = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.affine(_CopyToTP.apply(x, self.group))

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        """The local matmul ``[..., in_features] -> [..., out_local]``, without the collective:
        what a split backward replaces so that its weight gradient waits for W while the
        all-reduce stays in I (``rrfp.runtime.engine.split``)."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_t x_t @ W_t^T + b``: input features sharded over TP, output all-reduced.

    Shapes: ``[..., in_local] -> [..., out_features]`` (replicated). The bias is whole on
    every rank and added once, after the reduction.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.weight._rrfp_tp_shard = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(self.affine(x), self.group)
        return y if self.bias is None else y + self.bias

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``[..., in_local] -> [..., out_features]``, without the bias
        or the collective (see :meth:`ColumnParallelLinear.affine`)."""
        return F.linear(x, self.weight)


def _head_rows(d_model: int, n_head: int, tp_rank: int, tp: int) -> torch.Tensor:
    """Rows of the fused ``qkv`` weight ``[3D, D]`` that rank ``tp_rank`` holds: its heads of
    q, then of k, then of v."""
    width = d_model // tp
    lo = tp_rank * width
    return torch.cat([torch.arange(part * d_model + lo, part * d_model + lo + width) for part in range(3)])


def tp_slice(name: str, full: torch.Tensor, tp_rank: int, tp: int, d_model: int, n_head: int) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of the full-model parameter ``name`` (a :class:`GPTStage` or
    :class:`~rrfp.model.gpt.GPT` name such as ``blocks.0.attn.qkv.weight``); the whole tensor
    for a replicated parameter. Used to shard and, in tests, to compare with a reference."""
    parts = name.split(".")
    if "attn" in parts and parts[-2] == "qkv":
        return full[_head_rows(d_model, n_head, tp_rank, tp)]
    if "attn" in parts and parts[-2] == "proj" and parts[-1] == "weight":
        w = d_model // tp
        return full[:, tp_rank * w:(tp_rank + 1) * w]
    if "mlp" in parts and parts[-2] == "fc":
        w = full.shape[0] // tp
        return full[tp_rank * w:(tp_rank + 1) * w]
    if "mlp" in parts and parts[-2] == "proj" and parts[-1] == "weight":
        w = full.shape[1] // tp
        return full[:, tp_rank * w:(tp_rank + 1) * w]
    return full


class TPAttention(nn.Module):
    """Causal self-attention over this TP rank's ``n_head / tp`` heads: ``[B, T, D] -> [B, T, D]``
    (replicated in and out). ``qkv`` is column-parallel, ``proj`` row-parallel."""

    def __init__(self, attn: nn.Module, tp_rank: int, tp: int, group, impl: str, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head // tp
        self.head_dim = d_model // n_head
        self.dropout = attn.dropout
        self.resid_drop = attn.resid_drop
        rows = _head_rows(d_model, n_head, tp_rank, tp)
        w = d_model // tp
        cols = slice(tp_rank * w, (tp_rank + 1) * w)
        if impl == "manual":
            self.qkv = ColumnParallelLinear(attn.qkv.weight[rows], attn.qkv.bias[rows], group)
            self.proj = RowParallelLinear(attn.proj.weight[:, cols], attn.proj.bias, group)
        else:
            # Full-size layers with the qkv rows regrouped rank-major, so that torch's even
            # Shard(0) gives each rank its own heads; parallelize_module shards them.
            order = torch.cat([_head_rows(d_model, n_head, t, tp) for t in range(tp)])
            self.qkv = _linear_like(attn.qkv.weight[order], attn.qkv.bias[order])
            self.proj = _linear_like(attn.proj.weight, attn.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        local = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(local, dim=-1)
        shape = (b, t, self.n_head, self.head_dim)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, local)))


class TPMLP(nn.Module):
    """GELU MLP over this TP rank's ``d_ff / tp`` hidden units: ``[B, T, D] -> [B, T, D]``."""

    def __init__(self, mlp: nn.Module, tp_rank: int, tp: int, group, impl: str) -> None:
        super().__init__()
        self.drop = mlp.drop
        ff = mlp.fc.weight.shape[0]
        w = ff // tp
        rows = slice(tp_rank * w, (tp_rank + 1) * w)
        if impl == "manual":
            self.fc = ColumnParallelLinear(mlp.fc.weight[rows], mlp.fc.bias[rows], group)
            self.proj = RowParallelLinear(mlp.proj.weight[:, rows], mlp.proj.bias, group)
        else:
            self.fc = _linear_like(mlp.fc.weight, mlp.fc.bias)
            self.proj = _linear_like(mlp.proj.weight, mlp.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


def _linear_like(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def shard_gpt_stage(stage: GPTStage, tp_rank: int, tp: int, group=None, impl: str = "manual", mesh=None) -> GPTStage:
    """Shard a :class:`GPTStage`'s attention and MLP over ``tp`` ranks, in place.

    Args:
        stage: a stage built with the full weights (``build_stage``), sliced here.
        tp_rank, tp: this rank's TP coordinate and the TP degree.
        group: the TP process group (``impl="manual"``).
        impl: ``manual`` or ``dtensor`` (module docstring).
        mesh: the 1-d TP ``DeviceMesh`` (``impl="dtensor"``).

    Returns:
        ``stage``, whose ``stage_param_names`` still map to the full model's names (the
        sharded parameters hold :func:`tp_slice` of those).

    Raises:
        ValueError: ``tp`` not dividing the heads or the MLP width, or an unknown ``impl``.
    """
    cfg = stage.cfg
    if impl not in TP_IMPLS:
        raise ValueError(f"TP implementation {impl!r}: expected one of {', '.join(TP_IMPLS)}")
    if cfg.n_head % tp or cfg.ff_width % tp:
        raise ValueError(f"tp {tp} must divide the model's {cfg.n_head} heads and MLP width {cfg.ff_width}")
    if tp == 1:
        return stage
    for block in stage.blocks:
        block.attn = TPAttention(block.attn, tp_rank, tp, group, impl, cfg.d_model, cfg.n_head)
        block.mlp = TPMLP(block.mlp, tp_rank, tp, group, impl)
        if impl == "dtensor":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                             "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
            for mod in (block.attn.qkv, block.mlp.fc):
                for p in mod.parameters():
                    p._rrfp_tp_shard = True
            block.attn.proj.weight._rrfp_tp_shard = True
            block.mlp.proj.weight._rrfp_tp_shard = True
    return stage


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a plain local tensor (a DTensor's local shard)."""
    g = p.grad
    if g is None:
        return None
    return g.to_local() if hasattr(g, "to_local") else g

