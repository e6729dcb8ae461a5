"""Graceful stop of a training job on SIGTERM (a pod eviction): every rank finishes its
current step, the job writes a checkpoint, and every rank exits 0.

Only ``rrfp node`` asks for it: before it forwards SIGTERM to its ranks it creates the file
named by :data:`STOP_FILE_ENV`. A SIGTERM without that file (torchrun's agent stopping the
survivors of a failed rank before a restart, or a plain ``torchrun``) keeps its usual
meaning: the rank dies at once, since its group is broken and no step can finish.

Agreement without a barrier: all ranks must stop after the same step. A rank that is told to
stop publishes ``rrfp/stop-requested`` in the job's store (from a helper thread, so the
request is out even while the rank waits inside a step). Rank 0, after each of its steps
``k``, checks for the request and, if set, publishes ``rrfp/stop-at = k + 1``. Every rank
checks ``rrfp/stop-at`` after each of its steps. No rank can finish step ``k + 1`` before rank
0 has begun it (every microbatch starts with rank 0's forward), and rank 0 begins it only
after publishing, so every rank sees the decision by the end of step ``k + 1`` at the latest,
and all stop there. Cost: one store lookup per step and rank, no waiting.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import timedelta

from ..lines import say

STOP_FILE_ENV = "RRFP_NODE_STOP_FILE"
"""Set by ``rrfp node`` in its ranks' environment: the file it creates on SIGTERM."""

HOLD_ENV = "RRFP_TEST_HOLD_AFTER_STEP"
"""Test hook, a step count ``K``: rank 0 waits after its ``K``-th step until some rank has
asked to stop, so a test can send SIGTERM at a known point without a timer (first attempt
of the job only)."""

REQUEST_KEY = "rrfp/stop-requested"
DECISION_KEY = "rrfp/stop-at"


class GracefulStop:
    """One rank's side of the graceful stop (see the module docstring).

    Args:
        store: the job's store (``torch.distributed``'s default store).
        rank: this rank.
        timeout_s: longest wait of the test hold.
        checkpoint: whether the run writes a checkpoint when it stops (``--checkpoint-dir``);
            only for what the rank says.
    """

    def __init__(self, store, rank: int, timeout_s: float = 60.0, checkpoint: bool = True) -> None:
        self.store = store
        self.rank = rank
        self.checkpoint = checkpoint
        self.timeout_s = timeout_s
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.requested = False
        self._published = False
        self._decided: int | None = None
        self.armed = bool(self.stop_file)
        if self.armed:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not (self.stop_file and os.path.exists(self.stop_file)):
            # Not a stop asked by rrfp node: die as SIGTERM always made a rank die.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self.requested:
            self.requested = True
            then = ", then a checkpoint" if self.checkpoint else " (no --checkpoint-dir: nothing is saved)"
            say(f"rrfp train: rank {self.rank}: SIGTERM: finishing the current step{then}", sys.stderr)
            # A thread: the main thread may be inside a step, waiting on a peer.
            threading.Thread(target=self._publish, name="rrfp-stop", daemon=True).start()

    def _publish(self) -> None:
        if not self._published:
            self._published = True
            self.store.set(REQUEST_KEY, str(self.rank))

    def _local_request(self) -> bool:
        if not self.requested and self.stop_file and os.path.exists(self.stop_file):
            self.requested = True  # the daemon's SIGTERM came before this rank could catch it
        return self.requested

    def after_step(self, done: int, last: int) -> bool:
        """Call after each optimizer step; ``done`` steps are finished, the run would end at
        ``last``. True when this rank must stop now (checkpoint, then exit 0)."""
        if not self.armed or done >= last:
            return False
        if self._local_request():
            self._publish()
        if self.rank == 0 and self._decided is None:
            self._hold(done)
            if self._local_request() or self.store.check([REQUEST_KEY]):
                self._decided = done + 1
                self.store.set(DECISION_KEY, str(self._decided))
        if self._decided is None and self.store.check([DECISION_KEY]):
            self._decided = int(self.store.get(DECISION_KEY))
        return self._decided is not None and done >= self._decided

    def _hold(self, done: int) -> None:
        if os.environ.get(HOLD_ENV) != str(done) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        say(f"rrfp train: rank 0: test hook {HOLD_ENV}: holding after step {done} until a stop is requested",
            sys.stderr)
        self.store.wait([REQUEST_KEY], timedelta(seconds=self.timeout_s))
