"""Process-group bootstrap: joining a job launched by torchrun / torch.distributed.run (or
Kubernetes with its env), and each rank's transport built over that job's store.

rrfp has no cluster layer of its own: ranks, world size and the rendezvous store come from
torch.distributed's ``env://`` initialisation (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``), and ZeroMQ endpoints are published in that store.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .._launch_env import REQUIRED_ENV, in_launched_worker


def init_distributed(timeout_s: float = 120.0) -> None:
    """Initialise the default process group (gloo, ``env://``) unless already done.

    The group provides the store for endpoint exchange and a barrier; pipeline traffic itself
    goes over rrfp's transport.

    Raises:
        RuntimeError: naming the missing environment variables outside a launched job.
    """
    if dist.is_initialized():
        return
    missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"not inside a torchrun-launched job: {', '.join(missing)} unset "
            "(start with `rrfp train`, `torchrun`, or pass rank, n_ranks and transport)"
        )
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))


def default_store() -> dist.Store:
    """The default process group's store (the one torchrun's rendezvous set up)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def default_transport(
    rank: int, world_size: int, job: str, data_plane: str = "zmq", device: torch.device | str | None = None
):
    """This rank's transport, rendezvousing through the default store.

    Args:
        rank, world_size, job: as :class:`~rrfp.transport.zmq.ZmqTransport`.
        data_plane: ``zmq`` (tensors ride ZeroMQ frames through host memory; the CPU default)
            or ``torch`` (ZeroMQ announces, torch.distributed point-to-point moves the tensors:
            NCCL when ``device`` is CUDA, else gloo).
        device: where received tensors are allocated with ``torch`` (default: CPU).

    Returns:
        a :class:`~rrfp.transport.zmq.ZmqTransport`, or a
        :class:`~rrfp.transport.planes.PlaneTransport` over one.

    Raises:
        ValueError: for an unknown data plane.
    """
    from ..transport.factory import check_data_plane
    from ..transport.zmq import ZmqTransport

    check_data_plane(data_plane)
    init_distributed()
    control = ZmqTransport(rank, world_size, default_store(), job)
    if data_plane == "zmq":
        return control
    from ..transport.planes import N_CHANNELS, PlaneTransport
    from ..transport.torch_plane import TorchDataPlane

    dev = torch.device("cpu" if device is None else device)
    backend = "nccl" if dev.type == "cuda" else "gloo"

    def groups() -> list:
        # Every rank calls new_group in the same order (inside start(), which all ranks run).
        return [dist.new_group(backend=backend) for _ in range(N_CHANNELS)]

    return PlaneTransport(control, TorchDataPlane(rank, groups, dev))
