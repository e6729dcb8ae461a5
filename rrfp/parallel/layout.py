"""PP x DP x TP layout: each rank's coordinates and process groups, on torch's ``DeviceMesh``.

Global ranks are laid out ``pp``-major (``init_device_mesh(device, (pp, dp, tp),
mesh_dim_names=("pp", "dp", "tp"))``): the ``tp`` ranks of one stage are neighbours, as
Megatron places them. One pipeline runs per ``(dp_rank, tp_rank)`` coordinate; its ranks
address each other by ``pp_rank`` over rrfp's transport, in a job namespace that names the
coordinate (:meth:`ParallelLayout.job`), so the ``dp * tp`` pipelines share one store and
never cross.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

__all__ = ["ParallelLayout"]


@dataclasses.dataclass
class ParallelLayout:
    """Degrees, this rank's coordinates and its process groups.

    Attributes:
        pp, dp, tp: pipeline, data-parallel and tensor-parallel degrees (``world = pp*dp*tp``).
        rank: this process's global rank.
        pp_rank, dp_rank, tp_rank: its coordinates.
        mesh: the ``DeviceMesh`` (None for a single-process layout built by :meth:`single`).
        dp_group, tp_group: the mesh's groups along ``dp`` and ``tp`` (None when the degree is 1).
        tp_control_group: a second gloo group over the same TP ranks, for TP agreement, so that
            proposals never interleave with the layers' own TP collectives.
        world_group: the default group (one reduction of squared norms for clipping).
        dp_shard: ``rrfp train --dp-shard``: ``none`` (replicas) or ``full`` (FSDP2 shards,
            :mod:`rrfp.parallel.sharded`; every DP rank then holds a share of the gradient norm).
    """

    pp: int
    dp: int
    tp: int
    rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    mesh: Any = None
    dp_group: Any = None
    tp_group: Any = None
    tp_control_group: Any = None
    world_group: Any = None
    dp_shard: str = "none"
    _dp_stage_groups: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def single(cls, pp: int = 1, pp_rank: int = 0) -> "ParallelLayout":
        """A PP-only layout with no process groups (LocalPipeline, tests)."""
        return cls(pp, 1, 1, pp_rank, pp_rank)

    @classmethod
    def build(cls, pp: int, dp: int = 1, tp: int = 1, device_type: str = "cpu") -> "ParallelLayout":
        """Build the layout of the running job (torch.distributed initialised, or initialised
        here from the torchrun environment).

        Every rank must call this, in the same order relative to other group creations.

        Raises:
            ValueError: a degree < 1, or ``pp * dp * tp`` different from the world size (one line
                naming both).
        """
        for name, v in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} degree {v!r}: expected an integer >= 1")
        from .bootstrap import init_distributed

        init_distributed()
        world = dist.get_world_size()
        if pp * dp * tp != world:
            raise ValueError(
                f"world size {world} != pp {pp} x dp {dp} x tp {tp} = {pp * dp * tp}: launch pp x dp x tp processes"
            )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
        rank = dist.get_rank()
        tp_ctl = None
        if tp > 1:
            # new_group is collective over the world: every rank creates every TP group, in order.
            for p in range(pp):
                for d in range(dp):
                    ranks = [cls.global_rank(pp, dp, tp, p, d, t) for t in range(tp)]
                    g = dist.new_group(ranks, backend="gloo")
                    if rank in ranks:
                        tp_ctl = g
        return cls(
            pp, dp, tp, rank, pp_rank, dp_rank, tp_rank, mesh,
            mesh["dp"].get_group() if dp > 1 else None,
            mesh["tp"].get_group() if tp > 1 else None,
            tp_ctl, dist.group.WORLD,
        )

    @staticmethod
    def global_rank(pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The global rank at coordinates ``(pp_rank, dp_rank, tp_rank)`` (pp-major)."""
        return (pp_rank * dp + dp_rank) * tp + tp_rank

    @staticmethod
    def name(rank: int, dp: int = 1, tp: int = 1) -> str:
        """``rank 2 (pp 1, dp 0, tp 0)``: a global rank and its coordinates (pp-major, the
        inverse of :meth:`global_rank`), as every failure report names a rank."""
        return f"rank {rank} (pp {rank // (dp * tp)}, dp {rank // tp % dp}, tp {rank % tp})"

    def rank_at(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """Global rank of ``pp_rank`` in this rank's pipeline (or another coordinate's)."""
        return self.global_rank(
            self.pp, self.dp, self.tp, pp_rank,
            self.dp_rank if dp_rank is None else dp_rank, self.tp_rank if tp_rank is None else tp_rank,
        )

    def job(self, job: str) -> str:
        """This pipeline's job namespace (store keys and message keys): one per (dp, tp)."""
        if self.dp == 1 and self.tp == 1:
            return job
        return f"{job}.dp{self.dp_rank}.tp{self.tp_rank}"

    def dp_stage_group(self, virtual_index: int):
        """The DP group for this rank's ``virtual_index``-th stage.

        With several virtual stages per rank, their reductions may start in different orders
        on different replicas, and gloo matches collectives by order within a group: each
        virtual stage gets its own group. Index 0 is the mesh's own ``dp`` group. Groups for
        higher indices must have been made by :meth:`make_dp_stage_groups` on every rank."""
        if virtual_index == 0:
            return self.dp_group
        return self._dp_stage_groups[virtual_index]

    def make_dp_stage_groups(self, n_virtual: int) -> None:
        """Create the DP groups of virtual stages ``1..n_virtual-1`` (collective over the world)."""
        if self.dp == 1:
            return
        for v in range(1, n_virtual):
            for p in range(self.pp):
                for t in range(self.tp):
                    ranks = [self.global_rank(self.pp, self.dp, self.tp, p, d, t) for d in range(self.dp)]
                    g = dist.new_group(ranks, backend="gloo")
                    if self.rank in ranks:
                        self._dp_stage_groups[v] = g

    def __str__(self) -> str:
        return (f"rank {self.rank} (pp_rank {self.pp_rank}, dp_rank {self.dp_rank}, tp_rank {self.tp_rank}) "
                f"of pp {self.pp} x dp {self.dp} x tp {self.tp}")
