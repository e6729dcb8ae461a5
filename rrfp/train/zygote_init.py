"""Imported by the zygote (the first module of :data:`rrfp.train.zygote.PRELOAD`), and only
there: the zygote dies with the process that started it (``PR_SET_PDEATHSIG``: SIGKILL).

multiprocessing's forkserver otherwise leaves when the pipe from its client closes, then runs
Python's exit, which tears down torch's 2000 modules (0.6 s of CPU, tens of seconds on a loaded
machine) while the ranks it forked, which die with it, train on after their launcher was
SIGKILLed. Killed by the kernel the moment the launcher exits, the zygote takes its ranks with
it at once and costs nothing to end. The launcher names itself in ``RRFP_LAUNCHER_PID``: a
launcher that died before this module ran leaves the zygote an orphan, which exits here.

The zygote ignores SIGTERM: one sent to the launcher's whole process group (``timeout``,
``kill -TERM -PGID``, systemd's control-group stop, Slurm) must leave the launcher to end the
job gracefully, not kill the ranks with their zygote (its exit is their SIGKILL). It still
dies with the launcher. Its forks inherit the ignore: :func:`rrfp.train.zygote._become` gives
a rank SIGTERM's default back. Ctrl-C reaches the whole group too: SIGINT stays blocked in the
zygote (its forks unblock it when they can say so, :data:`rrfp.train.zygote.HELD_BY_ZYGOTE`);
the launcher starts the zygote with both blocked, so neither can reach it before this module.
"""

from __future__ import annotations

import os
import signal

from .._pdeathsig import LAUNCHER_PID_ENV, set_parent_death_signal

set_parent_death_signal(signal.SIGKILL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # already, where the launcher started it
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # ignored: one that came is dropped
if os.environ.get(LAUNCHER_PID_ENV, "").isdigit() and os.getppid() != int(os.environ[LAUNCHER_PID_ENV]):
    os._exit(128 + signal.SIGKILL)
