"""Run a command as a child subreaper, so a test learns how its orphaned grandchildren died.

``python tests/reaper.py CMD...``: sets ``PR_SET_CHILD_SUBREAPER`` (Linux), prints
``launched PID`` (the command's pid) on stdout, starts the command (which shares the
reaper's stdout), then reads one line from stdin: the pids to wait for, comma-separated.
Processes orphaned by the command's death are re-parented to the reaper rather than to init,
so it can ``wait`` for them: once every listed pid is reaped it prints ``reaped {json}``, a map
from pid to ``"signal N"`` or ``"exit N"``, and exits. A test so asserts *how* a process died
(which signal), not how fast, which a loaded machine would decide.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"reaper: prctl failed: errno {ctypes.get_errno()}", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    print(f"launched {child.pid}", flush=True)
    wanted = {int(p) for p in sys.stdin.readline().split(",") if p.strip()}
    how: dict[int, str] = {}
    while not wanted <= how.keys():
        try:
            pid, status = os.wait()
        except ChildProcessError:  # nothing left to wait for: a listed pid was never ours
            break
        how[pid] = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
    print("reaped " + json.dumps({str(p): how.get(p, "not reaped") for p in sorted(wanted)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
