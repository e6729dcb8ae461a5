"""What ``torch.distributed.pipelining`` users pass, in rrfp's terms: the splitting of a batch into microbatches and the merging of the last
stage's outputs (torch's own ``split_args_kwargs_into_chunks`` and ``merge_chunks``, so chunk
specs mean exactly what they mean there), and job ids.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Sequence

import torch

from ..engine.stage import as_tuple

_job_counter = itertools.count()


def new_job_id(group: Any = None) -> str:
    """A job id unique to this pipeline: the n-th :class:`Pipeline` built in this process
    (every rank builds its pipelines in the same order, so the ranks agree), plus the group's
    global ranks for a subgroup (so that two pipeline groups of one job never share store keys).
    """
    n = next(_job_counter)
    if group is None:
        return f"rrfp-{n}"
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    return f"rrfp-{n}-g{tag}"


def split_inputs(
    args: tuple, kwargs: dict, n_microbatches: int, args_chunk_spec=None, kwargs_chunk_spec=None
) -> tuple[list[tuple], list[dict]]:
    """Split a whole batch into ``n_microbatches`` (torch's ``split_args_kwargs_into_chunks``:
    tensors along their spec's dim, default 0, with ``torch.tensor_split`` sizes; other values
    replicated).

    Returns:
        one args tuple and one kwargs dict per microbatch.

    Raises:
        ValueError: a tensor too small to give every microbatch a sample.
    """
    if not args and not kwargs:
        return [()] * n_microbatches, [{}] * n_microbatches
    for name, v in [*enumerate(args), *kwargs.items()]:
        if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] < n_microbatches) and args_chunk_spec is None \
                and kwargs_chunk_spec is None:
            size = 0 if v.dim() == 0 else v.shape[0]
            raise ValueError(
                f"n_microbatches={n_microbatches} exceeds the input batch size {size} (input {name!r}): "
                "each microbatch needs at least one sample"
            )
    try:
        # Imported here: torch.distributed.pipelining pulls in dynamo and DTensor (about 2.4 s
        # of CPU per process), which a run that never splits a batch this way should not pay.
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
            tuple(args), dict(kwargs), n_microbatches, args_chunk_spec, kwargs_chunk_spec
        )
    except AssertionError as e:  # torch's "Tensor size N is smaller than num_chunks"
        raise ValueError(f"cannot split the inputs into {n_microbatches} microbatches: {e}") from None
    if len(arg_mbs) != n_microbatches:
        raise ValueError(
            f"the inputs split into {len(arg_mbs)} microbatches, expected n_microbatches={n_microbatches}"
        )
    return arg_mbs, kwarg_mbs


def split_microbatches(args: Sequence[Any], n_microbatches: int, what: str = "input") -> list[tuple]:
    """Split each tensor of ``args`` along dim 0 into ``n_microbatches`` parts
    (``torch.tensor_split`` sizes: as equal as possible, earlier parts one larger).

    Returns:
        one tuple per microbatch, holding that microbatch's slice of every argument.

    Raises:
        ValueError: when a tensor's batch size is smaller than ``n_microbatches``.
    """
    parts = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{what} arguments must be tensors, got {type(a).__name__}")
        if a.dim() == 0 or a.shape[0] < n_microbatches:
            size = 0 if a.dim() == 0 else a.shape[0]
            raise ValueError(
                f"n_microbatches={n_microbatches} exceeds the {what} batch size {size}: "
                "each microbatch needs at least one sample"
            )
        parts.append(torch.tensor_split(a, n_microbatches, dim=0))
    return [tuple(p[m] for p in parts) for m in range(n_microbatches)]


def split_target(target: Any, n_microbatches: int) -> list:
    """The target's microbatches (dim 0, as PyTorch's schedules split it).

    Raises:
        ValueError: a target with fewer than ``n_microbatches`` samples.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor, got {type(target).__name__}")
    return [mb for (mb,) in split_microbatches((target,), n_microbatches, "target")]


def merge_outputs(chunks: Sequence[Any], output_merge_spec=None) -> Any:
    """The last stage's microbatch outputs, in microbatch order, merged back into one batch
    (torch's ``merge_chunks``: concatenated along dim 0 unless ``output_merge_spec`` says
    otherwise)."""
    from torch.distributed.pipelining.microbatch import merge_chunks

    return merge_chunks(list(chunks), output_merge_spec)


def batch_share(target: Any) -> float:
    """A microbatch's loss weight before normalisation: its number of samples (dim 0 of its
    target), so that microbatch ``m`` weighs ``n_m / sum(n)``, its share of the batch, and an
    uneven split gives the unpipelined mean loss and gradients."""
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return float(target.shape[0])
    return 1.0


class StepIO:
    """The loss side of a step on the rank holding the last stage: the user's
    ``loss_fn(output, target, **loss_kwargs)`` and the microbatch loss weights (by default the
    microbatch's share of the batch, :func:`batch_share`)."""

    def __init__(self, loss_fn, loss_weight_fn) -> None:
        self.loss_fn, self.loss_weight_fn = loss_fn, loss_weight_fn
        self.loss_kwargs: dict = {}

    def loss(self, output, target) -> torch.Tensor:
        return self.loss_fn(output, target, **self.loss_kwargs)

    def weight(self, target) -> float:
        return float((self.loss_weight_fn or batch_share)(target))


def _input_rows(args: Sequence[Any], kwargs: dict, args_chunk_spec, kwargs_chunk_spec) -> list[tuple[int, Any]]:
    """``(rows, name)`` of every tensor input that is split: its size along the dimension its
    chunk spec splits (dim 0 without a spec, as torch splits). A replicated input (a spec
    without ``split_dim``) is not a batch."""
    specs = [*zip(range(len(args)), args, args_chunk_spec or [None] * len(args)),
             *((k, v, (kwargs_chunk_spec or {}).get(k)) for k, v in kwargs.items())]
    out = []
    for name, v, spec in specs:
        dim = 0 if spec is None else getattr(spec, "split_dim", None)
        if isinstance(v, torch.Tensor) and isinstance(dim, int) and -v.dim() <= dim < v.dim():
            out.append((int(v.shape[dim]), name))
    return out


def check_target_rows(target: Any, inputs: Sequence[tuple[int, Any]], where: str = "") -> None:
    """A target must have one row (dim 0, as PyTorch's schedules split it) per input sample: a
    smaller one would broadcast over each microbatch's outputs in most losses and train on
    the wrong pairs without a word. Inputs of several batch sizes (e.g. images and the texts
    they belong to) pass when one of them matches; a flattened target (``[B*T]`` for ``[B,
    T]`` inputs) does not: flatten in ``loss_fn`` instead.

    Args:
        target: the whole target, or one microbatch's.
        inputs: :func:`_input_rows` of the matching inputs (empty: nothing to compare).
        where: a prefix naming the microbatch.

    Raises:
        ValueError: one line naming both sizes.
    """
    if not inputs or not isinstance(target, torch.Tensor) or target.dim() == 0:
        return
    rows = target.shape[0]
    if any(n == rows for n, _ in inputs):
        return
    sizes = ", ".join(f"{n} rows (input {name!r})" for n, name in inputs)
    raise ValueError(f"{where}target batch of {rows} rows != input batch of {sizes}: "
                     "expected one target row per input sample")


def prepare_inputs(pipe, args, kwargs, microbatches, target, targets, has_first: bool, has_last: bool):
    """The microbatches this rank feeds its runtime: stage 0's inputs (torch's splitting
    under the pipeline's chunk specs, or the caller's pre-split ``microbatches``), every
    local stage's keyword inputs, and the last stage's targets.

    Raises:
        ValueError: inputs that do not split, or a target whose batch is not the inputs'
            (:func:`check_target_rows`; compared where this process is given both, whole or
            pre-split: a rank given only the target has no input to compare with).
    """
    M = pipe.n_microbatches
    if has_last and target is not None and targets is None and microbatches is None:
        check_target_rows(target, _input_rows(args, kwargs, pipe.args_chunk_spec, pipe.kwargs_chunk_spec))
    if has_last and targets is not None and microbatches is not None:
        for m, (mb, t) in enumerate(zip(microbatches, targets)):
            check_target_rows(t, _input_rows(as_tuple(mb), {}, pipe.args_chunk_spec, None), f"microbatch {m}: ")
    kwarg_mbs = None
    if microbatches is not None:
        microbatches = [as_tuple(x) for x in microbatches]
        if kwargs:
            _, kwarg_mbs = split_inputs((), kwargs, M, None, pipe.kwargs_chunk_spec)
    elif args or kwargs:
        microbatches, kwarg_mbs = split_inputs(args, kwargs, M, pipe.args_chunk_spec, pipe.kwargs_chunk_spec)
    if not has_first:
        microbatches = None
    if not has_last:
        targets = None
    elif targets is None and target is not None:
        targets = split_target(target, M)
    if kwarg_mbs is not None and not any(kwarg_mbs):
        kwarg_mbs = None
    return microbatches, kwarg_mbs, targets


def check_grad_mode(pipe) -> None:
    if pipe.loss_fn is not None and not torch.is_grad_enabled():
        # As torch.distributed.pipelining: a step under no_grad would leak a validation
        # batch's gradients into training, or fail deep inside autograd.
        raise RuntimeError(
            "step() runs the backward and needs gradients enabled; under torch.no_grad() call eval() instead"
        )
