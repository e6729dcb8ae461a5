"""Where a rank's tasks send their outputs and whom it accepts inputs from, and the buffers its
inputs wait in.

The stage graph comes from the placement (:meth:`~rrfp.scheduler.tasks.Placement.next_stage`
and :meth:`~rrfp.scheduler.tasks.Placement.prev_stage`, the one statement of the chain, shared
with the scheduler and the simulator). In the runtime, the inbox, the tasks and the hand-over
between virtual stages ask a :class:`Router`, which keeps it as tables for the hot paths.

Receive buffers follow PyTorch's ``_RecvInfo`` (``torch.distributed.pipelining.stage``): one
slot per (stage, microbatch, direction), filled once by the inbox or a same-rank hand-over and
emptied once by the task that consumes it (:meth:`Router.take`), which owns the tensors from then
on.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ...errors import PipelineError
from ...scheduler.tasks import Placement
from ...transport.keys import Direction

__all__ = ["Router"]

LocalFn = Callable[[int, int, Direction, list], None]
"""``local(dst_stage, microbatch, direction, tensors)``: a same-rank hand-over."""
RemoteFn = Callable[[int, int, int, Direction, list], None]
"""``remote(dst_rank, dst_stage, microbatch, direction, tensors)``: a send to another rank."""



class Router:
    """One rank's view of the stage graph, and its receive buffers.

    Args:
        placement: which rank holds which stage (:class:`~rrfp.scheduler.tasks.Placement`).
        rank: this rank's pipeline index.

    Attributes:
        rank: this rank's pipeline index.
        n_stages: stages in the pipeline.
        rank_of: ``rank_of[stage]``, the pipeline rank holding each stage.
        stages: the stages this rank holds, in the placement's order.
    """

    def __init__(self, placement: Placement, rank: int) -> None:
        self.rank = rank
        self.n_stages = placement.n_stages
        self.rank_of: tuple[int, ...] = tuple(placement.rank_of(s) for s in range(self.n_stages))
        self.stages = [s for s, r in enumerate(self.rank_of) if r == rank]
        # Looked up per task and per arrival: tables by direction (ACT, GRAD), then stage.
        # Activations flow to the next stage, input gradients to the previous one.
        after = tuple(placement.next_stage(s) for s in range(self.n_stages))
        before = tuple(placement.prev_stage(s) for s in range(self.n_stages))
        self._consumer = (after, before)
        self._producer = (before, after)
        # By direction, then stage: the one rank that may send the stage that input.
        self._senders = tuple(tuple(None if p is None else self.rank_of[p] for p in producers)
                              for producers in self._producer)
        self._slots: tuple[dict, dict] = ({}, {})  # by Direction.ACT, Direction.GRAD: (stage, mb) -> tensors
        self._local: LocalFn | None = None
        self._remote: RemoteFn | None = None

    # ------------------------------------------------------------ the stage graph
    def consumer(self, stage: int, direction: Direction) -> int | None:
        """The stage that consumes ``stage``'s output in ``direction`` (activations forward,
        input gradients backward), or None at the ends of the pipeline."""
        return self._consumer[direction][stage]

    def consumers(self, direction: Direction) -> tuple[int | None, ...]:
        """:meth:`consumer` for every stage, as a table indexed by stage (for the hot paths)."""
        return self._consumer[direction]

    def producer(self, stage: int, direction: Direction) -> int | None:
        """The stage whose output is ``stage``'s input in ``direction``, or None (the data, the
        loss)."""
        return self._producer[direction][stage]

    def senders(self, direction: Direction) -> tuple[int | None, ...]:
        """By stage, the rank that may send it its input in ``direction`` (the rank holding
        the producing stage; None: no stage produces it), as a table for the inbox's hot path;
        :meth:`sender_problem` says why another may not."""
        return self._senders[direction]

    def sender_problem(self, src: int, stage: int, direction: Direction) -> str | None:
        """Why rank ``src`` may not send ``stage`` its input in ``direction`` (None: it may):
        only the rank holding the producing stage may."""
        producer = self._producer[direction][stage] if 0 <= stage < self.n_stages else None
        if producer is None:
            return f"stage {stage} takes no {direction.name} input from another stage"
        owner = self._senders[direction][stage]
        return None if owner == src else f"stage {producer} belongs to rank {owner}"

    # ------------------------------------------------------------ receive buffers
    def put(self, stage: int, m: int, direction: Direction, tensors: Sequence) -> None:
        """Fill the slot of ``stage``'s input ``direction`` for microbatch ``m``.

        Raises:
            PipelineError: the slot is full (a second input for one task).
        """
        slots = self._slots[direction]
        if (stage, m) in slots:
            raise PipelineError(f"rank {self.rank}: a second {direction.name} input for stage {stage} microbatch {m}")
        slots[(stage, m)] = tensors

    def take(self, stage: int, m: int, direction: Direction):
        """Empty the slot and return its tensors: the caller owns them from now on.

        Raises:
            PipelineError: nothing arrived for that slot.
        """
        try:
            return self._slots[direction].pop((stage, m))
        except KeyError:
            raise PipelineError(f"rank {self.rank}: no {direction.name} input for stage {stage} microbatch {m}") from None

    def buffers(self, direction: Direction) -> dict[tuple[int, int], Sequence]:
        """The slots of ``direction`` themselves, ``(stage, microbatch) -> tensors``, for the
        inbox's hot path, which fills them as :meth:`put` does (the same dict for the
        router's life: :meth:`clear` empties it)."""
        return self._slots[direction]

    def waiting(self, direction: Direction) -> Mapping[tuple[int, int], Sequence]:
        """The filled slots of ``direction``, ``(stage, microbatch) -> tensors`` (read only)."""
        return self._slots[direction]

    def clear(self) -> None:
        """Empty every slot (a new step)."""
        for slots in self._slots:
            slots.clear()

    # ------------------------------------------------------------ handing outputs on
    def connect(self, local: LocalFn, remote: RemoteFn) -> None:
        """Say how :meth:`hand_on` reaches a stage of this rank and one of another rank."""
        self._local, self._remote = local, remote

    def hand_on(self, outputs: list) -> None:
        """Deliver a finished task's outputs (loop thread): to a stage of this rank directly,
        else to the rank holding it."""
        for dst_stage, m, direction, tensors in outputs:
            dst_rank = self.rank_of[dst_stage]
            if dst_rank == self.rank:
                self._local(dst_stage, m, direction, tensors)
            else:
                self._remote(dst_rank, dst_stage, m, direction, tensors)
