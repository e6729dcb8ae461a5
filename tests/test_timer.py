"""rrfp.runtime.engine.timer.DeadlineTimers: the inbox's hold releases (deadline order, never early)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from rrfp.runtime.doors.pipeline import new_event_loop
from rrfp.runtime.engine.timer import DeadlineTimers

pytestmark = pytest.mark.timeout(30)


def _run(coro_fn):
    loop = new_event_loop()  # uvloop where installed: the loop the runtime uses
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


@pytest.mark.parametrize("precise", [True, False], ids=["kernel-timer", "call_later"])
def test_callbacks_run_in_deadline_order_and_never_early(precise):
    async def go():
        loop = asyncio.get_running_loop()
        timers = DeadlineTimers(loop, precise=precise)
        if precise and sys.platform.startswith("linux"):
            assert timers.precise
        done = loop.create_future()
        got: list[tuple[str, float, float]] = []
        t0 = time.monotonic()
        # Added out of order, two with one deadline, one already past.
        plan = [("c", t0 + 0.006), ("a", t0 + 0.002), ("past", t0 - 1.0), ("b1", t0 + 0.004), ("b2", t0 + 0.004)]

        def fire(name: str, when: float) -> None:
            got.append((name, when, time.monotonic()))
            if len(got) == len(plan):
                done.set_result(None)

        for name, when in plan:
            timers.call_at(when, fire, name, when)
        assert len(timers) == len(plan)
        await asyncio.wait_for(done, 10)
        timers.close()
        return got

    got = _run(go)
    assert [n for n, _, _ in got] == ["past", "a", "b1", "b2", "c"]
    assert all(at >= when for _, when, at in got), got


def test_close_drops_pending_callbacks_and_frees_the_timer():
    async def go():
        loop = asyncio.get_running_loop()
        timers = DeadlineTimers(loop)
        fd = timers._tfd.fd if timers._tfd is not None else None
        fired = []
        timers.call_at(time.monotonic() + 0.001, fired.append, 1)
        timers.close()
        timers.close()  # idempotent
        with pytest.raises(RuntimeError, match="after close"):
            timers.call_at(time.monotonic(), fired.append, 2)
        # Still nothing once the deadline has passed and the loop has turned.
        later = DeadlineTimers(loop)
        seen = loop.create_future()
        later.call_at(time.monotonic() + 0.003, seen.set_result, None)
        await asyncio.wait_for(seen, 10)
        later.close()
        return fired, fd

    fired, fd = _run(go)
    assert fired == []
    if fd is not None:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (nothing else opened it in between: one thread)


def test_a_callback_may_add_an_earlier_deadline():
    """A release that adds another (the inbox admitting an early message) re-arms the timer."""
    async def go():
        loop = asyncio.get_running_loop()
        timers = DeadlineTimers(loop)
        done = loop.create_future()
        order = []

        def first() -> None:
            order.append("first")
            timers.call_at(time.monotonic() - 0.5, second)  # already due

        def second() -> None:
            order.append("second")

        def last() -> None:
            order.append("last")
            done.set_result(None)

        now = time.monotonic()
        timers.call_at(now + 0.001, first)
        timers.call_at(now + 0.004, last)
        await asyncio.wait_for(done, 10)
        timers.close()
        return order

    assert _run(go) == ["first", "second", "last"]


def _open_fds() -> list[str]:
    """What this process's open file descriptors point at (``anon_inode:[timerfd]``...)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
@pytest.mark.timeout(120)
def test_abort_frees_the_hold_timer_of_a_pipeline():
    """``Pipeline.abort`` (the error path) frees what the inbox owns: two ranks over ZeroMQ on
    loopback, rank 1's arrivals held (so its inbox makes a kernel timer), one step, then both
    aborted. A first round opens what stays open for the process (ZeroMQ's context); after
    two more rounds the process has no more descriptors than before them, and no more timerfds
    (without the fix: four more, one per aborted rank)."""
    import threading

    import torch.distributed as dist

    from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
    from rrfp.runtime.doors.pipeline import Pipeline
    from rrfp.runtime.engine.stage import PipelineStage
    from rrfp.transport.zmq import ZmqTransport

    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)

    def round_(job: str) -> int:
        mods = split_toy(ToyModel(cfg, seed=2), 2)
        store = dist.HashStore()
        pipes: list = [None, None]
        errors: list = []
        held: list = []

        def make(r: int) -> Pipeline:
            t = ZmqTransport(r, 2, store, job, host="127.0.0.1", auth=None, insecure=True)
            return Pipeline(PipelineStage(mods[r], r, 2), 4, toy_loss, rank=r, n_ranks=2, transport=t, job=job,
                            watchdog=60)

        def rank0() -> None:
            try:
                pipes[0] = make(0)
                pipes[0].step(x)
            except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
                errors.append(e)

        th = threading.Thread(target=rank0)
        th.start()
        try:
            pipes[1] = make(1)
            pipes[1].runtime.inbox.hold = lambda msg: held.append(msg.key) or 1e-4
            pipes[1].step(target=y)
        finally:
            th.join(60)
            for p in pipes:
                if p is not None:
                    p.abort()
        assert not errors, errors
        assert len(held) == 4  # one held activation per microbatch: the inbox made its timer
        return pipes[1].runtime.inbox.rejected

    assert round_("warm") == 0
    before = _open_fds()
    assert round_("a") == 0 and round_("b") == 0
    after = _open_fds()
    assert after.count("anon_inode:[timerfd]") == before.count("anon_inode:[timerfd]")
    assert len(after) <= len(before), sorted(set(after) - set(before))
