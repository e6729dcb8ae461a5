"""Task kinds and a rank's ready set (RRFP §3-4).

:data:`KINDS` is the one table of task kinds: what each kind is called, the ready-set code it
is stored under, which input it waits for, whether a TP group must agree on it before running
it (it issues collectives) and whether it finalises the stage's gradients for its microbatch.
The arbiter, TP agreement and the runtime read it instead of comparing kind letters.

:class:`ReadySet` is the per-(stage, microbatch) state of one rank's step, as flags indexed by
``virtual index * M + microbatch``: bytearrays keep a 128-rank, 1024-microbatch simulation in
cache, where sets of tuples (millions of objects) made every event a cache miss and fed the
GC.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .tasks import B, F, I, W, Task

ACT, GRAD, LOCAL = "activation", "gradient", "local"
"""Input directions: a forward waits for the previous stage's activation, an input backward
for the next stage's gradient (the last stage: its own loss), ``W`` only for its own ``I``."""


class Kind(NamedTuple):
    """One task kind.

    Attributes:
        name: ``F``, ``B``, ``I`` or ``W``.
        code: the ready-set flag array it lives in (0: F, 1: B or I, of which a step has one,
            2: W).
        input: the input it waits for (:data:`ACT`, :data:`GRAD`, :data:`LOCAL`).
        needs_agreement: a TP-sharded stage issues collectives in it, so a TP group agrees on
            it first (RRFP §4.2); W computes local weight gradients only.
        finalises: after it the stage's weight gradients for the microbatch are complete
            (``B``, ``W``).
        frees_input: it consumes the forward's saved activations (``B``, ``I``): the
            microbatch's in-flight count drops.
    """

    name: str
    code: int
    input: str
    needs_agreement: bool
    finalises: bool
    frees_input: bool


KINDS: dict[str, Kind] = {
    F: Kind(F, 0, ACT, True, False, False),
    B: Kind(B, 1, GRAD, True, True, True),
    I: Kind(I, 1, GRAD, True, False, True),
    W: Kind(W, 2, LOCAL, False, True, False),
}
"""The task kinds, by name."""

KIND_CODE: dict[str, int] = {k.name: k.code for k in KINDS.values()}
KIND_INDEX: dict[str, int] = {name: i for i, name in enumerate(KINDS)}
"""Kind name -> a stable small integer (wire encodings: TP agreement's all-gather)."""


def needs_agreement(task: Task) -> bool:
    """Whether a TP group must agree on ``task`` before running it (:data:`KINDS`)."""
    return KINDS[task[1]].needs_agreement


class ReadySet:
    """One rank's per-(stage, microbatch) flags for one step.

    Args:
        stages: the rank's stages, first virtual stage first.
        n_microbatches: microbatches per step.

    Attributes:
        act, grad: the activation / gradient for ``(stage, mb)`` arrived.
        done: per kind code (:data:`KINDS`), the task finished.
        ready: per kind code, the task is in the ready set (its inputs are there and it has
            not been taken).
    """

    __slots__ = ("stages", "n_mb", "vidx", "act", "grad", "done", "ready")

    def __init__(self, stages: Sequence[int], n_microbatches: int) -> None:
        self.stages = list(stages)
        self.n_mb = n_microbatches
        self.vidx = {s: i for i, s in enumerate(self.stages)}
        n = len(self.stages) * n_microbatches
        self.act = bytearray(n)
        self.grad = bytearray(n)
        self.done = (bytearray(n), bytearray(n), bytearray(n))
        self.ready = (bytearray(n), bytearray(n), bytearray(n))

    def key(self, task: Task) -> tuple[int, int]:
        """``(kind code, flag index)`` of one of this rank's tasks.

        Raises:
            KeyError: a stage this rank does not hold, or an unknown kind.
        """
        s, k, m = task
        return KINDS[k].code, self.vidx[s] * self.n_mb + m

    def is_ready(self, task: Task) -> bool:
        c, i = self.key(task)
        return bool(self.ready[c][i])

    def is_done(self, task: Task) -> bool:
        c, i = self.key(task)
        return bool(self.done[c][i])
