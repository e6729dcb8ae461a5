"""The rendezvous store of a multi-process test, bound to port 0 by the test process and
handed to the ranks it starts, as torchrun's agent does: no port is probed free and then raced
for by another process on a busy machine.

The ranks join with ``env://`` as usual; :data:`AGENT_STORE` tells torch.distributed that every
rank, rank 0 included, is a client of a store hosted elsewhere (``TORCHELASTIC_USE_AGENT_STORE``).
"""

from __future__ import annotations

AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


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


def run_ranks(target, world: int, *args, timeout_s: float) -> list[int | None]:
    """Start ``target(rank, world, port, *args)`` in ``world`` spawned processes around a
    store hosted here, wait up to ``timeout_s`` for all (a bound on hangs), kill any left.

    Returns:
        each process's exit code (None: it was killed).
    """
    import multiprocessing as mp

    store, port = host_store(world)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]
