"""A rank's ready set (RRFP §3-4).

Task kinds and their ready-set codes come from the one table, :data:`rrfp.scheduler.tasks.KINDS`
(re-exported here with its helpers, where the ready set's readers import them).

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
from heapq import heappop
from typing import Sequence

from .tasks import (  # noqa: F401  (re-exported: the kind table's readers import it from here)
    ACT, B_CODE, F_CODE, GRAD, KIND_CODE, KIND_INDEX, KINDS, LOCAL, W_CODE, Kind, Task, finalising_kind,
    needs_agreement,
)



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
        fl: breadth-first only (``fsign = 1``), the entries of :attr:`f` past the first
            virtual stage, pushed beside them; its taken entries leave lazily (their ready
            flag is clear), so its top is not always ready (:meth:`later_forward` reads it).
        heaps: the three heaps by kind code (``heaps[F_CODE] is f``...).
        queues: whether the heaps are kept. The top of each heap is always a ready task.
    """

    __slots__ = ("stages", "n_mb", "vidx", "act", "grad", "done", "ready", "f", "b", "w", "heaps", "fsign",
                 "queues", "stale", "n_stale", "_by_kind", "fl")

    def __init__(self, stages: Sequence[int], n_microbatches: int, *, queues: bool = False,
                 depth_first: bool = False) -> None:
        self.stages = list(stages)
        self.n_mb = n_microbatches
        self.vidx = {s: i for i, s in enumerate(self.stages)}
        n = len(self.stages) * n_microbatches
        self.act = bytearray(n)
        self.grad = bytearray(n)
        n_codes = len(set(KIND_CODE.values()))
        self.done = tuple(bytearray(n) for _ in range(n_codes))
        self.ready = tuple(bytearray(n) for _ in range(n_codes))
        self.queues = queues
        self.fsign = -1 if depth_first else 1
        self.heaps: tuple[list[tuple[int, int, int]], ...] = tuple([] for _ in range(n_codes))
        self.f, self.b, self.w = self.heaps[F_CODE], self.heaps[B_CODE], self.heaps[W_CODE]
        # Breadth-first, a rank that admits no new microbatch asks for the best forward past
        # its first virtual stage, which sorts after every first-stage entry of f: this heap
        # answers without scanning f (a rank at the limit holds up to M first-stage forwards).
        self.fl: list[tuple[int, int, int]] = []
        # Entries taken out of a heap's middle, one set per heap (the heaps' entries can be
        # equal tuples); dropped lazily when they reach the top, so that a heap is empty
        # exactly when it holds no ready task.
        self.stale: tuple[set, ...] = tuple(set() for _ in range(n_codes))
        self.n_stale = 0
        # Per kind: (code, heap, where an entry holds the microbatch, ready flags); take()
        # runs once per task in the simulator.
        self._by_kind = {k.name: (k.code, self.heaps[k.code], 0 if k.code == W_CODE else 1, self.ready[k.code])
                         for k in KINDS.values()}

    def configure(self, *, queues: bool, depth_first: bool) -> None:
        """Set what the rank's policy asks of the ready set (its declared
        :attr:`~rrfp.scheduler.policy.Policy.queues` and ``depth_first``), before any task
        joins it.

        Raises:
            ValueError: a task has joined already.
        """
        if any(a.find(1) >= 0 for a in (*self.ready, *self.done)):
            raise ValueError("configure() on a ready set that holds tasks: configure it first")
        self.queues = queues
        self.fsign = -1 if depth_first else 1

    def key(self, task: Task) -> tuple[int, int]:
        """``(kind code, flag index)`` of one of this rank's tasks.

        Raises:
            KeyError: a stage this rank does not hold, or an unknown kind.
        """
        s, k, m = task
        return KIND_CODE[k], self.vidx[s] * self.n_mb + m

    def entry(self, code: int, v: int, m: int, s: int) -> tuple[int, int, int]:
        """The heap entry of the task of kind code ``code`` on virtual stage ``v`` (global
        stage ``s``), microbatch ``m`` (the orders under :attr:`f`, :attr:`b`, :attr:`w`)."""
        if code == F_CODE:
            return (v * self.fsign, m, s)
        if code == B_CODE:
            return (-v, m, s)
        return (m, -v, s)

    def is_ready(self, task: Task) -> bool:
        c, i = self.key(task)
        return bool(self.ready[c][i])

    def is_done(self, task: Task) -> bool:
        c, i = self.key(task)
        return bool(self.done[c][i])

    def add(self, task: Task) -> None:
        """``task``'s inputs are there: it joins the ready set. (The arbiter inlines this in
        its event paths; ``tests/test_scheduler_readyset.py`` checks both leave the same set.)"""
        s, k, m = task
        c = KIND_CODE[k]
        v = self.vidx[s]
        self.ready[c][v * self.n_mb + m] = 1
        if self.queues:
            e = self.entry(c, v, m, s)
            heapq.heappush(self.heaps[c], e)
            if c == F_CODE and v and self.fsign > 0:
                heapq.heappush(self.fl, e)

    def take(self, task: Task) -> None:
        """``task`` leaves the ready set (it runs). The simulator calls this once per task:
        the usual case, the heap's top, is popped; any other entry is dropped lazily."""
        s, k, m = task
        c, heap, at, flags = self._by_kind[k]
        i = self.vidx[s] * self.n_mb + m
        if self.queues:
            top = heap[0]
            if top[2] == s and top[at] == m:
                heappop(heap)
                if self.n_stale:
                    self.drop_stale(heap, c)
            else:
                self.stale[c].add(self.entry(c, i // self.n_mb, m, s))
                self.n_stale += 1
        flags[i] = 0

    def later_forward(self) -> tuple[int, int, int] | None:
        """The best ready forward (:attr:`f`'s order) past the rank's first virtual stage, or
        None: what a rank that admits no new microbatch may still run."""
        rf = self.f
        if not rf:
            return None
        if self.fsign < 0 or rf[0][0]:
            # Depth-first: entries with key != 0 sort before every key-0 entry; otherwise a
            # top with key != 0 means there is no key-0 entry. Either way the answer is the
            # (ready) top, or there is none.
            return rf[0] if rf[0][0] else None
        # Breadth-first: fl's top, past the entries already taken (key = virtual index).
        fl, flags, M = self.fl, self.ready[F_CODE], self.n_mb
        while fl:
            e = fl[0]
            if flags[e[0] * M + e[1]]:
                return e
            heappop(fl)
        return None

    def drop_stale(self, heap: list, c: int) -> None:
        """Drop the entries taken out of the middle of ``heap`` (kind code ``c``) that reached
        its top, so that its top is a ready task again (after a pop)."""
        stale = self.stale[c]
        while heap and heap[0] in stale:
            stale.discard(heapq.heappop(heap))
            self.n_stale -= 1
