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


def wait_for_keys(store: dist.Store, keys: list[str], timeout_s: float) -> None:
    """Return once every key of ``keys`` is set in ``store``, asking in short polls.

    Why not ``store.wait``: its C++ call retries on EINTR, so Python runs no signal handler
    while it blocks, and a Ctrl-C or SIGTERM waited for the whole timeout (30 s seen, then the
    launcher's SIGKILL with nothing said); polling with Python sleeps between asks lets a signal
    act at once (and ``check`` logs no socket timeouts).

    Raises:
        TimeoutError: some key still unset after ``timeout_s`` seconds.
    """
    import time

    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"store keys not set within {timeout_s:g} s: {keys[:3]}")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def default_transport(
    rank: int, world_size: int, job: str, transport: str = "zmq", device: torch.device | str | None = None
):
    """This rank's transport, rendezvousing through the default store.

    Args:
        rank, world_size, job: as :class:`~rrfp.transport.zmq.ZmqTransport`.
        transport: a name of :mod:`rrfp.transport.registry` that runs between processes:
            ``zmq`` (tensors ride ZeroMQ frames through host memory; the CPU default), ``torch``
            (ZeroMQ announces, torch.distributed point-to-point moves the tensors: NCCL when
            ``device`` is CUDA, else gloo), or one registered from outside.
        device: where received tensors are allocated (default: CPU).

    Returns:
        the registry's transport for this rank, not started.

    Raises:
        ValueError: a name the registry has no process-to-process builder for (before the
            process group is joined).
    """
    from ..transport import registry

    registry.get(transport, registry.PROCESS)
    init_distributed()
    ctx = registry.ProcessContext(rank, world_size, job, default_store(), torch.device("cpu" if device is None else device),
                                  new_group=_new_group)
    return registry.build_rank(transport, ctx)


def _new_group(backend: str) -> dist.ProcessGroup:
    """A new group of every rank of the job (each rank calls it in the same order)."""
    return dist.new_group(backend=backend)
