"""``rrfp node``'s liveness (``/healthz``) cannot kill a pod during one long task (issue 32
item 7): it reads each rank's liveness beat, from a thread the task does not block
(:mod:`rrfp.train.alive`), not the event-loop heartbeat the task holds up. It still fails for a
running rank that is frozen, ignores ranks whose process ended (a restart under way), and
readiness stays separate.

Ages come from a simulated clock over files whose times the test sets, and from a real process
whose beat thread is shown to beat while its main thread runs a task that never yields.
"""

from __future__ import annotations

import os
import subprocess
import sys

from rrfp.node.health import Health, pid_running
from rrfp.train.alive import ALIVE_DIR_ENV, beats


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _loop_beats(metrics_dir, values: dict[int, float]) -> None:
    """Event-loop heartbeat gauges written by a real multiprocess-mode process."""
    code = ("import sys\nfrom prometheus_client import Gauge\n"
            "g = Gauge('rrfp_last_heartbeat_timestamp_seconds', 'h', ['rank'], multiprocess_mode='max')\n"
            + "".join(f"g.labels('{r}').set({t})\n" for r, t in values.items()))
    subprocess.run([sys.executable, "-c", code], env=_env(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)), check=True,
                   timeout=300)


def _alive(folder, rank: int, pid: int, t: float) -> None:
    f = folder / f"rank-{rank}"
    f.write_text(str(pid))
    os.utime(f, (t, t))


def test_one_long_task_does_not_fail_liveness_but_a_frozen_rank_does(tmp_path):
    """At t = 2000: rank 0's event loop last beat at t = 1000 (one task has held it for 1000 s)
    while its liveness thread beat at 1999: healthy (main's /healthz failed it after 60 s).
    Rank 1 is frozen (no beat since 1900, its process running): 503 naming rank 1. Rank 2's
    process has ended (its group is being restarted): not counted."""
    metrics, alive = tmp_path / "metrics", tmp_path / "alive"
    metrics.mkdir()
    alive.mkdir()
    _loop_beats(metrics, {0: 1000.0, 1: 1900.0, 2: 1500.0})
    _alive(alive, 0, 100, 1999.0)
    _alive(alive, 1, 101, 1999.0)
    _alive(alive, 2, 102, 1500.0)
    now = [2000.0]
    h = Health(str(metrics), n_local=3, max_age_s=60.0, alive_dir=str(alive), clock=lambda: now[0],
               running=lambda pid: pid != 102)
    status, body = h.healthz()
    assert status == 200, body
    assert "rank 0: alive 1.0 s ago, event loop 1000.0 s ago" in body and "rank 2: event loop 500.0 s ago" in body
    _alive(alive, 1, 101, 1900.0)  # rank 1 stops beating; 100 s later:
    status, body = h.healthz()
    assert status == 503 and body.startswith("unhealthy: rank(s) 1 frozen: no liveness beat for over 60 s"), body
    now[0] = 1930.0
    assert h.healthz()[0] == 200  # 30 s without a beat is within the threshold
    # Readiness is separate: every rank's event loop has beaten, so ready, until a stop.
    assert h.readyz() == (200, "ready\n")
    h.stopping = True
    assert h.readyz() == (503, "stopping\n")
    assert Health(str(metrics), n_local=4, max_age_s=60.0, alive_dir=str(alive)).readyz()[0] == 503


TASK = '''
import os, sys
from pathlib import Path
from rrfp.train import alive
alive.start(int(sys.argv[1]), interval_s=0.01)
path = Path(os.environ["{env}"]) / f"rank-{{sys.argv[1]}}"
first, seen, spins = path.stat().st_mtime_ns, 0, 0
# The long task: pure Python on the main thread, never yielding to an event loop or sleeping.
# It ends once it has seen the beat thread touch the file three times.
while seen < 3:
    spins += 1
    t = path.stat().st_mtime_ns
    if t != first:
        first, seen = t, seen + 1
print(f"beats during the task: {{seen}}", flush=True)
'''.format(env=ALIVE_DIR_ENV)


def test_the_liveness_beat_comes_from_a_thread_a_long_task_does_not_block(tmp_path):
    """A process starts the beat (as every rank does), then runs a pure-Python task that
    holds its main thread; the beat thread touches the file while the task runs (the task ends
    only after seeing three beats; a beat held up by the task would hang it until the timeout)."""
    p = subprocess.run([sys.executable, "-c", TASK, "3"], env=_env(**{ALIVE_DIR_ENV: str(tmp_path)}),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "beats during the task: 3", p.stdout + p.stderr
    ((rank, (pid, _)),) = beats(tmp_path).items()
    assert rank == 3 and pid > 0 and not pid_running(pid)  # the process ended: /healthz leaves it out
    assert pid_running(os.getpid())
