"""One rank's share of a checkpoint as ``torch.distributed.checkpoint`` (DCP) state dicts: the
model and its AdamW state, keyed by the unsplit model's names (written now) or by stage index
(read, for checkpoints written before).

**By name** (:class:`NameKeyed`, checkpoint format 3): every key is a name of the unsplit model's
``state_dict()`` (:func:`rrfp.model.names.full_names`)::

    model.<name>                     the parameter (full shape; a rank writes what it holds)
    optim.state.<name>.<key>         its AdamW state: exp_avg, exp_avg_sq (shaped as the parameter), step
    optim.param_groups.<name>.<key>  its parameter group's settings (lr, betas, eps, ...)

(``torch.distributed.checkpoint.state_dict``'s flattened optimizer state, renamed.) A
tensor-parallel shard is written as the pieces of the unsplit tensor it holds (:class:`Pieces`;
a fused ``qkv`` shard is three: its heads of q, k and v), an FSDP2 shard as the DTensor it is
(both, for a sharded TP shard). DCP writes each piece once (DP replicas hold equal ones) and,
loading, reads for every rank exactly the pieces it holds now: a checkpoint loads under any
``--stages``, ``--virtual-stages``, ``--placement``, ``--tp`` and ``--dp``, and into the unsplit
model in one process (``rrfp export``). A weight held under two names (a tied embedding and head)
is written under both, optimizer state included, so either layout finds it.

**By stage** (:class:`StageKeyed`, formats 1-2): ``model.stage<s>.<stage module's name>``, with
``--tp`` above 1 ``model.stage<s>.tp<t>.<name>``, and ``optim.*`` keyed the same way; it loads
only at the layout that wrote it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ..model.names import full_names, tp_runs


def options() -> StateDictOptions:
    """Flattened optimizer state: every entry keyed by its parameter's name."""
    return StateDictOptions(flatten_optimizer_state_dict=True)


class Pieces:
    """The parts of one unsplit tensor that a rank holds, for DCP: views of its local tensor and
    where each starts in the unsplit tensor. It implements the three methods DCP asks of a
    checkpointable value (as ``DTensor`` does); :class:`SavePlanner` and :class:`LoadPlanner`
    find a piece by its offset. Loading writes into the views, so into the local tensor.

    Args:
        size: the unsplit tensor's shape.
        pieces: ``(view, offsets)`` pairs; the pieces must not overlap.
    """

    def __init__(self, size, pieces: list[tuple[torch.Tensor, tuple[int, ...]]]) -> None:
        self._size = torch.Size(size)
        self.pieces = [(t, torch.Size(o)) for t, o in pieces]

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self._size))
                for t, o in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for t, o in self.pieces]

    def at(self, offsets) -> torch.Tensor:
        """The piece starting at ``offsets``.

        Raises:
            KeyError: no piece starts there.
        """
        for t, o in self.pieces:
            if o == offsets:
                return t
        raise KeyError(f"no piece at {tuple(offsets)} of a tensor of shape {tuple(self._size)}")


def tp_pieces(t: torch.Tensor, dim: int, runs: list[tuple[int, int, int]], tp: int) -> Pieces:
    """What a TP shard ``t`` holds of the unsplit tensor (``runs`` from
    :func:`rrfp.model.names.tp_runs`). ``t`` may itself be an FSDP2 ``DTensor`` sharding this
    rank's TP shard over the DP ranks: its local part is cut by the runs it overlaps."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        _, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    else:
        local, start = t, (0,) * t.dim()
    full = list(t.shape)
    full[dim] *= tp
    out = []
    for a, b, n in runs:  # rows a..a+n of the TP shard are rows b..b+n of the unsplit tensor
        lo, hi = max(a, start[dim]), min(a + n, start[dim] + local.shape[dim])
        if lo < hi:
            at = list(start)
            at[dim] = b + lo - a
            out.append((local.narrow(dim, lo - start[dim], hi - lo), tuple(at)))
    return Pieces(full, out)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes :class:`Pieces` (top-level keys only)."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also loads into :class:`Pieces` (top-level keys only)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default planner replaces the values it does not know by None (while
        # materialising meta tensors): keep the pieces.
        kept = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(kept)
        self.state_dict.update(kept)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_tensor(index)


def _split_optim_key(key: str) -> tuple[str, str, str]:
    """``state.stage1.blocks.0.x.weight.exp_avg`` -> ``("state", "stage1.blocks.0.x.weight", "exp_avg")``
    (optimizer state and parameter-group keys have no dots)."""
    kind, rest = key.split(".", 1)
    fqn, field = rest.rsplit(".", 1)
    return kind, fqn, field


class NameKeyed:
    """One rank's model and optimizer state keyed by the unsplit model's names (format 3).

    Args:
        stages: this rank's :class:`~rrfp.runtime.engine.stage.PipelineStage` objects.
        optimizer: the optimizer over exactly their parameters.
        tp_rank, tp: this rank's TP coordinate and the TP degree.

    Raises:
        ValueError: a stage module without the map to the unsplit model's names.
    """

    def __init__(self, stages, optimizer, tp_rank: int = 0, tp: int = 1) -> None:
        self.optimizer, self.tp = optimizer, tp
        self.module = nn.ModuleDict({f"stage{s.stage_index}": s.submod for s in stages})
        self.full: dict[str, str] = {}
        self.runs: dict[str, tuple[int, list]] = {}
        for s in stages:
            prefix = f"stage{s.stage_index}."
            self.full.update({prefix + k: v for k, v in full_names(s.submod).items()})
            self.runs.update({prefix + k: v for k, v in tp_runs(s.submod, tp_rank, tp).items()})
        # Every name of each parameter, first the one the optimizer's state is keyed by.
        names: dict[int, list[str]] = {}
        for fqn, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(fqn)
        self.aliases = {fqns[0]: fqns for fqns in names.values()}
        self._local: tuple[dict, dict] | None = None

    def _wrap(self, fqn: str, t):
        if fqn in self.runs and isinstance(t, torch.Tensor) and t.dim() > 0:
            dim, runs = self.runs[fqn]
            return tp_pieces(t, dim, runs, self.tp)
        return t

    def state(self) -> dict:
        """``{key: tensor, Pieces, DTensor or value}`` as the module docstring lists; its
        tensors share storage with the parameters and optimizer state."""
        model, optim = get_state_dict(self.module, self.optimizer, options=options())
        self._local = model, optim
        out = {f"model.{self.full[fqn]}": self._wrap(fqn, t) for fqn, t in model.items()}
        for key, value in optim.items():
            kind, fqn, field = _split_optim_key(key)
            for alias in self.aliases.get(fqn, [fqn]):
                out[f"optim.{kind}.{self.full[alias]}.{field}"] = self._wrap(fqn, value)
        return out

    def apply(self, state: dict) -> None:
        """Set the model and optimizer from ``state`` (the dict :meth:`state` returned, loaded)."""
        assert self._local is not None, "state() first"
        model, optim = self._local
        loaded = {}
        for key, value in optim.items():
            kind, fqn, field = _split_optim_key(key)
            got = state[f"optim.{kind}.{self.full[fqn]}.{field}"]
            loaded[key] = value if isinstance(got, Pieces) else got  # tensors were loaded in place
        set_state_dict(self.module, self.optimizer, model_state_dict=model, optim_state_dict=loaded,
                       options=options())


class StageKeyed:
    """One rank's model and optimizer state keyed by stage index (formats 1-2, module docstring)."""

    def __init__(self, stages, optimizer, tp_rank: int = 0, tp: int = 1) -> None:
        self.optimizer = optimizer

        def part(m):
            return nn.ModuleDict({f"tp{tp_rank}": m}) if tp > 1 else m

        self.module = nn.ModuleDict({f"stage{s.stage_index}": part(s.submod) for s in stages})

    def state(self) -> dict:
        model, optim = get_state_dict(self.module, self.optimizer, options=options())
        return {"model": model, "optim": optim}

    def apply(self, state: dict) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options())
