"""``rrfp node``: the per-node daemon, one per pod. It starts this node's ranks of an
``rrfp train`` job through PyTorch's elastic agent (``elastic_launch`` with the c10d
rendezvous: torchrun's own machinery), serves one HTTP endpoint for all of them
(``/metrics``, ``/healthz``, ``/readyz``), restarts the node's ranks when one fails (the
agent's ``max_restarts``; they resume from the last checkpoint), and on SIGTERM has every
rank end the step in progress, commit a checkpoint and exit 143, as the daemon then does
(:mod:`rrfp.train.stop`); the other nodes' daemons say their peer was preempted and exit 143
too. Only a finished run exits 0.

Where the job's shape comes from, first found wins: the flags, then the environment
Kubeflow Trainer sets (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``), then a JobSet's (``JOB_COMPLETION_INDEX`` for the
node rank, ``MASTER_ADDR``, ``MASTER_PORT``), then the defaults.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import _net
from ..errors import UsageError
from ..train.stop import PREEMPTED
from .peers import DEFAULT_JOIN_TIMEOUT_S

DEFAULT_METRICS_PORT = 9400
DEFAULT_RDZV_PORT = 29500

ENV = {
    "nnodes": ("PET_NNODES",),
    "nproc_per_node": ("PET_NPROC_PER_NODE",),
    "node_rank": ("PET_NODE_RANK", "JOB_COMPLETION_INDEX"),
    "master_addr": ("PET_MASTER_ADDR", "MASTER_ADDR"),
    "master_port": ("PET_MASTER_PORT", "MASTER_PORT"),
}
"""For each setting, the environment variables read when its flag is not given, in order."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node",
        help="per-node daemon: run this node's ranks of an rrfp train job (elastic agent, c10d rendezvous)",
        description="Run this node's ranks of an `rrfp train` job under PyTorch's elastic agent, serve "
        "/metrics, /healthz and /readyz, restart failed ranks (they resume from the last checkpoint) and "
        "stop gracefully on SIGTERM (the step in progress ends, a checkpoint is committed, exit code 143; "
        "a peer node's SIGTERM also ends this node with 143; only a finished run exits 0). Arguments after "
        "`--` (or not known here) go to `rrfp train`.",
    )
    p.add_argument("--nnodes", type=int, default=None, help="nodes in the job (env PET_NNODES; default 1)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this node (env PET_NPROC_PER_NODE; default --pp / nodes)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's index, 0 hosts the rendezvous store (env PET_NODE_RANK, JOB_COMPLETION_INDEX; default 0)")
    p.add_argument("--master-addr", default=None,
                   help="host of node 0, the rendezvous endpoint (env PET_MASTER_ADDR, MASTER_ADDR; default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"rendezvous port on node 0 (env PET_MASTER_PORT, MASTER_PORT; default {DEFAULT_RDZV_PORT}); "
                   "0 on node 0: any free port, printed in its first line for the other nodes")
    p.add_argument("--node-addr", default=None,
                   help="this node's address: what it advertises in the rendezvous, what its ranks bind, and whose "
                   "interface gloo and NCCL use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME unless set); default: the "
                   "local address that routes to --master-addr")
    p.add_argument("--job-id", default=os.environ.get("RRFP_JOB_ID", "rrfp"),
                   help="rendezvous id shared by every node of the job (env RRFP_JOB_ID; default %(default)s)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of the node's ranks after a failure (default %(default)s)")
    from ..obs.server import add_flags as add_metrics_flags

    add_metrics_flags(p, "port of /metrics, /healthz and /readyz for all the node's ranks; 0: any free "
                      f"(default {DEFAULT_METRICS_PORT})", port_default=DEFAULT_METRICS_PORT)
    p.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="SEC",
                   help="/healthz fails when a running rank's liveness beat, from a thread that one long task "
                   "does not block, is older than this: the process is frozen (default %(default)s)")
    from .peers import SAY_EVERY_S

    p.add_argument("--join-timeout", type=int, default=DEFAULT_JOIN_TIMEOUT_S, metavar="SEC",
                   help="give up, exit 1, when the other nodes have not all joined the rendezvous (at the start, or "
                   f"after a restart, e.g. when a peer host vanished) within this; said every {SAY_EVERY_S:g} s "
                   "while waiting (torch's join_timeout; default %(default)s)")
    p.add_argument("--run-dir", default=None, help="the daemon's working folder (metrics files, stop file); default a temporary one")
    p.set_defaults(func=run, pass_through=True)


def _from_env(args: argparse.Namespace, name: str, default, kind=str):
    value = getattr(args, name)
    if value is not None:
        return value
    for var in ENV[name]:
        raw = os.environ.get(var)
        if raw:
            try:
                return kind(raw)
            except ValueError:
                raise UsageError(f"{var}={raw!r}: expected {'an integer' if kind is int else 'a value'}") from None
    return default


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the job's shape from flags, environment and defaults, and check the train
    arguments (:func:`rrfp.train.cli.validate`) before anything starts: every check that needs
    no torch first (:func:`rrfp.train.early.check_flags`, then this command's own flags).

    Raises:
        UsageError: one line naming the bad flag or environment variable.
    """
    from ..cli import ArgumentParser
    from ..train import cli as train_cli
    from ..train.early import check_flags, port_problem

    train_args = list(getattr(args, "extra", None) or [])
    if "--" in train_args:
        train_args.remove("--")  # the separator itself; argparse leaves it among the unknown arguments
    parser = ArgumentParser(prog="rrfp")
    train_cli.register(parser.add_subparsers(dest="command", parser_class=ArgumentParser))
    targs, extra = parser.parse_known_args(["train", *train_args])
    if extra:
        raise UsageError(f"unrecognized arguments: {' '.join(extra)} (neither rrfp node's nor rrfp train's)")
    auto_resume = targs.checkpoint_dir is not None and targs.resume is None
    if auto_resume:
        targs.resume = "auto"  # as the ranks will run (below): a checkpoint that does not fit is refused now
    check_flags(targs)
    if not args.job_id.strip():
        raise UsageError(f"--job-id={args.job_id!r}: expected a non-empty job name")
    nnodes = _from_env(args, "nnodes", 1, int)
    if nnodes < 1:
        raise UsageError(f"--nnodes={nnodes}: expected a positive integer")
    if targs.stages % nnodes:
        raise UsageError(f"--pp={targs.stages} is not a multiple of {nnodes} nodes: expected one rank per stage")
    nproc = _from_env(args, "nproc_per_node", targs.stages // nnodes, int)
    if nproc < 1 or nproc * nnodes != targs.stages:
        raise UsageError(f"--nproc-per-node={nproc} x {nnodes} nodes != --pp={targs.stages}: "
                         "expected one rank per pipeline stage")
    node_rank = _from_env(args, "node_rank", 0, int)
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank={node_rank}: expected 0..{nnodes - 1}")
    port = _from_env(args, "master_port", DEFAULT_RDZV_PORT, int)
    if not (0 if node_rank == 0 else 1) <= port <= 65535:
        raise UsageError(f"--master-port={port}: expected a port in 1..65535 (0, any free port, on node 0 only)")
    for name in ("max_restarts",):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected 0 or more")
    from ..obs.server import check_flags as check_metrics_flags

    problem = check_metrics_flags(args, allow_any_port=True)
    if problem:
        raise UsageError(problem)
    join_timeout = getattr(args, "join_timeout", DEFAULT_JOIN_TIMEOUT_S)
    if join_timeout < 1:
        raise UsageError(f"--join-timeout={join_timeout}: expected a positive number of seconds")
    if not args.heartbeat_timeout > 0:
        raise UsageError(f"--heartbeat-timeout={args.heartbeat_timeout}: expected a positive number of seconds")
    if args.metrics_port and (problem := port_problem(args.metrics_addr, args.metrics_port, 1,
                                                      f"--metrics-port={args.metrics_port}")):
        raise UsageError(problem)
    master_addr = _from_env(args, "master_addr", "127.0.0.1")
    _check_host(master_addr, _source(args, "master_addr"))
    if getattr(args, "node_addr", None) is not None:
        _check_host(args.node_addr, "--node-addr")
        node_addr = _resolve(args.node_addr, port, "--node-addr")
        if _net.interface_of(node_addr) is None:
            raise UsageError(f"--node-addr={args.node_addr!r}: no interface of this host has address {node_addr}")
    else:
        node_addr = None  # found in run(): node 0's name may resolve only once its pod runs
    train_cli.validate(targs)  # the checks that need torch
    spec, what = train_cli.port_range(targs)
    if problem := _net.port_range_problem(spec, nproc, what):  # each local rank binds one port
        raise UsageError(problem)
    if auto_resume:
        train_args += ["--resume", "auto"]  # a restarted group continues from the last checkpoint
    if getattr(args, "run_dir", None) is not None:
        _check_run_dir(args.run_dir)  # last: it makes the folder
    return argparse.Namespace(
        nnodes=nnodes, nproc=nproc, node_rank=node_rank, port=port, train_args=train_args, targs=targs,
        master_addr=master_addr, node_addr=node_addr, join_timeout=join_timeout,
    )


def _source(args: argparse.Namespace, name: str) -> str:
    """Where a setting of :data:`ENV` came from, for an error line: its flag or the variable."""
    flag = "--" + name.replace("_", "-")
    if getattr(args, name) is not None:
        return flag
    return next((var for var in ENV[name] if os.environ.get(var)), flag)


HOST_NAME = re.compile(r"[\w.-]+")
"""A host name as the elastic agent's endpoint parser takes one (letters, digits, ``_``, ``-``
and dots; torch's ``parse_rendezvous_endpoint``)."""


def _check_host(host: str, what: str) -> None:
    """Refuse a host the elastic agent would reject with a traceback, before torch loads: an
    IPv4 or IPv6 address, or a name of :data:`HOST_NAME`'s characters.

    Raises:
        UsageError: one line naming the flag (or variable) and the value.
    """
    if host.replace(".", "").isdigit():  # dotted digits are an IPv4 address or nothing, never a name to look up
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise UsageError(f"{what}={host!r}: not an IPv4 address (four numbers 0-255)") from None
        return
    try:
        ipaddress.ip_address(host)
        if "%" not in host:  # a scoped IPv6 address (fe80::1%eth0): the agent's parser refuses the zone
            return
    except ValueError:
        if HOST_NAME.fullmatch(host):
            return
    raise UsageError(f"{what}={host!r}: expected a host name, an IPv4 address or an IPv6 address")


def _host_rendezvous_store(addr: str):
    """``(store, port)``: a TCPStore server for the c10d rendezvous on a port the OS picks
    (``--master-port 0`` on node 0), as the agent would host it on a fixed port; it lives as
    long as the daemon keeps the reference. No port is probed free and then raced for."""
    from torch.distributed import TCPStore

    store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return store, store.port


def _resolve(host: str, port: int, what: str) -> str:
    """``host``'s first address (an address is returned as it is).

    Raises:
        UsageError: one line naming the flag and the host that does not resolve.
    """
    try:
        return str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
        raise UsageError(f"{what}={host!r}: does not resolve ({e.strerror or e})") from None


def node_address(master_addr: str, port: int, wait_s: float = 60.0) -> str:
    """This node's address when ``--node-addr`` is not given: the local address that routes
    to the master (:func:`rrfp._net.route_to`). The master's name is retried for up to
    ``wait_s`` seconds: on Kubernetes node 0's DNS name appears only once its pod runs.

    Raises:
        UsageError: no route to the master within ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _net.route_to(master_addr, port)
        except OSError as e:
            if time.monotonic() > deadline:
                raise UsageError(f"--master-addr={master_addr!r}: no route from this host ({e.strerror or e}); "
                                 "give --node-addr or check the name") from None
        time.sleep(1.0)  # a DNS name not published yet: nothing to wait on but time


def _check_run_dir(path: str) -> None:
    """``--run-dir`` must be a folder this daemon can write into (made if missing).

    Raises:
        UsageError: one line naming the path and why.
    """
    from ..train.guard import check_writable_dir

    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"--run-dir={path!r}: is a file, expected a folder")
    problem = check_writable_dir(path, "--run-dir")
    if problem is not None:
        raise UsageError(problem)


def _count_restarts(on_restart, stop: threading.Event, period_s: float = 0.5) -> None:
    # The agent restarts a group by stopping every rank, then starting new ones: a set of
    # children with no pid of the previous set is a restart.
    from ..train.stop import child_pids

    before: set[int] = set()
    while not stop.wait(period_s):
        now = set(child_pids())
        if now and before and not now & before:
            on_restart()
        before = now or before


def run(args: argparse.Namespace) -> int:
    job = resolve(args)
    # One address for everything this node's ranks do across hosts (rrfp/_net.py): torch's
    # agent would advertise the host name, and gloo bind the interface it resolves to,
    # loopback in many containers and network namespaces.
    node_addr = job.node_addr or node_address(job.master_addr, job.port or DEFAULT_RDZV_PORT)
    os.environ[_net.NODE_ADDR_ENV] = node_addr
    os.environ.update(_net.socket_ifname_env(node_addr))
    from ..lines import say
    from ..obs.server import linger, serve_node
    from .health import Health

    own_dir = args.run_dir is None
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rrfp-node-"))
    metrics_dir, stop_file = _ranks_env(run_dir, job)

    from ..train.alive import ALIVE_DIR_ENV

    health = Health(str(metrics_dir), job.nproc, args.heartbeat_timeout, alive_dir=os.environ[ALIVE_DIR_ENV])
    try:
        endpoint = serve_node(metrics_dir, args.metrics_addr, args.metrics_port,
                              routes={"/healthz": health.healthz, "/readyz": health.readyz})
    except OSError as e:
        raise UsageError(f"--metrics-addr/--metrics-port: {e}") from None
    rdzv_port, rdzv_store = job.port, None
    if job.port == 0:  # node 0 only (resolve): the OS picks the port, and this line tells it
        rdzv_store, rdzv_port = _host_rendezvous_store(job.master_addr)
    from ..train.ckpt_lock import FolderInUse, hold

    try:  # one job: the same id and rendezvous on every node, and for a replaced pod
        lease = hold(job.targs, f"{args.job_id}@{job.master_addr}:{rdzv_port}")
    except FolderInUse as e:
        endpoint.close()
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise UsageError(str(e)) from None
    from ..obs.metrics import NodeMetrics

    node_metrics = NodeMetrics(job.node_rank, endpoint.registry)
    watching = threading.Event()
    threading.Thread(target=_count_restarts, args=(node_metrics.restarts.labels(str(job.node_rank)).inc, watching),
                     name="rrfp-node-restarts", daemon=True).start()
    say(f"rrfp node: node {job.node_rank} of {job.nnodes} at {node_addr}, {job.nproc} ranks, rendezvous "
        f"{job.master_addr}:{rdzv_port} ({args.job_id}); serving http://{endpoint.addr}:{endpoint.port} "
        "(/metrics /healthz /readyz)")

    from ..train.stop import StopForwarder

    then = ", commit a checkpoint" if job.targs.checkpoint_dir else ""
    stop = StopForwarder(stop_file, f"rrfp node: SIGTERM: asking the ranks to end the step in progress{then} and exit "
                         f"{PREEMPTED}; ranks still starting are stopped, none is restarted",
                         on_request=lambda: setattr(health, "stopping", True))
    signal.signal(signal.SIGTERM, stop)
    config = _launch_config(args, job, rdzv_port, hosts_store=rdzv_store is not None, node_addr=node_addr)
    code = None  # an exception out of _launch: no linger
    waiting = _rendezvous_wait(job, f"{job.master_addr}:{rdzv_port} ({args.job_id})", say)
    try:
        code = _launch(config, job, stop, waiting.stop)
    finally:
        waiting.stop()
        watching.set()
        if code == 0:
            # The last scrape sees the last step. The stop handler stays until linger's own is
            # in (the default between them killed a daemon that a SIGTERM right after "done"
            # reached, -15 instead of 0), and a SIGTERM it took after that line ends the linger
            # at once (it waited the whole --metrics-linger).
            linger(args.metrics_linger, ended=lambda: stop.requested)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        endpoint.close()
        if lease is not None:
            lease.release()
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _launch_config(args: argparse.Namespace, job, rdzv_port: int, hosts_store: bool, node_addr: str):
    """torch's ``LaunchConfig`` for this node's agent; ``hosts_store``: this daemon already
    hosts the rendezvous store (node 0 on an OS-picked port), so its agent joins as a client."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=job.nnodes, max_nodes=job.nnodes, nproc_per_node=job.nproc, run_id=args.job_id,
        rdzv_backend="c10d", rdzv_endpoint=f"{job.master_addr}:{rdzv_port}",
        rdzv_configs={"is_host": job.node_rank == 0 and not hosts_store, "join_timeout": job.join_timeout},
        max_restarts=args.max_restarts, monitor_interval=0.5,
        local_addr=node_addr,
        # SIGTERM stays the daemon's own (run): the agent would forward it as "die now".
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )


def _rendezvous_wait(job, rendezvous: str, say):
    """The lines that say what this node waits for while no rank of it runs (rrfp/node/peers.py),
    started only with more than one node: alone, a node never waits for another."""
    from ..train.stop import child_pids
    from .peers import RendezvousWait

    waiting = RendezvousWait(lambda: bool(child_pids()), rendezvous, job.nnodes, job.join_timeout, say)
    if job.nnodes > 1:
        waiting.start()
    return waiting


def _ranks_env(run_dir: Path, job) -> tuple[Path, Path]:
    """The environment the ranks inherit: their metrics folder and stop file in ``run_dir``
    (returned, emptied), their liveness folder, thread count and rendezvous store settings."""
    from ..obs.metrics import clear_multiprocess_dir
    from ..train.stop import STOP_FILE_ENV

    metrics_dir = run_dir / "metrics"
    clear_multiprocess_dir(metrics_dir)  # a previous job's values are not this one's
    stop_file = run_dir / "stop-requested"
    stop_file.unlink(missing_ok=True)
    from ..train.alive import ALIVE_DIR_ENV

    alive = run_dir / "alive"  # the ranks' liveness beats (rrfp/train/alive.py), for /healthz
    shutil.rmtree(alive, ignore_errors=True)
    alive.mkdir()
    os.environ[ALIVE_DIR_ENV] = str(alive)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    os.environ[STOP_FILE_ENV] = str(stop_file)
    os.environ.setdefault("OMP_NUM_THREADS", str(job.targs.threads))
    # A fresh worker store per rendezvous round (rank 0 of each round hosts it). The agent's
    # shared store keeps the previous round's keys, and restarted ranks that start at
    # different times read a dead peer's gloo address from them ("connection refused").
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return metrics_dir, stop_file


def _launch(config, job, stop, quiet) -> int:
    """Run the job's ranks under torch's elastic agent; returns the daemon's exit code after
    one line on how it ended: 0 when training finished, :data:`~rrfp.train.stop.PREEMPTED`
    when it stopped on this daemon's SIGTERM or a peer node's (``stop``, a
    :class:`~rrfp.train.stop.StopForwarder`), 1 on a failure. ``quiet`` (no arguments) ends the
    rendezvous-wait lines; it returns once none can follow, before that last line is said."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    from ..lines import say
    from ..train.cli import _quiet_launcher_logs, describe_failures
    from ..train.guard import LauncherSignals
    from ..train.stop import finished_line, stopped_line
    from .sigterm import no_restart_after

    ckdir = job.targs.checkpoint_dir
    signalled = LauncherSignals()  # which ranks the agent stopped, so blame skips them
    _quiet_launcher_logs(signalled)

    # Every rank of this node finished: the agent waits in its exit barrier for the other
    # nodes' agents, no rank runs, and a SIGTERM ends that wait (the forwarder raises torch's
    # SignalException) as a finished run, exit 0 (it was a stop that committed nothing, 143).
    over = threading.Event()
    stop.finished = over.is_set
    try:
        with no_restart_after(lambda: stop.requested or stop.stop_file.exists(), on_success=over.set):
            try:
                elastic_launch(config, sys.executable)("-m", "rrfp", "train", *job.train_args)
            finally:
                stop.ended = True
                quiet()  # the last line is the last: no "waiting ... giving up in 0 s" after it
        say(finished_line("rrfp node", "SIGTERM", ckdir) if stop.requested else "rrfp node: done")
        return 0
    except (ChildFailedError, SignalException) as e:
        if isinstance(e, SignalException) and stop.after_training:
            say(finished_line("rrfp node", "SIGTERM", ckdir))
            return 0
        if stop.requested or stop.peer_asked():
            why = "on SIGTERM" if stop.requested else "because a peer node was preempted (SIGTERM)"
            line, clean = stopped_line("rrfp node", why, getattr(e, "failures", {}), ckdir,
                                       without_ranks=isinstance(e, SignalException) and stop.without_ranks)
            say(line, None if clean else sys.stderr)
            return PREEMPTED
        if isinstance(e, ChildFailedError):
            say(f"rrfp node: error: {describe_failures(e.failures, signalled.pids, (job.targs.dp, job.targs.tp))}", sys.stderr)
            return 1
        say(f"rrfp node: stopped by {signal.Signals(e.sigval).name}; the ranks were stopped too", sys.stderr)
        return 128 + int(e.sigval)
    except RendezvousTimeoutError:  # torch's says nothing more
        say(f"rrfp node: error: not every node of the {job.nnodes} joined the rendezvous within --join-timeout "
            f"{config.rdzv_configs['join_timeout']} s (a peer host gone?); giving up", sys.stderr)
        return 1
    except (RendezvousError, RuntimeError, OSError) as e:  # a lost store and the like: one line
        say(f"rrfp node: error: {type(e).__name__}: {e}", sys.stderr)
        return 1
