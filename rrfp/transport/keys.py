"""Message keys: what a message is for, independent of how it travels."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Direction", "MsgKey"]


class Direction(enum.IntEnum):
    """What the payload feeds on the destination stage."""

    ACT = 0
    """Activation for the destination stage's forward (F)."""
    GRAD = 1
    """Gradient for the destination stage's backward (B)."""
    CTL = 2
    """Control: statistics, goodbye, tensor-parallel proposals, ..."""


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, about
# 1 us per key on this machine, and every message builds two (send, decode). Keys are never
# changed after they are built; the hash is the fields'.
@dataclass(slots=True, unsafe_hash=True)
class MsgKey:
    """Identity of one message; hashable, so it can key the runtime's input buffers.

    Attributes:
        job: job id, so two pipelines sharing hosts or a store never cross.
        step: optimizer step the message belongs to.
        microbatch: microbatch index within the step.
        stage: the DESTINATION stage, i.e. the stage whose task consumes the message.
        direction: see :class:`Direction`.
    """

    job: str
    step: int
    microbatch: int
    stage: int
    direction: Direction
