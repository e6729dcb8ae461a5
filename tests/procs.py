"""A child process whose output lines a thread collects, for tests that wait on lines a
process prints (an event) rather than on time."""

from __future__ import annotations

import subprocess
import threading
import time


class Proc:
    """A child process whose output lines are collected by a thread; :meth:`wait_for` blocks
    until a line containing a text appears (or the process ends)."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
