"""Executors (rrfp.runtime.engine.executor, rrfp.runtime.engine.cuda): the worker thread keeps the loop
answering during a long task; the CUDA executor's launch-ahead window and event polling with
fake events (CPU), and on a real GPU when there is one."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch import nn

from reference import reference_run
from rrfp.model.toy import ToyConfig, ToyModel, split_toy, toy_batch, toy_loss
from rrfp.runtime.engine.cuda import CudaExecutor, no_stream
from rrfp.runtime.engine.executor import InlineExecutor, ThreadExecutor, make_executor
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.runtime.doors.compat import split_microbatches
from rrfp.scheduler.tasks import F, Task
from rrfp.transport.keys import Direction

RTOL, ATOL = 1e-5, 1e-6
HAS_CUDA = torch.cuda.is_available()


def _reference(cfg, seed, x, y) -> dict[str, torch.Tensor]:
    return reference_run(ToyModel(cfg, seed=seed), lambda m: toy_loss(m(*x), y))[1]


def _assert_grads(stages, ref) -> None:
    for st in stages:
        inner = getattr(st, "inner", st)
        for name, p in inner.named_parameters():
            full = inner.stage_param_names[name]
            torch.testing.assert_close(p.grad.cpu(), ref[full], rtol=RTOL, atol=ATOL, msg=lambda m: f"{full}: {m}")


class FirstForwardCalls(nn.Module):
    """A stage whose first forward calls ``hook()`` before computing."""

    def __init__(self, inner: nn.Module, hook) -> None:
        super().__init__()
        self.inner, self.hook, self.fired = inner, hook, False

    def forward(self, *args):
        if not self.fired:
            self.fired = True
            self.hook()
        return self.inner(*args)


@pytest.mark.parametrize("executor, task_s", [("thread", 120.0), ("inline", 0.2)])
def test_a_control_message_is_answered_during_a_long_task_with_the_thread_executor(executor, task_s):
    """Rank 0's first forward blocks its thread until rank 0 has answered a control message
    (a threading.Event set by the answer), at most ``task_s``. Once the task has provably
    started (the task itself triggers it), rank 1 sends rank 0 the message, which a coroutine
    on rank 0 answers. With the thread executor the loop answers while the task still blocks,
    which ends the task: ``task_s`` is only a deadline for a hang. Inline, the task blocks the
    loop itself, so the answer can only come after the task gave up waiting for it. No clock
    decides the outcome (the executor's latency is measured in benchmarks/bench_executor.py).
    The step's gradients equal the single-process reference either way."""
    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)
    mods = split_toy(ToyModel(cfg, seed=2), 2)
    replied = threading.Event()
    task_over = threading.Event()
    seen: dict[str, bool] = {}

    def long_task() -> None:  # on rank 0's task thread (thread) or the loop thread (inline)
        loop.call_soon_threadsafe(ping)
        seen["answered during the task"] = replied.wait(task_s)
        task_over.set()

    mods[0] = FirstForwardCalls(mods[0], long_task)
    pipe = LocalPipeline(mods, 4, toy_loss, executor=executor, watchdog=task_s + 60)
    loop = pipe._loop
    rt0, rt1 = pipe.runtimes
    assert isinstance(rt0.executor, ThreadExecutor if executor == "thread" else InlineExecutor)

    def ping() -> None:
        rt1.send_control(0, 0, {"ping": 1})

    async def answer() -> None:
        msg = await rt0.control(timeout=task_s + 60)
        rt0.send_control(1, 0, {"pong": msg.meta["ping"]})
        seen["task running at reply"] = not task_over.is_set()
        replied.set()

    async def main():
        responder = asyncio.ensure_future(answer())
        mbs = split_microbatches(x, 4)
        tgs = [t[0] for t in split_microbatches([y], 4, "target")]
        await asyncio.gather(rt0.run_step(0, mbs, None), rt1.run_step(0, None, tgs), responder)
        return (await rt1.control(timeout=60)).meta

    with pipe:
        pong = loop.run_until_complete(main())
    assert pong == {"pong": 1}
    if executor == "thread":
        assert seen == {"answered during the task": True, "task running at reply": True}
    else:  # inline: the loop answers after the task
        assert seen == {"answered during the task": False, "task running at reply": False}
    _assert_grads(mods, _reference(cfg, 2, x, y))


@pytest.mark.parametrize("hint, n_virtual, deterministic", [("bfw", 2, False), ("strict-1f1b", 1, True)])
def test_the_thread_executor_matches_the_reference(hint, n_virtual, deterministic):
    """Split backward (its weight-gradient store), virtual stages and deterministic
    accumulation all run on the worker thread; gradients equal the single-process model's."""
    cfg = ToyConfig(n_layer=4)
    x, y = toy_batch(cfg, 8, seed=7)
    mods = split_toy(ToyModel(cfg, seed=8), 2 * n_virtual)
    with LocalPipeline(mods, 4, toy_loss, hint=hint, n_virtual=n_virtual, executor="thread", delay=(0.0, 0.001),
                       deterministic=deterministic, watchdog=30) as pipe:
        pipe.step(*x, target=y)
    _assert_grads(mods, _reference(cfg, 8, x, y))


def _autocast_step(executor: str, autocast: bool):
    """One step of a two-rank pipeline of Linear stages (same weights each call), optionally
    under a CPU bf16 autocast around ``step()``: its merged outputs and its gradients."""
    torch.manual_seed(3)
    mods = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)), torch.zeros(8, 16)
    loss = lambda out, target: ((out.float() - target) ** 2).mean()  # noqa: E731
    with LocalPipeline(mods, 4, loss, hint="strict-1f1b", executor=executor, deterministic=True, watchdog=30) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = pipe.step(x, target=y, return_outputs=True)
    return out, [p.grad.clone() for m in mods for p in m.parameters()]


def test_an_autocast_around_step_holds_on_the_thread_executor():
    """Autocast is thread-local; the thread executor re-enters the caller's on its worker
    (rrfp/runtime/engine/autocast.py), so its outputs and gradients are the inline executor's
    under the same autocast, bit for bit, and not the float32 ones."""
    out_inline, g_inline = _autocast_step("inline", True)
    out_thread, g_thread = _autocast_step("thread", True)
    out_fp32, _ = _autocast_step("thread", False)
    assert out_inline.dtype == out_thread.dtype == torch.bfloat16 and out_fp32.dtype == torch.float32
    assert torch.equal(out_thread, out_inline)
    assert all(torch.equal(a, b) for a, b in zip(g_thread, g_inline))
    assert not torch.equal(out_thread.float(), out_fp32)
    torch.testing.assert_close(out_thread.float(), out_fp32, rtol=0.05, atol=0.02)  # bf16 of the same model
    assert not torch.is_autocast_enabled("cpu")  # the caller's state is its own again


def test_a_task_error_on_the_worker_thread_fails_the_step():
    cfg = ToyConfig()
    x, y = toy_batch(cfg, 8, seed=1)
    mods = split_toy(ToyModel(cfg, seed=2), 2)

    def boom():
        raise RuntimeError("stage 0 exploded")

    mods[0] = FirstForwardCalls(mods[0], boom)
    with LocalPipeline(mods, 4, toy_loss, executor="thread", watchdog=30) as pipe:
        with pytest.raises(RuntimeError, match="stage 0 exploded"):
            pipe.step(*x, target=y)


# ------------------------------------------------------------------ CUDA executor, faked


class FakeEvent:
    """Fires after ``latency`` queries: a device that takes a fixed number of loop turns."""

    log: list

    def __init__(self, latency: int, log: list) -> None:
        self.left, self.log, self.recorded = latency, log, False

    def record(self, stream) -> None:
        self.recorded = True

    def query(self) -> bool:
        assert self.recorded
        self.left -= 1
        return self.left < 0


class Watched(CudaExecutor):
    """A CudaExecutor on fakes that tracks how many tasks are launched and not done."""

    def __init__(self, window: int, latency: int) -> None:
        self.events: list[FakeEvent] = []
        self.most_pending = 0
        super().__init__(torch.device("cpu"), window=window, stream=object(), stream_context=no_stream,
                         new_event=self._event)
        self._latency = latency

    def _event(self) -> FakeEvent:
        ev = FakeEvent(self._latency, [])
        self.events.append(ev)
        return ev

    def launch(self, task, run_fn):
        p = super().launch(task, run_fn)
        self.most_pending = max(self.most_pending, self.pending)
        return p


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("hint, n_virtual", [("bf", 1), ("bfw", 2), ("strict-1f1b", 1)])
def test_cuda_executor_window_and_polling_with_fake_events(window, hint, n_virtual):
    """Each fake event fires on its 4th query. With window 1 no rank ever has two tasks launched
    and not done; with window 2 some rank does (the host runs ahead of the 'device'), and never
    three. Polling stops once nothing is pending. Gradients equal the reference."""
    cfg = ToyConfig(n_layer=4)
    x, y = toy_batch(cfg, 8, seed=3)
    mods = split_toy(ToyModel(cfg, seed=4), 2 * n_virtual)
    pipe = LocalPipeline(mods, 4, toy_loss, hint=hint, n_virtual=n_virtual, delay=(0.0, 0.001), watchdog=30)
    execs = []
    for rt in pipe.runtimes:  # swap in the faked CUDA executor (the runtime's parts follow it)
        ex = Watched(window, latency=3)
        ex.bind(rt.inbox.wake.set)
        rt.executor = rt.loop.executor = ex
        execs.append(ex)
    with pipe:
        for _ in range(2):
            for m in mods:
                m.zero_grad()
            pipe.step(*x, target=y)
        for ex in execs:
            assert ex.pending == 0 and ex._timer is None  # nothing pending: no polling callback
            assert all(not e.left >= 0 for e in ex.events)  # every event fired before the step ended
    assert max(ex.most_pending for ex in execs) == window
    assert sum(len(ex.events) for ex in execs) == 2 * 2 * (3 if hint == "bfw" else 2) * 4 * n_virtual
    _assert_grads(mods, _reference(cfg, 4, x, y))


def test_cuda_executor_polls_only_while_a_task_is_pending_and_in_launch_order():
    """Unit view: two launches under window 2; the wake call comes when the oldest event fires;
    a younger event that fired first is not reported before the older one (one stream)."""
    ex = CudaExecutor(torch.device("cpu"), window=2, stream=object(), stream_context=no_stream,
                      new_event=lambda: FakeEvent(0, []))
    wakes = []
    ex.bind(lambda: wakes.append(1))

    async def main():
        a = ex.launch(Task(0, F, 0), lambda t: ["out a"])
        b = ex.launch(Task(0, F, 1), lambda t: [])
        a.handle.left = 2  # the older one takes longer
        assert a.launched and b.launched and not a.done and not b.done and ex._timer is not None
        for _ in range(2):
            await asyncio.sleep(0)
        assert not a.done and not b.done and not wakes  # b's event fired, but a's has not
        await asyncio.sleep(0)
        assert a.done and b.done and wakes == [1] and a.outputs == ["out a"]
        await asyncio.sleep(0)
        assert ex._timer is None and ex.pending == 0
        ex.release(a)
        assert a.handle is None

    asyncio.run(main())


def test_make_executor_names_and_errors():
    assert isinstance(make_executor("auto", "cpu"), InlineExecutor)
    assert isinstance(make_executor("thread"), ThreadExecutor)
    with pytest.raises(ValueError, match="executor 'cuda' on device 'cpu': expected a CUDA device"):
        make_executor("cuda", "cpu")
    with pytest.raises(ValueError, match="executor 'gpu': expected one of auto, inline, thread, cuda"):
        make_executor("gpu")
    with pytest.raises(ValueError, match="launch-ahead window 3: expected 1 or 2"):
        CudaExecutor(window=3, stream=object(), new_event=object)


# ------------------------------------------------------------------ CUDA executor, real


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("hint, n_virtual", [("bf", 1), ("bfw", 2)])
def test_cuda_local_pipeline_one_stream_per_rank_matches_the_reference(window, hint, n_virtual):
    """4 ranks on one GPU, each its own stream, messages through the codec (host memory, as
    over ZeroMQ): loss and gradients equal the single-process CPU reference."""
    cfg = ToyConfig(n_layer=8)
    x, y = toy_batch(cfg, 16, seed=5)
    mods = split_toy(ToyModel(cfg, seed=6), 4 * n_virtual)
    with LocalPipeline(mods, 8, toy_loss, hint=hint, n_virtual=n_virtual, device="cuda", launch_ahead=window,
                       watchdog=60) as pipe:
        streams = {id(rt.executor.stream) for rt in pipe.runtimes}
        assert len(streams) == 4 and all(rt.executor.name == "cuda" for rt in pipe.runtimes)
        pipe.step(*x, target=y)
        torch.cuda.synchronize()
    _assert_grads(mods, _reference(cfg, 6, x, y))


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_copies_keep_requires_grad_and_values():
    ex = CudaExecutor(torch.device("cuda"))
    src = [torch.randn(3, 4, requires_grad=True), None, torch.arange(5)]
    dev = ex.to_device(torch.device("cuda"), src)
    assert dev[0].is_cuda and dev[0].requires_grad and dev[1] is None and dev[2].dtype == torch.int64
    host, ev = ex.to_host(dev)
    while not ev.query():
        pass
    assert host[0].is_pinned() and host[0].requires_grad and torch.equal(host[0].detach(), src[0].detach())
    assert torch.equal(host[2], src[2])


# ------------------------------------------------------------------ flags and the GPU check


@pytest.mark.parametrize("argv, needle", [
    (["--executor", "cuda", "--device", "cpu"], "--executor cuda: needs --device cuda (this run computes on the cpu)"),
    (["--launch-ahead", "3"], "--launch-ahead=3: expected 1 or 2"),
    pytest.param(["--device", "cuda"], "--device cuda: torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")),
])
def test_device_flags_refuse_what_this_machine_cannot_do(argv, needle, capsys, monkeypatch):
    from rrfp.cli import main

    monkeypatch.setattr("rrfp.train.cli.launch", lambda *a, **k: pytest.fail("a process was launched"))
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rrfp train: error: ") and needle in err[0], err


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_77(capsys):
    from rrfp.gpu_check import EXIT_NO_CUDA, main

    assert main([]) == EXIT_NO_CUDA == 77
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]


# ------------------------------------------------------------------ outbox with device tensors


class RecordingTransport:
    def __init__(self, device_tensors: bool) -> None:
        self.device_tensors, self.sent, self.flushed = device_tensors, [], 0

    def send(self, dst, key, tensors, meta=None):
        self.sent.append((dst, key.microbatch, list(tensors)))

    async def flush(self):
        self.flushed += 1


class Gate:
    """A fake event the test fires."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired


@pytest.mark.parametrize("device_tensors", [True, False], ids=["device data plane", "host data plane"])
def test_outbox_sends_device_tensors_only_after_their_event_in_send_order(device_tensors):
    """Device tensors (here on the meta device: no data, never copied) leave only once the
    executor's event fires: as they are for a device data plane, via to_host for a host one.
    A host message sent meanwhile waits behind them; flush waits for both."""
    from rrfp.runtime.engine.outbox import Outbox

    tr = RecordingTransport(device_tensors)
    gates: list[Gate] = []

    def gate():
        gates.append(Gate())
        return gates[-1]

    def to_host(tensors):
        return [None if t is None else torch.zeros(t.shape) for t in tensors], gate()

    out = Outbox(tr, "job", to_host=to_host, ready_event=gate)
    dev = torch.empty(2, 3, device="meta")

    async def main():
        out.send(1, 0, 0, 1, Direction.ACT, [dev, None])
        out.send(1, 0, 1, 1, Direction.ACT, [torch.ones(1)])  # on the host, but queued behind
        for _ in range(3):
            await asyncio.sleep(0)
        assert tr.sent == [] and len(gates) == 2
        gates[0].fired = True
        flushing = asyncio.ensure_future(out.flush())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [m for _, m, _ in tr.sent] == [0] and not flushing.done()
        gates[1].fired = True
        await asyncio.wait_for(flushing, 5)
        assert [m for _, m, _ in tr.sent] == [0, 1] and tr.flushed == 1

    from virtual_time import VirtualTimeLoop

    loop = VirtualTimeLoop()  # simulated time: the 5 s bound expires only if the flush never ends
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    first = tr.sent[0][2]
    if device_tensors:
        assert first[0] is dev and first[1] is None  # the device tensor itself
    else:
        assert first[0].device.type == "cpu" and first[0].shape == (2, 3) and first[1] is None
