"""What ``rrfp node`` says while it waits for the other nodes, and how long it waits.

Between a start or a restart of its ranks and the moment they run, the daemon's elastic agent
waits in the c10d rendezvous for every node of the job (torchrun's machinery). When a peer
host has vanished (its daemon killed, its pod gone) that wait is the only thing left, and
torch's agent says nothing while it lasts. So:

- every :data:`SAY_EVERY_S` seconds of waiting (a quarter of ``--join-timeout`` when that is
  shorter), the daemon prints one line saying what it waits for, for how long, and when it
  gives up;
- it gives up after ``--join-timeout`` seconds (torch's rendezvous ``join_timeout``, default
  :data:`DEFAULT_JOIN_TIMEOUT_S`, torch's own default), and then exits non-zero with one line
  (``rrfp node: error: ... the other nodes did not join ...``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

DEFAULT_JOIN_TIMEOUT_S = 600
"""How long a daemon waits in one rendezvous for every node of the job (torch's default
``join_timeout``), seconds."""

SAY_EVERY_S = 30.0
"""Seconds between the daemon's lines while it waits for the other nodes."""


class RendezvousWait:
    """A daemon thread that prints, every ``every`` seconds while no rank of this node runs,
    what the node waits for.

    Args:
        ranks_running: whether any rank of this node runs now (the agent's children).
        what: the rendezvous, for the line (``host:port (job id)``).
        nnodes: nodes in the job.
        join_timeout: seconds the agent waits before giving up (for the line).
        say: prints one line.
        every: seconds between lines (at most a quarter of ``join_timeout``).
    """

    def __init__(self, ranks_running: Callable[[], bool], what: str, nnodes: int, join_timeout: int,
                 say: Callable[[str], None], every: float = SAY_EVERY_S) -> None:
        self.ranks_running = ranks_running
        self.what, self.nnodes, self.join_timeout = what, nnodes, join_timeout
        self.say, self.every = say, min(every, join_timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rrfp-node-rendezvous-wait", daemon=True)

    def start(self) -> "RendezvousWait":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the lines; returns once the thread has said its last (a line being said
        finishes first), so whatever the caller says next comes after every wait line."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def line(self, waited: float) -> str:
        """The line after ``waited`` seconds without a running rank."""
        left = max(self.join_timeout - waited, 0.0)
        return (f"rrfp node: waiting for all {self.nnodes} nodes to join the rendezvous at {self.what} for "
                f"{waited:.0f} s (a peer host gone or not started yet); giving up in {left:.0f} s (--join-timeout "
                f"{self.join_timeout:g})")

    def _run(self) -> None:
        # Polled, not signalled: the agent starts and stops its ranks without telling anyone.
        since: float | None = time.monotonic()
        said = 0
        while not self._stop.wait(min(1.0, self.every)):
            now = time.monotonic()
            if self.ranks_running():
                since, said = None, 0
                continue
            if since is None:
                since = now
            if now - since >= self.every * (said + 1):
                said += 1
                self.say(self.line(now - since))
