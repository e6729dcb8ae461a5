"""Building transports by data-plane name, for in-process use (tests, LocalPipeline).

Across processes, :func:`rrfp.parallel.bootstrap.default_transport` builds them from the torchrun
environment. Names: ``zmq`` (tensors ride the control plane's frames), ``torch``
(torch.distributed point-to-point), ``fake`` (in-process, tagged), ``fake-nccl``
(in-process, order-matched and tagless like NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Transport
from .fake_plane import FakeWire
from .planes import PlaneTransport

__all__ = ["DATA_PLANES", "FAKE_DATA_PLANES", "check_data_plane", "wrap_fake"]

DATA_PLANES = ("zmq", "torch")
"""Data planes between processes."""
FAKE_DATA_PLANES = ("fake", "fake-nccl")
"""In-process data planes (on a FakeNetwork control plane)."""


def check_data_plane(name: str, allowed: Sequence[str] = DATA_PLANES) -> str:
    """``name`` if it is one of ``allowed``.

    Raises:
        ValueError: one line naming the bad value and the choices.
    """
    if name not in allowed:
        raise ValueError(f"unknown data plane {name!r}: expected one of {', '.join(allowed)}")
    return name


def wrap_fake(
    controls: Sequence[Transport],
    data_plane: str,
    *,
    seed: int = 0,
    delay: tuple[float, float] = (0.0, 0.0),
    device: torch.device | str = "cpu",
) -> tuple[list[PlaneTransport], FakeWire]:
    """Put a fake data plane under each (not yet started) control-plane transport.

    Args:
        controls: one transport per rank, in rank order (e.g. a FakeNetwork's).
        data_plane: ``fake`` (tagged) or ``fake-nccl`` (order-matched, tagless).
        seed, delay: the wire's seeded per-transfer delays, seconds.

    Returns:
        the composed transports, and the shared :class:`FakeWire` (``wire.kill(rank)``
        to make a rank's transfers fail, ``wire.mismatches`` to check the protocol).

    Raises:
        ValueError: for an unknown data plane.
    """
    check_data_plane(data_plane, FAKE_DATA_PLANES)
    wire = FakeWire(len(controls), seed=seed, delay=delay, nccl_like=data_plane == "fake-nccl")
    return [PlaneTransport(c, wire.plane(c.rank, device)) for c in controls], wire
