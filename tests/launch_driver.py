"""``python tests/launch_driver.py STAGE SIGNAL ARGS...``: ``rrfp ARGS`` in this process, with
SIGNAL sent to this process's whole group (as Ctrl-C is) at one forced moment of the launcher
(tests/test_launcher_signals.py); exits with rrfp's exit code. Event-driven, never timed:

* ``zygote-start``: right after the zygote's process is spawned, before its first import.
* ``zygote-imports``: while the zygote imports its modules (the launcher waits for its store):
  the zygote imports :mod:`zygote_marker` (after ``rrfp.train.zygote_init``), which says so on
  the FIFO ``$MARK_READY`` and goes on once ``$MARK_GO`` is opened, after the signal.
* ``rank-fork``: once the zygote said the first rank's pid, before the launcher booked it.
* ``in-stop``: once the ranks are forked, then again as the launcher starts stopping them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def main(stage: str, signame: str, argv: list[str]) -> int:
    sig = signal.Signals[signame]

    def send() -> None:
        os.killpg(0, sig)

    if stage == "zygote-start":
        from multiprocessing import util

        spawn = util.spawnv_passfds

        def spawned(path, args, passfds):
            pid = spawn(path, args, passfds)
            if any(b"forkserver" in (a if isinstance(a, bytes) else a.encode()) for a in args):
                send()
            return pid

        util.spawnv_passfds = spawned
    elif stage == "zygote-imports":
        from rrfp.train import zygote

        zygote.PRELOAD.insert(1, "zygote_marker")

        def go() -> None:
            with open(os.environ["MARK_READY"]) as f:
                f.read()
            send()
            with open(os.environ["MARK_GO"], "w"):
                pass

        threading.Thread(target=go, daemon=True).start()
    elif stage == "rank-fork":
        from multiprocessing import forkserver

        read, pids = forkserver.read_signed, []

        def read_signed(fd):
            value = read(fd)
            pids.append(value)
            if len(pids) == 2:  # the store's pid, then the first rank's
                send()
            return value

        forkserver.read_signed = read_signed
    elif stage == "in-stop":
        from rrfp.train.zygote import LocalJob

        start, stop = LocalJob.start, LocalJob.stop

        def started(job):
            start(job)
            send()

        def stopping(job, s):
            send()
            stop(job, s)

        LocalJob.start, LocalJob.stop = started, stopping
    else:
        raise SystemExit(f"launch_driver: unknown stage {stage!r}")
    from rrfp.cli import main as rrfp

    return rrfp(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
