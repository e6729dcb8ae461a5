"""The daemon's side of SIGTERM: once it arrives, no rank is restarted, and the daemon's last
line says what was saved.

The ranks' side (finish the step, checkpoint, exit 0) is :mod:`rrfp.train.stop`. A rank that
fails after the request (one still starting, which SIGTERM stops, or one whose peer it
stopped) would make torch's agent restart the group; :func:`no_restart_after` turns that
restart into the agent's own shutdown on SIGTERM instead.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def no_restart_after(stopping: Callable[[], bool]) -> Iterator[None]:
    """While inside, torch's elastic agent (this process's) restarts a failed group only
    while ``stopping()`` is False; afterwards it raises torch's ``SignalException``
    (SIGTERM), on which the agent stops the ranks left (SIGTERM, SIGKILL after its shutdown
    timeout) and ``elastic_launch`` re-raises it.

    The agent exposes no hook between "the group failed" and "restart it"; its
    ``_restart_workers`` is that point (``SimpleElasticAgent._invoke_run``, torch >= 1.9),
    replaced here for the daemon's process only and restored on exit.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    original = SimpleElasticAgent._restart_workers

    def restart_unless_stopping(agent, worker_group) -> None:
        if stopping():
            raise SignalException("SIGTERM: no restart", sigval=signal.SIGTERM)
        original(agent, worker_group)

    SimpleElasticAgent._restart_workers = restart_unless_stopping
    try:
        yield
    finally:
        SimpleElasticAgent._restart_workers = original


def saved(checkpoint_dir: str | None) -> str:
    """What a stopped job leaves to resume from, as the tail of the daemon's last line:
    the newest committed checkpoint of ``checkpoint_dir`` and its step, or why there is none."""
    if checkpoint_dir is None:
        return "nothing saved (no --checkpoint-dir)"
    from ..train import checkpoint as ck

    path = ck.latest(checkpoint_dir)
    if path is None:
        return f"no checkpoint committed in {checkpoint_dir} yet"
    try:
        step = ck.read_meta(path).get("step", "?")
    except (OSError, ValueError):
        step = "?"
    return f"latest checkpoint {Path(path)} (step {step})"
