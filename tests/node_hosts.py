"""Two "hosts" of the ``rrfp node`` tests on this machine: two loopback addresses, and the
environment a daemon starts with (nothing of a launcher or a test's crash hooks inherited)."""

from __future__ import annotations

import os
import socket

import pytest

ADDRS = ("127.0.0.2", "127.0.0.3")


def bindable(addr: str) -> bool:
    """Whether a TCP socket can bind ``addr`` here."""
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


needs_loopback = pytest.mark.skipif(not all(bindable(a) for a in ADDRS), reason="127.0.0.2/3 not bindable here")


def node_env(**extra: str) -> dict:
    """This process's environment for a daemon or a rank: one thread, unbuffered, without the
    launcher's and the node's variables or the checkpoint tests' crash and hold hooks; plus
    ``extra``."""
    from rrfp.train import checkpoint as ck

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK",
              ck.CRASH_ENV, "RRFP_TEST_HOLD_AFTER_STEP", "JOB_COMPLETION_INDEX"):
        env.pop(k, None)
    env.update(extra)
    return env
