"""A :class:`~rrfp.parallel.layout.ParallelLayout` from the user's own torch ``DeviceMesh``
(``Pipeline(..., layout=mesh)``), whose dimensions are named from ``pp``, ``dp`` and ``tp`` in
any order and subset (a missing dimension has degree 1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from .layout import ParallelLayout

__all__ = ["MeshLayout", "layout_from_mesh"]

DIMS = ("pp", "dp", "tp")


@dataclasses.dataclass
class MeshLayout(ParallelLayout):
    """A layout whose global ranks are wherever the user's mesh put them.

    Attributes:
        grid: ``grid[pp_rank][dp_rank][tp_rank]`` -> global rank (nested lists).
    """

    grid: list = dataclasses.field(default_factory=list)

    def global_rank(self, pp: int, dp: int, tp: int, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The global rank at these coordinates, as the mesh places it (the degrees must be
        this layout's)."""
        return self.grid[pp_rank][dp_rank][tp_rank]


def mesh_grid(names: tuple[str, ...], ranks: Any) -> list:
    """``grid[p][d][t]`` -> global rank, from a mesh's dimension names and its rank tensor.

    Raises:
        ValueError: a dimension name outside ``pp``, ``dp``, ``tp``, or named twice.
    """
    if not names or len(set(names)) != len(names) or any(n not in DIMS for n in names):
        raise ValueError(f"DeviceMesh dimensions {names!r}: expected distinct names from 'pp', 'dp', 'tp' "
                         "(any order and subset)")
    t = ranks
    for n in DIMS:
        if n not in names:
            t = t.unsqueeze(-1)
    order = [n for n in names] + [n for n in DIMS if n not in names]
    return t.permute(*[order.index(n) for n in DIMS]).tolist()


def layout_from_mesh(mesh: Any) -> MeshLayout:
    """This rank's layout on ``mesh`` (a torch ``DeviceMesh`` over the whole world). Every rank
    must call it, in the same order relative to other group creations (TP > 1 makes a gloo
    group per TP line for TP agreement).

    Raises:
        ValueError: bad dimension names, a mesh that is not the whole world, or a rank outside it.
    """
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh_grid(names, mesh.mesh)
    pp, dp, tp = len(grid), len(grid[0]), len(grid[0][0])
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise ValueError(f"DeviceMesh of {pp * dp * tp} ranks ({dict(zip(names, mesh.mesh.shape))}) in a world of "
                         f"{world}: expected the mesh to cover every rank")
    rank = dist.get_rank()
    coord = next(((p, d, t) for p in range(pp) for d in range(dp) for t in range(tp) if grid[p][d][t] == rank), None)
    if coord is None:
        raise ValueError(f"rank {rank} is not in the DeviceMesh {mesh.mesh.tolist()}")
    tp_ctl = None
    if tp > 1:
        for p in range(pp):
            for d in range(dp):
                g = dist.new_group(grid[p][d], backend="gloo")  # collective: every rank makes every group
                if rank in grid[p][d]:
                    tp_ctl = g
    return MeshLayout(
        pp, dp, tp, rank, *coord, mesh,
        mesh.get_group("dp") if dp > 1 else None,
        mesh.get_group("tp") if tp > 1 else None,
        tp_ctl, dist.group.WORLD, grid=grid,
    )
