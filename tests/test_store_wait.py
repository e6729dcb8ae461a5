"""rrfp.parallel.bootstrap.wait_for_keys: a wait on the job's store that a signal can end."""

from __future__ import annotations

import datetime
import signal
import sys
import threading

import pytest
import torch.distributed as dist

from rrfp.parallel.bootstrap import wait_for_keys


class Stopped(Exception):
    pass


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))


def test_keys_already_set_or_set_by_a_peer_end_the_wait(store):
    store.set("a", "1")
    wait_for_keys(store, ["a"], 5)
    t = threading.Thread(target=lambda: store.set("b", "2"))
    t.start()
    wait_for_keys(store, ["a", "b"], 30)
    t.join()
    with pytest.raises(TimeoutError, match=r"^store keys not set within 0.05 s: \['c'\]$"):
        wait_for_keys(store, ["c"], 0.05)


@pytest.mark.timeout(20)
def test_a_signal_during_the_wait_acts_at_once_not_after_the_timeout(store):
    # store.wait retries in C++ on EINTR: no Python handler ran until its timeout (here 60 s,
    # past this test's 20 s limit). The handler must run while the wait goes on.
    old = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(Stopped()))
    try:
        main = threading.main_thread().ident

        def signal_once_waiting():
            # The order forced: the signal lands while the main thread is inside the wait.
            while (f := sys._current_frames().get(main)) is None or f.f_code.co_name != "wait_for_keys":
                threading.Event().wait(0.001)
            signal.pthread_kill(main, signal.SIGUSR1)

        t = threading.Thread(target=signal_once_waiting)
        with pytest.raises(Stopped):
            t.start()
            wait_for_keys(store, ["never"], 60)
        t.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
