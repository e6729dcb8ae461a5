"""The rendezvous store of a multi-process test, bound to port 0 by the test process and
handed to the ranks it starts, as torchrun's agent does: no port is probed free and then raced
for by another process on a busy machine; and the processes themselves, forked from the test
session's zygote (:func:`process`).

The ranks join with ``env://`` as usual; :data:`AGENT_STORE` tells torch.distributed that every
rank, rank 0 included, is a client of a store hosted elsewhere (``TORCHELASTIC_USE_AGENT_STORE``).
"""

from __future__ import annotations

import os
import time

AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}

PRELOAD = ["pytest", "hypothesis", "msgpack", "rrfp.runtime.doors.local", "torch.distributed.pipelining", "handover",
           "reference"]
"""What the tests' processes import beyond ``rrfp train``'s ranks (rrfp/train/zygote.py's PRELOAD)."""


def context():
    """multiprocessing's ``forkserver`` context of this test session: a process is a fork of
    one server that imported torch and rrfp once (rrfp/train/zygote.py's preload and
    :data:`PRELOAD`), not a fresh interpreter importing them again (``spawn``: 2-3 s of CPU
    each). Use :func:`process`, which hands the child the test's environment."""
    import multiprocessing as mp

    from rrfp.train.zygote import PRELOAD as RANKS

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANKS + PRELOAD)
    return ctx


class _InEnv:
    """A process's target run in the environment of the test that started it (the server's
    own is the one of the test that happened to start it), dying with the server."""

    def __init__(self, target, env: dict[str, str]) -> None:
        self.target, self.env = target, env

    def __call__(self, *args, **kwargs):
        from rrfp._pdeathsig import set_parent_death_signal
        from rrfp.train.zygote import release_server_pipe

        release_server_pipe()  # so that the server ends with the test session,
        set_parent_death_signal()  # and so do its forks
        os.environ.clear()
        os.environ.update(self.env)
        return self.target(*args, **kwargs)


def process(target, *args, env: dict[str, str] | None = None, **kwargs):
    """A not yet started process of :func:`context` running ``target(*args)`` in this
    process's environment updated with ``env``; ``kwargs`` go to ``Process`` (``daemon``)."""
    return context().Process(target=_InEnv(target, {**os.environ, **(env or {})}), args=args, **kwargs)


def host_store(world: int):
    """A TCPStore server on a port the OS picked; keep it referenced while the ranks run.

    Returns:
        ``(store, port)``.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    return store, store.port


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` joining the store on ``port``."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            **AGENT_STORE}


def run_ranks(target, world: int, *args, timeout_s: float, env: dict[str, str] | None = None) -> list[int | None]:
    """Start ``target(rank, world, port, *args)`` in ``world`` processes (:func:`process`,
    environment updated with ``env``) around a store hosted here, wait up to ``timeout_s``
    for all (a bound on hangs), kill any left.

    Returns:
        each process's exit code (``-SIGKILL``: still running after ``timeout_s``, killed).
    """
    store, port = host_store(world)
    procs = [process(target, r, world, port, *args, env=env) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]
