"""A child process whose output lines a thread collects, for tests that wait on lines a
process prints (an event) rather than on time."""

from __future__ import annotations

import subprocess
import threading
import time


class Proc:
    """A child process whose output lines are collected by a thread; :meth:`wait_for` blocks
    until a line containing a text appears (or the process ends)."""

    def __init__(self, argv: list[str], env: dict, new_session: bool = False) -> None:
        # new_session: a process group of its own, for a test that signals the whole group (os.killpg).
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=new_session)
        self.lines: list[str] = []
        self.times: list[float] = []
        self.cond = threading.Condition()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.times.append(time.monotonic())
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hit = next((ln for ln in self.lines if text in ln), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self.t.is_alive()):
                    raise AssertionError(f"no line with {text!r}; output:\n" + self.output())
                self.cond.wait(left)

    def finish(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(f"still running after {timeout} s; output:\n" + self.output()) from None
        self.t.join(5)
        return rc

    def output(self) -> str:
        t0 = self.times[0] if self.times else 0.0
        return "\n".join(f"{t - t0:7.2f} {ln}" for t, ln in zip(self.times, self.lines))

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    from pathlib import Path

    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - found
        found |= frontier
    return found


def rank_pids(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the ranks an ``rrfp train`` launcher started: its descendants named
    ``rrfp rank N`` (``/proc/<pid>/comm``, set by rrfp/train/zygote.py in each forked rank).
    Not their environment or command line: a rank forked from the zygote shows the zygote's."""
    from pathlib import Path

    found = {}
    for pid in descendants(launcher):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # gone already
            continue
        if name.startswith("rrfp rank "):
            found[int(name.removeprefix("rrfp rank "))] = pid
    return found
