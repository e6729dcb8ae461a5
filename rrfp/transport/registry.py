"""Transports by name: the one table that ``rrfp train --transport``,
:func:`rrfp.parallel.bootstrap.default_transport` (so ``Pipeline(transport=NAME)``),
``LocalPipeline(transport=NAME)`` and ``tests/test_transport_conformance.py`` read.

An entry builds transports in one or both of two ways:

- between processes (``rank``): one rank's transport of a job whose ranks are processes, from a
  :class:`ProcessContext` (its rank, the job, the torch.distributed store they rendezvous
  through, the device tensors arrive on);
- in this process (``local``): every rank of the job on this event loop, from a
  :class:`LocalContext` (seeded delays for the fakes), as a :class:`LocalGroup`.

Built in: ``zmq`` and ``torch`` between processes; ``fake``, ``fake-plane`` and ``fake-nccl``
in this process (:data:`BUILTIN`). To add one, write a
:class:`~rrfp.transport.base.Transport` subclass (its module docstring lists the members to
implement and the ones it may call) and register a builder, from any module::

    from rrfp.transport.registry import LocalGroup, TransportEntry, register

    register("mine", TransportEntry("my in-memory transport", local=lambda ctx: LocalGroup(...)))

A package can also declare entries under the entry-point group ``rrfp.transports`` (name: the
transport's name, object: its :class:`TransportEntry`): every process then sees them without
importing the package first, which is what ``rrfp train``'s worker processes need.

Nothing here imports torch until a transport is built (``rrfp train`` checks its flags first).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Transport

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "LOCAL",
    "PROCESS",
    "LocalContext",
    "LocalGroup",
    "ProcessContext",
    "TransportEntry",
    "build_local",
    "build_rank",
    "get",
    "help_text",
    "names",
    "register",
    "unregister",
]

PROCESS = "process"
"""Where a transport connects ranks that are processes (:attr:`TransportEntry.rank`)."""
LOCAL = "local"
"""Where every rank lives in this process (:attr:`TransportEntry.local`)."""
ENTRY_POINT_GROUP = "rrfp.transports"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class ProcessContext:
    """What one rank's transport between processes is built from.

    Attributes:
        rank, world_size: this rank and the number of ranks of the transport.
        job: job id (message keys, store entries); arrivals of other jobs are refused.
        store: a torch.distributed Store every rank of the job shares (rendezvous).
        device: where received tensors are allocated (``"cpu"``, a ``torch.device``).
        new_group: ``new_group(backend) -> ProcessGroup`` over the job's ranks, called by every
            rank in the same order (torch.distributed's ``new_group`` inside a launched job);
            None where there is no default process group (several ranks in one process).
    """

    rank: int
    world_size: int
    job: str
    store: Any
    device: Any = "cpu"
    new_group: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class LocalContext:
    """What every rank's transport in one process is built from.

    Attributes:
        world_size: number of ranks.
        seed: seeds the message delays.
        delay: ``(low, high)`` seconds of uniform random delay per message.
        encode: pass every message through the codec, as between processes.
        job: job id arrivals are checked against (None: not checked).
        device: where received tensors are allocated (data planes that keep them on a device).
    """

    world_size: int
    seed: int = 0
    delay: tuple[float, float] = (0.0, 0.0)
    encode: bool = True
    job: str | None = None
    device: Any = "cpu"


@dataclass
class LocalGroup:
    """Every rank's transport in one process, as a ``local`` builder returns them.

    Attributes:
        transports: one per rank, in rank order, not started.
        abort_all: aborts every rank at once, none reporting the others lost (they end
            together); None: each transport's own ``abort``.
        network: the in-process network, for tests that kill a rank
            (:class:`~rrfp.transport.fake.FakeNetwork`); None if none.
        wire: the data plane's shared medium (:class:`~rrfp.transport.fake_plane.FakeWire`);
            None if none.
    """

    transports: list[Transport]
    abort_all: Callable[[], None] | None = None
    network: Any = None
    wire: Any = None


@dataclass(frozen=True)
class TransportEntry:
    """How one transport name is built.

    Attributes:
        help: one line for ``--help`` and the docs.
        rank: between processes: ``rank(ProcessContext) -> Transport``; None if it has none.
        local: in this process: ``local(LocalContext) -> LocalGroup``; None if it has none.
    """

    help: str
    rank: Callable[[ProcessContext], Transport] | None = field(default=None, compare=False)
    local: Callable[[LocalContext], LocalGroup] | None = field(default=None, compare=False)


# -- the built-in transports ---------------------------------------------------


def _zmq(ctx: ProcessContext) -> Transport:
    from .zmq import ZmqTransport

    return ZmqTransport(ctx.rank, ctx.world_size, ctx.store, ctx.job)


def _torch(ctx: ProcessContext) -> Transport:
    import torch

    from .planes import N_CHANNELS, PlaneTransport
    from .torch_plane import TorchDataPlane, gloo_groups

    dev = torch.device(ctx.device)
    if ctx.new_group is not None:
        backend = "nccl" if dev.type == "cuda" else "gloo"

        def groups() -> list:
            # Every rank calls this inside start(), which all ranks run: same groups, same order.
            return [ctx.new_group(backend) for _ in range(N_CHANNELS)]
    elif dev.type == "cpu":
        def groups() -> list:
            return gloo_groups(ctx.store, ctx.rank, ctx.world_size, f"{ctx.job}/gloo")
    else:
        raise ValueError(f"transport 'torch' on {dev}: NCCL groups need torch.distributed's process group "
                         "(ProcessContext.new_group), expected a launched job or device 'cpu'")
    return PlaneTransport(_zmq(ctx), TorchDataPlane(ctx.rank, groups, dev))


def _fake(ctx: LocalContext) -> LocalGroup:
    from .fake import FakeNetwork

    net = FakeNetwork(ctx.world_size, seed=ctx.seed, delay=ctx.delay, encode=ctx.encode, job=ctx.job)
    return LocalGroup([net.transport(r) for r in range(ctx.world_size)], abort_all=net.abort_all, network=net)


def _fake_planes(nccl_like: bool) -> Callable[[LocalContext], LocalGroup]:
    def build(ctx: LocalContext) -> LocalGroup:
        from .fake_plane import FakeWire
        from .planes import PlaneTransport

        group = _fake(ctx)
        group.wire = FakeWire(ctx.world_size, seed=ctx.seed + 1, delay=ctx.delay, nccl_like=nccl_like)
        group.transports = [PlaneTransport(c, group.wire.plane(c.rank, ctx.device)) for c in group.transports]
        return group

    return build


BUILTIN: dict[str, TransportEntry] = {
    "zmq": TransportEntry("tensors ride ZeroMQ frames through host memory", rank=_zmq),
    "torch": TransportEntry("ZeroMQ announces, torch.distributed point-to-point moves the tensors: NCCL on GPU, "
                            "gloo on CPU", rank=_torch),
    "fake": TransportEntry("one process: an in-memory network with seeded per-message delays", local=_fake),
    "fake-plane": TransportEntry("one process: the fake network announces, a fake data plane matched by tag moves "
                                 "the tensors", local=_fake_planes(nccl_like=False)),
    "fake-nccl": TransportEntry("one process: the fake network announces, a fake data plane matched by order "
                                "alone (like NCCL) moves the tensors", local=_fake_planes(nccl_like=True)),
}
"""The transports rrfp brings; :func:`register` adds to them."""

_TABLE: dict[str, TransportEntry] = dict(BUILTIN)


# -- the table -----------------------------------------------------------------


def register(name: str, entry: TransportEntry, *, replace: bool = False) -> None:
    """Make ``name`` build transports as ``entry`` says, for every reader of the table.

    Raises:
        ValueError: a malformed name, a name already taken (unless ``replace``), or an entry
            with neither builder.
        TypeError: ``entry`` not a :class:`TransportEntry`.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"transport name {name!r}: expected lowercase letters, digits, '.', '_' or '-'")
    if not isinstance(entry, TransportEntry):
        raise TypeError(f"transport {name!r}: expected a TransportEntry, got {type(entry).__name__}")
    if entry.rank is None and entry.local is None:
        raise ValueError(f"transport {name!r}: the entry has no builder, expected rank= or local= (or both)")
    if name in _TABLE and not replace:
        raise ValueError(f"transport {name!r} is already registered (pass replace=True to replace it)")
    _TABLE[name] = entry


def unregister(name: str) -> None:
    """Remove ``name`` (a built-in comes back as it was).

    Raises:
        ValueError: ``name`` not registered.
    """
    if name not in _TABLE:
        raise ValueError(f"transport {name!r} is not registered")
    if name in BUILTIN:
        _TABLE[name] = BUILTIN[name]
    else:
        del _TABLE[name]


def names(where: str | None = None) -> tuple[str, ...]:
    """The registered names, built-ins first, that build ``where`` (:data:`PROCESS`,
    :data:`LOCAL`; None: either). Declared entry points are listed without being imported
    (they count for both until loaded)."""
    if where not in (None, PROCESS, LOCAL):
        raise ValueError(f"where={where!r}: expected {PROCESS!r}, {LOCAL!r} or None")
    out = [n for n, e in _TABLE.items() if where is None or _builder(e, where) is not None]
    return tuple(out + [n for n in _declared() if n not in _TABLE])


def get(name: str, where: str | None = None) -> TransportEntry:
    """The entry of ``name`` (loading a declared entry point on first use).

    Raises:
        ValueError: one line naming ``name`` and the names that build ``where``.
    """
    entry = _TABLE.get(name) if isinstance(name, str) else None
    if entry is None and isinstance(name, str) and name in _declared():
        entry = _load(name)
    if entry is None:
        raise ValueError(f"unknown transport {name!r}: expected one of {', '.join(names(where))}")
    if where is not None and _builder(entry, where) is None:
        here = "between processes" if where == PROCESS else "within one process"
        raise ValueError(f"transport {name!r} does not run {here}: expected one of {', '.join(names(where))}")
    return entry


def build_rank(name: str, ctx: ProcessContext) -> Transport:
    """One rank's transport between processes (not started).

    Raises:
        ValueError: as :func:`get`, or what the builder raises.
        TypeError: the builder returned no Transport of ``ctx.rank``.
    """
    t = get(name, PROCESS).rank(ctx)
    _check_built(name, t, ctx.rank, ctx.world_size)
    return t


def build_local(name: str, ctx: LocalContext) -> LocalGroup:
    """Every rank's transport in this process (not started).

    Raises:
        ValueError: as :func:`get`, or what the builder raises.
        TypeError: the builder returned no LocalGroup of ``ctx.world_size`` transports in rank order.
    """
    group = get(name, LOCAL).local(ctx)
    if not isinstance(group, LocalGroup) or len(group.transports) != ctx.world_size:
        raise TypeError(f"transport {name!r}: the local builder returned {type(group).__name__}, "
                        f"expected a LocalGroup of {ctx.world_size} transports")
    for r, t in enumerate(group.transports):
        _check_built(name, t, r, ctx.world_size)
    return group


def help_text(where: str) -> str:
    """``name (help), ...`` for ``--help``."""
    return "; ".join(f"{n}: {_TABLE[n].help}" if n in _TABLE else n for n in names(where))


def _builder(entry: TransportEntry, where: str) -> Callable | None:
    return entry.rank if where == PROCESS else entry.local


def _check_built(name: str, t: Any, rank: int, world_size: int) -> None:
    from .base import Transport

    if not isinstance(t, Transport) or t.rank != rank or t.world_size != world_size:
        raise TypeError(f"transport {name!r}: the builder returned {t!r}, expected a Transport of rank {rank} "
                        f"of {world_size}")


def _declared() -> dict[str, Any]:
    """Entry points of :data:`ENTRY_POINT_GROUP`, by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load(name: str) -> TransportEntry:
    ep = _declared()[name]
    entry = ep.load()
    if not isinstance(entry, TransportEntry):
        raise TypeError(f"transport {name!r}: entry point {ep.value} is a {type(entry).__name__}, "
                        "expected a TransportEntry")
    register(name, entry)
    return entry
