"""Whether :func:`rrfp.obs.server.linger` waited on after a signal had come, without waiting:
its event replaced by one whose waits return at once, each noting whether the event was set
then. A wait on an unset event is the linger running on as if no signal had come."""

from __future__ import annotations

import sys
import threading
import types


class Recorded(threading.Event):
    """An event whose waits in ``linger`` never block; :attr:`waits` notes, per such wait,
    whether it was set. The module's other events (its servers' start) wait as usual."""

    waits: list[bool] = []

    def wait(self, timeout=None):
        if sys._getframe(1).f_code.co_name != "linger":
            return super().wait(timeout)
        Recorded.waits.append(self.is_set())
        return super().wait(0)


def record_linger_waits(monkeypatch) -> list[bool]:
    """Give :mod:`rrfp.obs.server` the recording event (for this test only); returns the list
    the waits are noted in (True: the event was set)."""
    import rrfp.obs.server as server

    Recorded.waits = []
    monkeypatch.setattr(server, "threading", types.SimpleNamespace(**{**vars(threading), "Event": Recorded}))
    return Recorded.waits
