"""Die with the launcher: ``PR_SET_PDEATHSIG`` from a rank's first lines.

Imported by ``rrfp/__main__.py`` before anything heavy (torch takes seconds to import, and a
launcher SIGKILLed meanwhile would otherwise leave ranks running for minutes). Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys

LAUNCHER_PID_ENV = "RRFP_LAUNCHER_PID"
"""Set by ``rrfp train`` to its own pid, so a rank can tell whether its launcher already died."""
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, *, launched_only: bool = True) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only).

    The parent may have died before the call (the race the check closes): then the process
    has been reparented, and it exits at once with status 128 + ``sig``. Returns True when
    the signal is set. With ``launched_only``, only inside a launched rank (``LOCAL_RANK``
    set): a user's own shell is never the parent that matters; a worker process pool passes
    False.
    """
    if not sys.platform.startswith("linux") or (launched_only and "LOCAL_RANK" not in os.environ):
        return False
    if not set_parent_death_signal(sig):
        return False
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    ppid = os.getppid()
    if (expected.isdigit() and ppid != int(expected)) or ppid == 1:
        os._exit(128 + int(sig))
    return True


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` for this process (kept across ``exec``); True when set,
    False where Linux's prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
