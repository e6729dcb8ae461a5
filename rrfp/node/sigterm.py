"""The daemon's side of SIGTERM: once a stop is asked (this daemon's SIGTERM, or a peer node's
that reached this node's ranks), no rank is restarted, and the daemon exits
:data:`~rrfp.train.stop.PREEMPTED` with a last line saying what was saved.

The ranks' side (end the step in progress, checkpoint, exit 143) is :mod:`rrfp.train.stop`.
Ranks that exit 143, a rank still starting that SIGTERM stops, or one whose peer it stopped,
would make torch's agent restart the group; :func:`no_restart_after` makes the agent end the
run instead, with each rank's exit code in its ``ChildFailedError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def no_restart_after(stopping: Callable[[], bool], on_success: Callable[[], None] | None = None) -> Iterator[None]:
    """While inside, torch's elastic agent (this process's) restarts a failed group only
    while ``stopping()`` is False; afterwards a failed group ends the run as if no restart
    were left: the agent stops the ranks still running (SIGTERM, SIGKILL after its shutdown
    timeout) and ``elastic_launch`` raises ``ChildFailedError`` with the ranks' exit codes.
    ``on_success`` is called once the agent has seen every rank of the node finish (it then
    waits in its exit barrier for the other nodes' agents, with no rank running).

    The agent exposes no hook between "the group failed" and "restart it"; after
    ``_monitor_workers`` (``LocalElasticAgent``, torch >= 1.9) reports the failure, its
    ``_remaining_restarts`` decides (``SimpleElasticAgent._invoke_run``). The method is
    replaced for the daemon's process only and restored on exit.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers

    def monitor_no_restart_when_stopping(agent, worker_group):
        result = original(agent, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and stopping():
            agent._remaining_restarts = 0
        elif result.state == WorkerState.SUCCEEDED and on_success is not None:
            on_success()
        return result

    LocalElasticAgent._monitor_workers = monitor_no_restart_when_stopping
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original
