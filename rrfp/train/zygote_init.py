"""Imported by the zygote (the first module of :data:`rrfp.train.zygote.PRELOAD`), and only
there: the zygote dies with the process that started it (``PR_SET_PDEATHSIG``: SIGKILL).

multiprocessing's forkserver otherwise leaves when the pipe from its client closes, then runs
Python's exit, which tears down torch's 2000 modules (0.6 s of CPU, tens of seconds on a loaded
machine) while the ranks it forked, which die with it, train on after their launcher was
SIGKILLed. Killed by the kernel the moment the launcher exits, the zygote takes its ranks with
it at once and costs nothing to end. The launcher names itself in ``RRFP_LAUNCHER_PID``: a
launcher that died before this module ran leaves the zygote an orphan, which exits here.
"""

from __future__ import annotations

import os
import signal

from .._pdeathsig import LAUNCHER_PID_ENV, set_parent_death_signal

set_parent_death_signal(signal.SIGKILL)
if os.environ.get(LAUNCHER_PID_ENV, "").isdigit() and os.getppid() != int(os.environ[LAUNCHER_PID_ENV]):
    os._exit(128 + signal.SIGKILL)
