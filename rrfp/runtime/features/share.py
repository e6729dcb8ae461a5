"""How the ranks of a pipeline share ``auto``'s figures (:mod:`rrfp.runtime.features.auto`): every
rank calls each method of a :class:`Share` at the same point with its own part and gets the same
answer, so every rank switches to the same hint before the same step.

Three ways, one per front door: :class:`LocalShare` (every rank in this process,
:class:`~rrfp.runtime.doors.local.LocalPipeline`), :class:`DistShare` (a torch.distributed process
group: ``rrfp train``, torchrun), :class:`ControlShare` (rrfp's own control plane, for a
:class:`~rrfp.runtime.doors.pipeline.Pipeline` without a process group; a peer's malformed part is
refused in one line, :func:`_check_part`).
"""

from __future__ import annotations

from typing import Any, Protocol

from ...errors import PipelineError
from ..engine.inbox import ControlQueue

__all__ = ["ControlShare", "DistShare", "KIND", "LocalShare", "Share"]

_PART_ITEMS = 256
"""Items per control message of :class:`ControlShare` (a record is ~50 bytes packed: well
under the codec's 64 KiB header limit)."""

_MAX_PARTS = 4096
"""Most parts one exchange may have (a million items): a peer announcing more is refused
before this rank waits for them."""

KIND = "auto"
"""The ``kind`` of :class:`ControlShare`'s control messages (its inbox handler's)."""


class Share(Protocol):
    """How the ranks of a pipeline share ``auto``'s figures. Every rank calls each method at
    the same point with its own part and gets the same answer."""

    async def max(self, x: float) -> float:
        """The largest ``x`` over the ranks."""

    async def sum(self, x: float) -> float:
        """The sum of ``x`` over the ranks."""

    async def gather(self, items: list) -> list:
        """Every rank's ``items`` (msgpack-able tuples), concatenated in rank order."""


class LocalShare:
    """Every rank runs in this process (:class:`~rrfp.runtime.doors.local.LocalPipeline`): this
    process's figures are already everyone's."""

    async def max(self, x: float) -> float:
        return x

    async def sum(self, x: float) -> float:
        return x

    async def gather(self, items: list) -> list:
        return list(items)


class DistShare:
    """Through a torch.distributed process group (default: the default one, every process
    of the job). Collectives block this process until every member calls them."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    async def _reduce(self, x: float, op) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return float(t.item())

    async def max(self, x: float) -> float:
        import torch.distributed as dist

        return await self._reduce(x, dist.ReduceOp.MAX)

    async def sum(self, x: float) -> float:
        import torch.distributed as dist

        return await self._reduce(x, dist.ReduceOp.SUM)

    async def gather(self, items: list) -> list:
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, list(items), group=self.group)
        return [x for part in everyone for x in part]


class ControlShare:
    """Over rrfp's own control plane, for a pipeline without a torch.distributed process group:
    each rank sends its part to every other rank (:meth:`RankRuntime.send_control`), in
    messages of at most :data:`_PART_ITEMS` items, and waits for theirs. Wire format: meta
    ``{"kind": "auto", "rrfp-auto": exchange, "part": i, "of": parts, "items": [...]}``.

    A step feature: the rank's inbox hands it the control messages of kind :data:`KIND`
    (:meth:`~rrfp.runtime.engine.inbox.Inbox.on_control`) into a queue of its own, so the
    caller's own control traffic stays in ``runtime.control()``, untouched.

    Args:
        runtime: this rank's :class:`~rrfp.runtime.engine.rank.RankRuntime`.
        n_ranks: the pipeline's ranks.
        timeout: seconds to wait for a peer's part.

    Raises (from each method):
        TimeoutError: a peer's part did not arrive within ``timeout`` seconds.
        PipelineError: a peer was lost, or sent a part that this code cannot send (see
            :func:`_check_part`).
    """

    def __init__(self, runtime: Any, n_ranks: int, timeout: float) -> None:
        self.rt, self.n, self.timeout = runtime, n_ranks, timeout or None
        self.seq = 0
        self._early: dict[tuple[int, int], dict[int, dict]] = {}  # (seq, src) -> part -> its message
        self._parts = ControlQueue(runtime.inbox)
        runtime.inbox.on_control(KIND, lambda msg, step: self._parts.put(msg))

    async def _exchange(self, items: list) -> list[list]:
        self.seq += 1
        seq, me = self.seq, self.rt.rank
        parts = [items[i:i + _PART_ITEMS] for i in range(0, len(items), _PART_ITEMS)] or [[]]
        for dst in range(self.n):
            if dst != me:
                for i, part in enumerate(parts):
                    self.rt.send_control(dst, seq, {"kind": KIND, "rrfp-auto": seq, "part": i, "of": len(parts),
                                                    "items": part})
        got: dict[int, dict[int, list]] = {r: {} for r in range(self.n) if r != me}
        want: dict[int, int] = {}
        for src in list(got):
            for meta in self._early.pop((seq, src), {}).values():
                _check_part(meta, src, seq, self.n, me, got[src], want.get(src))
                got[src][meta["part"]], want[src] = meta["items"], meta["of"]
        while any(len(got[r]) < want.get(r, 1) for r in got):
            msg = await self._parts.get(timeout=self.timeout)
            meta = msg.meta
            early = self._early.setdefault((seq + 1, msg.src), {}) if meta.get("rrfp-auto") == seq + 1 else None
            _check_part(meta, msg.src, seq, self.n, me, got.get(msg.src, {}), want.get(msg.src), early)
            if early is not None:
                early[meta["part"]] = meta
            else:
                got[msg.src][meta["part"]], want[msg.src] = meta["items"], meta["of"]
        out = []
        for r in range(self.n):
            out.append(items if r == me else [x for i in sorted(got[r]) for x in got[r][i]])
        return out

    async def _figures(self, x: float) -> list[float]:
        # Each rank's part is the one float it sent: anything else (an empty part, a string, a
        # second number) would be an IndexError or TypeError here, or a figure taken unchecked.
        parts = await self._exchange([float(x)])
        for r, p in enumerate(parts):
            if not (len(p) == 1 and type(p[0]) is float):
                raise PipelineError(f"rank {r} sent a malformed auto message (exchange {self.seq}): "
                                    f"'items' {p!r}: expected one number")
        return [p[0] for p in parts]

    async def max(self, x: float) -> float:
        return max(await self._figures(x))

    async def sum(self, x: float) -> float:
        return sum(await self._figures(x))

    async def gather(self, items: list) -> list:
        return [x for part in await self._exchange(list(items)) for x in part]


def _check_part(meta: dict, src: Any, seq: int, n: int, me: int, have: dict, of: int | None,
                early: dict | None = None) -> None:
    """Refuse an ``auto`` part that a peer running this code cannot send: the ranks exchange in
    lockstep, so a peer is at most one exchange ahead (it needs this rank's next part to finish
    the one after), and every part of an exchange comes once, in one count of parts.

    Raises:
        PipelineError: naming the sender and the bad field; the ranks' choices would diverge.
    """
    def bad(what: str) -> PipelineError:
        return PipelineError(f"rank {src} sent a malformed auto message (exchange {seq}): {what}")

    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < n or src == me:
        raise bad(f"sender {src!r}: expected another rank of 0..{n - 1}")
    k, part, parts, items = (meta.get(f) for f in ("rrfp-auto", "part", "of", "items"))
    if type(k) is not int or k not in (seq, seq + 1):
        raise bad(f"exchange {k!r}: expected {seq} or {seq + 1}")
    if type(parts) is not int or not 1 <= parts <= _MAX_PARTS:
        raise bad(f"'of' {parts!r}: expected a count of parts, 1..{_MAX_PARTS}")
    if type(part) is not int or not 0 <= part < parts:
        raise bad(f"'part' {part!r}: expected 0..{parts - 1}")
    if not isinstance(items, list) or len(items) > _PART_ITEMS:
        raise bad(f"'items': expected a list of at most {_PART_ITEMS} items")
    if k == seq and ((of is not None and parts != of) or part in have):
        raise bad(f"part {part} of {parts} again, or a second count of parts (first {of})")
    if early is not None and part in early:
        raise bad(f"part {part} of exchange {k} again")
