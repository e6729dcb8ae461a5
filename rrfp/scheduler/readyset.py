"""Task kinds and a rank's ready set (RRFP §3-4).

:data:`KINDS` is the one table of task kinds: what each kind is called, the ready-set code it
is stored under, which input it waits for, whether a TP group must agree on it before running
it (it issues collectives), whether it finalises the stage's gradients for its microbatch and
which backward form it belongs to. The arbiter, TP agreement and the runtime read it instead
of comparing kind letters.

:class:`ReadySet` is the per-(stage, microbatch) state of one rank's step, as flags indexed by
``virtual index * M + microbatch``: bytearrays keep a 128-rank, 1024-microbatch simulation in
cache, where sets of tuples (millions of objects) made every event a cache miss and fed the
GC. Beside the flags it keeps one heap per direction (forwards, input backwards, ``W``), each
ordered by microbatch and virtual stage, from which the kind-ranking policies
(:mod:`rrfp.scheduler.policy`) read their best ready task of a kind.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

import heapq
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
        frees_input: after it the forward's saved activations are all free (``B``; ``W``,
            which reads the split layers' inputs ``F`` saved): the microbatch's in-flight count
            drops (:data:`~rrfp.scheduler.tasks.IN_FLIGHT_END`).
        split: the backward form it exists in: True (split backward only: ``I``, ``W``),
            False (full backward only: ``B``), None (both: ``F``).
    """

    name: str
    code: int
    input: str
    needs_agreement: bool
    finalises: bool
    frees_input: bool
    split: bool | None


KINDS: dict[str, Kind] = {
    F: Kind(F, 0, ACT, True, False, False, None),
    B: Kind(B, 1, GRAD, True, True, True, False),
    I: Kind(I, 1, GRAD, True, False, False, True),
    W: Kind(W, 2, LOCAL, False, True, True, True),
}
"""The task kinds, by name."""

KIND_CODE: dict[str, int] = {k.name: k.code for k in KINDS.values()}
KIND_INDEX: dict[str, int] = {name: i for i, name in enumerate(KINDS)}
"""Kind name -> a stable small integer (wire encodings: TP agreement's all-gather)."""


def needs_agreement(task: Task) -> bool:
    """Whether a TP group must agree on ``task`` before running it (:data:`KINDS`)."""
    return KINDS[task[1]].needs_agreement


def finalising_kind(split_backward: bool) -> str:
    """The kind after which a stage's weight gradients for a microbatch are complete, in a
    step with (``W``) or without (``B``) the split backward (:data:`KINDS`)."""
    return next(k.name for k in KINDS.values() if k.finalises and k.split in (None, split_backward))


class ReadySet:
    """One rank's per-(stage, microbatch) flags for one step, and its ready heaps.

    Args:
        stages: the rank's stages, first virtual stage first.
        n_microbatches: microbatches per step.
        queues: keep the heaps (a kind-ranking policy reads them); False: flags only.
        depth_first: forwards on later virtual stages first in :attr:`f`.

    Attributes:
        act, grad: the activation / gradient for ``(stage, mb)`` arrived.
        done: per kind code (:data:`KINDS`), the task finished.
        ready: per kind code, the task is in the ready set (its inputs are there and it has
            not been taken).
        f: ready forwards, ``(virtual index * fsign, mb, stage)``: lower microbatch first
            within a virtual stage, lower virtual stage first (``fsign = 1``) or, depth-first,
            higher (``fsign = -1``); a first-virtual-stage forward has key 0 either way.
        b: ready input backwards, ``(-virtual index, mb, stage)``: higher virtual stage first.
        w: ready ``W``, ``(mb, -virtual index, stage)``: lower microbatch first.
        queues: whether the heaps are kept. The top of each heap is always a ready task.
    """

    __slots__ = ("stages", "n_mb", "vidx", "act", "grad", "done", "ready", "f", "b", "w", "fsign", "queues",
                 "stale", "n_stale")

    def __init__(self, stages: Sequence[int], n_microbatches: int, *, queues: bool = False,
                 depth_first: bool = False) -> None:
        self.stages = list(stages)
        self.n_mb = n_microbatches
        self.vidx = {s: i for i, s in enumerate(self.stages)}
        n = len(self.stages) * n_microbatches
        self.act = bytearray(n)
        self.grad = bytearray(n)
        self.done = (bytearray(n), bytearray(n), bytearray(n))
        self.ready = (bytearray(n), bytearray(n), bytearray(n))
        self.queues = queues
        self.fsign = -1 if depth_first else 1
        self.f: list[tuple[int, int, int]] = []
        self.b: list[tuple[int, int, int]] = []
        self.w: list[tuple[int, int, int]] = []
        # Entries taken out of a heap's middle, one set per heap (the heaps' entries can be
        # equal tuples); dropped lazily when they reach the top, so that a heap is empty
        # exactly when it holds no ready task.
        self.stale: tuple[set, set, set] = (set(), set(), set())
        self.n_stale = 0

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

    def add(self, task: Task) -> None:
        """``task``'s inputs are there: it joins the ready set."""
        s, k, m = task
        c = KINDS[k].code
        v = self.vidx[s]
        self.ready[c][v * self.n_mb + m] = 1
        if self.queues:
            if c == 0:
                heapq.heappush(self.f, (v * self.fsign, m, s))
            elif c == 1:
                heapq.heappush(self.b, (-v, m, s))
            else:
                heapq.heappush(self.w, (m, -v, s))

    def take(self, task: Task) -> None:
        """``task`` leaves the ready set (it runs). The simulator calls this once per task:
        the usual case, the heap's top, is popped; any other entry is dropped lazily."""
        s, k, m = task
        if self.queues:
            if k == F:
                heap, c = self.f, 0
            elif k == W:
                heap, c = self.w, 2
            else:
                heap, c = self.b, 1
            top = heap[0]
            if top[2] == s and top[0 if c == 2 else 1] == m:
                heapq.heappop(heap)
                if self.n_stale:
                    self._drop_stale(heap, c)
                v = top[0] * self.fsign if c == 0 else -top[0] if c == 1 else -top[1]
            else:
                v = self.vidx[s]
                self.stale[c].add((v * self.fsign, m, s) if c == 0 else (-v, m, s) if c == 1 else (m, -v, s))
                self.n_stale += 1
        else:
            v = self.vidx[s]
            c = 0 if k == F else 2 if k == W else 1
        self.ready[c][v * self.n_mb + m] = 0

    def later_forward(self) -> tuple[int, int, int] | None:
        """The best ready forward (:attr:`f`'s order) past the rank's first virtual stage, or
        None: what a rank that admits no new microbatch may still run."""
        rf = self.f
        if not rf:
            return None
        if self.fsign < 0 or rf[0][0]:
            # Depth-first: entries with key != 0 sort before every key-0 entry; otherwise a
            # top with key != 0 means there is no key-0 entry. Either way the answer is the
            # (ready) top, or there is none: no scan.
            return rf[0] if rf[0][0] else None
        stale = self.stale[0]
        return min((e for e in rf if e[0] and e not in stale), default=None)

    def _drop_stale(self, heap: list, c: int) -> None:
        stale = self.stale[c]
        while heap and heap[0] in stale:
            stale.discard(heapq.heappop(heap))
            self.n_stale -= 1
