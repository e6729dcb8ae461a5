"""Sharded data parallelism beside the pipeline: stages whose modules are wrapped in FSDP2's
``fully_shard`` over the DP mesh, driven as torch's pipelining drives them (``stage.py``'s
``backward_maybe_with_nosync`` and ``perform_reduce_grad``), in readiness order.

Within a step, every microbatch's backward accumulates into the *unsharded* gradients (FSDP2's
``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``,
``set_is_last_backward(False)``); the parameters are gathered once per step, the gathers
started asynchronously as the step begins (:meth:`ShardedGrads.step_begins`, a step
observer), and stay gathered through the step (``reshard_after_forward=False``, as torchtitan
sets it for pipeline stages). When the stage's gradients are final
(:meth:`ShardedGrads.on_stage_grads_final`: its last B, or with a split backward its last W,
whatever order readiness ran the microbatches in), each of its FSDP parameter groups runs its
post-backward once: the gradients are reduce-scattered (SUM: the loss is already weighted by
each microbatch's share of the global batch, :mod:`rrfp.parallel.grads`) into the sharded
``.grad`` and the parameters resharded. That runs on a helper thread, so it overlaps the rest
of the rank's drain; the step returns once it is done.

Why gathers and reductions happen only there: gloo and NCCL match collectives by their order
within a group, and readiness runs microbatches in an order that differs between DP replicas.
A gather per microbatch (``reshard_after_forward=True``) would pair one replica's gather of
block 3 with another's of block 0, so it is refused. The gathers are issued as the step begins,
every stage's in stage order and module order on every replica (the first step's, which
FSDP2's lazy initialisation makes at each stage's first forward, come in stage order too: a
stage's first forward needs the lower stages' forwards), all done before any stage's
gradients are final, and the reductions are issued in descending stage order on every
replica, one at a time on one helper thread.

Split backward (I and W apart): FSDP2's post-backward hook runs when a module's input gradient
is computed, that is during I; with gradient sync off it only accumulates. The weight
gradients W adds later land in the same unsharded ``.grad`` (the parameters stay gathered), so
the one reduction after the last W sees them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from typing import Mapping

import torch.distributed as dist
from torch import nn

from .footprint import gathered_bytes
from .layout import ParallelLayout

__all__ = ["ShardedGrads", "fsdp_modules", "is_sharded", "check_sharded_stages", "dp_sharded"]

_FSDP = "torch.distributed.fsdp._fully_shard._fully_shard"
_REPLICATE = "torch.distributed._composable.replicate_with_fsdp"


def _fsdp_class():
    """FSDP2's ``FSDPModule`` if torch loaded it (no module can be one otherwise), else None."""
    return getattr(sys.modules.get(_FSDP), "FSDPModule", None)


def _is_fsdp2(module: nn.Module, cls) -> bool:
    # replicate() built on FSDP2 reduces like DDP: refused with DDP (rrfp.runtime.engine.stage).
    replicate = getattr(sys.modules.get(_REPLICATE), "ReplicateModule", None)
    return isinstance(module, cls) and not (replicate is not None and isinstance(module, replicate))


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 (``fully_shard``) modules inside ``module``, itself included, in
    ``named_modules()`` order (the same on every replica)."""
    cls = _fsdp_class()
    if cls is None:
        return []
    return [m for m in module.modules() if _is_fsdp2(m, cls)]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds an FSDP2 ``fully_shard`` module."""
    return bool(fsdp_modules(module))


def _roots(module: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of ``module`` (each is its own FSDP root)."""
    cls = _fsdp_class()
    out: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside or not _is_fsdp2(m, cls):
            continue
        out.append(m)
        inside.update(id(x) for x in m.modules())
    return out


def _groups(module: nn.Module):
    """Every FSDP parameter group of ``module``'s FSDP2 modules: ``(fsdp module, group)``."""
    for m in fsdp_modules(module):
        for g in m._get_fsdp_state()._fsdp_param_groups:
            yield m, g


def _dp_ranks(layout: ParallelLayout) -> list[int]:
    return [layout.global_rank(layout.pp, layout.dp, layout.tp, layout.pp_rank, d, layout.tp_rank)
            for d in range(layout.dp)]


def check_sharded_stages(stages: Mapping[int, nn.Module], layout: ParallelLayout | None,
                         deterministic: bool = False) -> list[int]:
    """Check the FSDP2 stages of one rank; returns the sharded stages' indices.

    Args:
        stages: this rank's ``{stage_index: module}``.
        layout: the pipeline's layout (None: no data parallelism).
        deterministic: the runtime's deterministic mode.

    Raises:
        ValueError: one line, for: a sharded stage without a DP layout; a rank with both
            sharded and replicated stages; a parameter outside every ``fully_shard``; a
            ``fully_shard`` over other ranks than the stage's DP group, or over a 2-D (HSDP)
            mesh; ``reshard_after_forward`` set to gather per microbatch; a mixed-precision
            policy under deterministic mode.
    """
    sharded = [s for s, m in stages.items() if is_sharded(m)]
    if not sharded:
        return []
    s0 = sharded[0]
    if layout is None or layout.dp < 2:
        raise ValueError(f"stage {s0}'s module is sharded with fully_shard (FSDP2) but the pipeline has no data-parallel "
                         "layout: pass layout=ParallelLayout.build(pp, dp) (or the DeviceMesh) whose 'dp' ranks it is "
                         "sharded over")
    plain = [s for s in stages if s not in sharded]
    if plain:
        raise ValueError(f"stage {s0} is sharded with fully_shard (FSDP2) but stage {plain[0]} on the same rank is not: "
                         "shard every stage of a rank or none")
    want = _dp_ranks(layout)
    for s in sharded:
        _check_stage(s, stages[s], want, deterministic)
    return sharded


def _check_stage(s: int, module: nn.Module, want: list[int], deterministic: bool) -> None:
    managed = set()
    for m, g in _groups(module):
        info = g.mesh_info
        if hasattr(info, "replicate_process_group"):
            raise ValueError(f"stage {s} is sharded over a 2-D (HSDP) mesh: expected fully_shard over the 1-D 'dp' mesh "
                             f"of ranks {want}")
        got = dist.get_process_group_ranks(info.shard_process_group)
        if got != want:
            raise ValueError(f"stage {s} is sharded over ranks {got}: expected its data-parallel ranks {want} "
                             "(fully_shard(module, mesh=mesh['dp']))")
        user_chose = not getattr(m._get_fsdp_state(), "_auto_reshard_after_forward", True)
        if user_chose and g.post_forward_mesh_info is not None:
            raise ValueError(f"stage {s}: fully_shard(reshard_after_forward=True) gathers the parameters again for every "
                             "microbatch, in an order that differs between DP replicas; expected "
                             "reshard_after_forward=False (rrfp gathers once per step)")
        if deterministic and g.mp_policy.param_dtype is not None:
            raise ValueError(f"stage {s}: deterministic mode with fully_shard's MixedPrecisionPolicy(param_dtype="
                             f"{g.mp_policy.param_dtype}): FSDP2 accumulates those gradients in its own order; expected "
                             "deterministic=False or no param_dtype")
        managed.update(id(fp.sharded_param) for fp in g.fsdp_params)
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in managed:
            raise ValueError(f"stage {s}'s parameter {name!r} is outside every fully_shard: wrap the stage module itself "
                             "in fully_shard too (as torchtitan does), so that every parameter is sharded")


def dp_sharded(p, layout: ParallelLayout | None) -> bool:
    """Whether parameter ``p`` is a DTensor sharded over ``layout``'s DP ranks (FSDP2): each DP
    rank then holds its own part of it (and of its gradient)."""
    placements = getattr(p, "placements", None)
    if placements is None or layout is None or layout.dp < 2:
        return False
    mesh = p.device_mesh
    for i, pl in enumerate(placements):
        if pl.is_shard() and _dp_dim(layout, mesh, i):
            return True
    return False


def _dp_dim(layout: ParallelLayout, mesh, dim: int) -> bool:
    cache = layout.__dict__.setdefault("_dp_mesh_dims", {})
    key = (id(mesh), dim)
    if key not in cache:
        cache[key] = dist.get_process_group_ranks(mesh.get_group(dim)) == _dp_ranks(layout)
    return cache[key]


class ShardedGrads:
    """Step hooks (``rrfp/runtime/engine/hooks.py``) driving one rank's FSDP2 stages, and a
    step observer (``rrfp/runtime/engine/observer.py``) starting each step's gathers.

    Args:
        stages: ``{stage_index: module}`` of this rank's sharded stages (checked by
            :func:`check_sharded_stages`).

    Attributes:
        reduced: stage reductions completed (tests, benchmarks).
        gathered: per stage, ``(parameter bytes, gradient bytes)`` the gathered (unsharded)
            state held just before its last reduction: the step's transient peak on top of
            the sharded state (:func:`rrfp.parallel.footprint.gathered_bytes`).
    """

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        self.stages = dict(stages)
        self.roots = {s: _roots(m) for s, m in self.stages.items()}
        self._order = sorted(self.stages, reverse=True)  # the reductions' order, the same on every replica
        self._ready: dict[int, asyncio.Future] = {}
        self._next = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._saved = [_Saved(m, g) for mod in self.stages.values() for m, g in _groups(mod)]
        self.reduced = 0
        self.gathered: dict[int, tuple[int, int]] = {}
        self._fsdp = {s: fsdp_modules(m) for s, m in self.stages.items()}
        self._prefetched: set[int] = set()
        self._hooks = [m.register_forward_pre_hook(lambda mod, args, s=s: self._prefetch(s), prepend=True)
                       for s, m in self.stages.items()]
        for mod in self.stages.values():
            for m in fsdp_modules(mod):
                m.set_reshard_after_forward(False, recurse=False)
                # The loss already weights each microbatch by its share of the global batch:
                # the reduction is a plain sum (gloo has no pre-multiplied sum either).
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        for roots in self.roots.values():
            for root in roots:
                _sync(root, False)

    # ------------------------------------------------------------ step hooks
    def on_stage_grads_final(self, stage_index: int):
        """Stage ``stage_index``'s gradients are final: its reduction starts once every stage
        before it in the reduction order has started (at once with one stage per rank);
        returns its awaitable."""
        if stage_index in self._ready:  # a new step after one that failed part-way
            self._reset()
        fut = self._ready[stage_index] = asyncio.get_running_loop().create_future()
        while self._next < len(self._order) and self._order[self._next] in self._ready:
            s = self._order[self._next]
            self._next += 1
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rrfp-fsdp")
            done = asyncio.wrap_future(self._pool.submit(self._reduce, s))
            done.add_done_callback(lambda f, out=self._ready[s]: _copy_result(f, out))
        return fut

    def on_step_end(self):
        """Every reduction of the step is done: the next step starts the order again."""
        self._reset()
        return None

    def _reset(self) -> None:
        self._ready = {}
        self._next = 0

    # ------------------------------------------------------------ step observer
    def step_begins(self, step: int, arb) -> bool:
        """The rank's scheduler loop starts a step (``rrfp/runtime/engine/observer.py``): start
        its gathers, so a stage whose first input is still on its way gathers meanwhile.
        Returns False: no task events wanted."""
        self.prefetch()
        return False

    def step_ends(self, step: int, stats) -> None:
        """Nothing: a training step's reductions end in the step hooks; a forward-only step's
        gathered parameters are freed by :meth:`reshard`."""

    def prefetch(self) -> None:
        """Start the gathers of every stage of this rank now, asynchronously. Safe to call
        again: a stage gathered or gathering is left alone."""
        for s in self.stages:
            self._prefetch(s)

    def _prefetch(self, s: int) -> None:
        """Start every gather of stage ``s`` at once, asynchronously, in module order (the
        same on every replica); each module's own pre-forward then waits for its own gather
        only, so block ``i``'s gather overlaps the forward of the blocks before it. Also
        called before the stage's first forward of a step (a forward pre-hook). The first step
        gathers as FSDP2 does by itself: its lazy initialisation comes first."""
        if s in self._prefetched:
            return
        mods = self._fsdp[s]
        if mods[0]._get_fsdp_state()._is_root is None:
            return
        self._prefetched.add(s)
        for m in mods:
            m.unshard(async_op=True)

    def _reduce(self, s: int) -> None:  # on the helper thread
        self._prefetched.discard(s)
        self.gathered[s] = gathered_bytes(self._fsdp[s])
        for root in self.roots[s]:
            state = root._get_fsdp_state()
            _sync(root, True)
            try:
                for st in state._state_ctx.all_states:
                    for g in st._fsdp_param_groups:
                        _to_reduce_dtype(g)
                        g.post_backward()
                state._root_post_backward_final_callback()
            finally:
                _sync(root, False)
        self.reduced += 1

    # ------------------------------------------------------------ outside steps
    def reshard(self) -> None:
        """Free the gathered parameters (after a forward-only step, which runs no reduction),
        so that an optimizer step in between cannot leave the next step on stale copies."""
        self._prefetched.clear()
        for mod in self.stages.values():
            for m in fsdp_modules(mod):
                m.reshard()
                state = m._get_fsdp_state()
                for g in state._fsdp_param_groups:
                    g._post_forward_indices.clear()
                if state._is_root:
                    state._comm_ctx.post_forward_order.clear()

    def close(self) -> None:
        """Stop the helper thread and give the modules back as the user configured them."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for saved in self._saved:
            saved.restore()
        for roots in self.roots.values():
            for root in roots:
                root.set_requires_gradient_sync(True)
                root.set_reshard_after_backward(True)
                root.set_is_last_backward(True)


def _to_reduce_dtype(group) -> None:
    """Under a mixed-precision policy FSDP2 moves a parameter's low-precision gradient into its
    reduce-dtype accumulator in the post-backward hook, which runs at I; the weight gradients a
    split backward adds at W come later, in the parameter dtype. Fold them in, so that every
    gradient of the group reaches the reduction in the reduce dtype."""
    for fp in group.fsdp_params:
        if getattr(fp, "_unsharded_param", None) is not None:
            fp.accumulate_unsharded_grad_if_needed()
            fp.to_accumulated_grad_if_needed()


def _sync(root: nn.Module, last: bool) -> None:
    """Gradient sync, resharding after backward and FSDP's last-backward mark: on for the one
    reduction of a step, off for every microbatch's backward."""
    root.set_requires_gradient_sync(last)
    root.set_reshard_after_backward(last)
    root.set_is_last_backward(last)


def _copy_result(src: asyncio.Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(None)


class _Saved:
    """What the driver changes on one FSDP parameter group, to restore on close."""

    def __init__(self, module: nn.Module, group) -> None:
        self.module, self.group = module, group
        self.auto = getattr(module._get_fsdp_state(), "_auto_reshard_after_forward", None)
        self.post_forward = group.post_forward_mesh_info
        self.divide = group.gradient_divide_factor
        self.force_sum = group.force_sum_reduction_for_comms

    def restore(self) -> None:
        g = self.group
        g.post_forward_mesh_info = self.post_forward
        g.gradient_divide_factor = self.divide
        g.force_sum_reduction_for_comms = self.force_sum
        if self.auto is not None:
            self.module._get_fsdp_state()._auto_reshard_after_forward = self.auto

