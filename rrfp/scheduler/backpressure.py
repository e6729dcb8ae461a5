"""What a rank runs when its in-flight limit or its memory budget binds (RRFP App. C): the
backpressure half of :class:`rrfp.scheduler.arbiter.Arbiter`, which inherits these choices
from :class:`Backpressure`. They read the arbiter's ready set and change no decision state:
the arbiter takes what they choose.

Backpressure: ``D`` is the number of forwards minus input backwards finished so far this step
on the rank (activations held). In readiness mode, once ``D`` reaches the in-flight limit:

- one stage per rank: forwards are disabled; ready backwards (and ``W`` fillers) still run;
- ``V > 1`` virtual stages, ``admission`` backpressure (the default): the limit counts the
  microbatches in flight on the rank (its first virtual stage's F done, that stage's backward
  not). At the limit the rank admits no new microbatch, so no F runs on its first virtual stage,
  but every other ready task runs as the hint ranks it. The rank holds at most ``limit``
  microbatches, that is at most ``limit * V`` activations. It cannot deadlock: only
  first-stage forwards ever wait, and a microbatch already admitted needs no first-stage
  forward of this rank to finish.
- ``V > 1``, ``completion-order`` backpressure (RRFP App. C.2, selectable through
  ``Hint.backpressure``): while ``D`` is at the limit, the rank follows the deterministic
  microbatch-by-microbatch completion order (``m = 0..M-1``, each ``F_0..F_{V-1},
  B_{V-1}..B_0``). It waits for its next task there instead of skipping it, until ``D`` drops
  below the limit. The bound is ``limit + V``. It serialises deep interleaved pipelines once
  the limit binds: simulated, 16 ranks x 2 virtual stages, 128 microbatches, limit 32 took 10x
  strict interleaved 1F1B.

Memory budget (:mod:`rrfp.scheduler.memory`): with ``act_bytes`` (the bytes each
``F(stage, mb)`` holds) and ``memory_budget``, every forward asks the rank's ledger (a banker's
check: after it, the in-flight microbatches, oldest first, could each still take what its
remaining forwards need); an admission also needs the count limit and, with virtual stages,
goes in microbatch order. The hint ranks the granted forwards. The rule, the bound and deadlock
freedom are in that module's docstring. With ``act_bytes`` alone the arbiter only counts
(``peak_bytes``).

Memory-aware hints (:data:`rrfp.scheduler.hints.FREE_FIRST`): with one stage per rank, when the
ledger refuses a ready forward that the count limit allows, a ready ``W`` runs before any other
task, since a split backward's bytes are freed at ``W`` and that is what the forward waits for.
``W`` is never gated and only frees bytes, so the bound and the deadlock-freedom argument of
:mod:`rrfp.scheduler.memory` are unchanged (a ready task is still dispatched whenever one is
granted).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from .memory import MemoryLedger
from .tasks import F, W, Task

# Task(...) runs a Python-level __new__; the arbiter builds a task per event, so its hot paths
# build the tuple directly (same object, about half the cost).
_new = tuple.__new__


class Backpressure:
    """The arbiter's decisions at the in-flight limit and under a memory budget (a base class of
    :class:`~rrfp.scheduler.arbiter.Arbiter`, not used alone: every attribute it reads is set
    by the arbiter's constructor)."""

    def _choose_budget(self, mem: MemoryLedger) -> Task | None:
        # Under a memory budget every forward asks the ledger (the banker's check,
        # rrfp.scheduler.memory): an admission within the count limit (with virtual stages,
        # only the next microbatch in order), a later virtual stage's forward for an admitted
        # microbatch. The hint ranks the granted forwards; B, I and W are never gated.
        M = self._n_mb
        rdy = self._rdy[0]
        if not self._policy:
            return self._choose_in_order(True, budget=True)
        if self._interleaved:
            m0 = mem.n_admitted
            admit = m0 < M and rdy[m0]
        else:
            # One stage per rank: the lowest ready microbatch, the policy heap's top.
            m0 = self._rf[0][1] if self._rf else M
            admit = m0 < M
        room = admit and self.mb_inflight < self.limit
        admit = room and mem.grants(self.stages[0], m0)
        if room and not admit and self._free_first and self._rw and not self._interleaved:
            # The ledger refuses a forward the count allows: the W that frees bytes goes first.
            m, _, s = self._rw[0]
            return _new(Task, (s, W, m))
        best = None
        fs = self._fsign
        if self._interleaved:
            # Forwards on later virtual stages: only in-flight microbatches have them ready.
            stages = self.stages
            for m in mem.in_flight():
                for v in range(1, len(stages)):
                    if rdy[v * M + m]:
                        e = (v * fs, m, stages[v])
                        if (best is None or e < best) and mem.grants(e[2], m):
                            best = e
        if admit and (best is None or fs > 0):  # F prefers the lower virtual index unless depth-first
            best = (0, m0, self.stages[0])
        return self._choose_policy(False, best)

    def _choose_policy_admission(self) -> Task | None:
        # At the limit with virtual stages: no forward on the first virtual stage, every other
        # ready task as the policy ranks it. The best admissible F is the smallest heap entry
        # with virtual index >= 1 (key != 0); the scan runs only while the limit binds.
        rf = self._rf
        if not rf:
            best = None
        elif self._fsign < 0 or rf[0][0]:
            # Depth-first: entries with key != 0 sort before every key-0 entry; otherwise a
            # top with key != 0 means there is no key-0 entry. Either way the best admissible
            # F is the heap's (live) top, or there is none: no scan.
            best = rf[0] if rf[0][0] else None
        else:
            stale = self._stale[id(rf)]
            best = min((e for e in rf if e[0] and e not in stale), default=None)
        return self._choose_policy(False, best)

    def _choose_completion_order(self) -> Task | None:
        # Position pos of the completion order is microbatch pos // 2V; within it, F on
        # virtual stages 0..V-1, then the backward on V-1..0. Computed, not stored; the flag
        # of the current position is cached because a waiting rank asks again and again.
        done, n = self._done, self._canon_len
        pos = self._canon_pos
        c, i = self._canon_flag
        if pos < n and done[c][i]:
            M, nv = self._n_mb, len(self.stages)
            while pos < n and done[c][i]:
                pos += 1
                m, j = divmod(pos, 2 * nv)
                c, i = (0, j * M + m) if j < nv else (1, (2 * nv - 1 - j) * M + m)
            self._canon_pos = pos
            self._canon_flag = (c, i)
        if pos < n and self._rdy[c][i]:
            m, j = divmod(pos, 2 * len(self.stages))
            if c == 0:
                return _new(Task, (self.stages[j], F, m))
            return _new(Task, (self.stages[2 * len(self.stages) - 1 - j], self._bk, m))
        # W never changes D, so it may fill the wait without weakening the bound.
        if self._policy:
            if not self._rw:
                return None
            m, _, s = self._rw[0]
            return _new(Task, (s, W, m))
        rdy = self._rdy[2]
        for j in range(self._pos, len(self._order)):
            c, i = self._keys[j]
            if c == 2 and rdy[i]:
                return self._order[j]
        return None
