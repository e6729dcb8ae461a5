"""Two hosts: two Linux network namespaces joined by a veth pair, with addresses that exist
only inside them, and an ``rrfp node`` daemon in each, started as docs/operations.md tells an
operator ("Several hosts without Kubernetes"): no address but the master's, no hand-set
environment variable. Inside a namespace the host name resolves to that namespace's own
loopback, so the job works only if each daemon finds its address itself and its ranks (ZeroMQ,
gloo) use it.

One job, two launches, against one uninterrupted ``rrfp train`` on one node (the same flags,
``--deterministic``): the first launch trains over the ZeroMQ data plane with a job secret, a
SIGTERM to node 1's daemon stops both nodes after the step in progress with a committed
checkpoint and exit 143 (node 0's daemon: its peer was preempted); the second launch resumes over the torch (gloo) data plane and finishes. Every
step's loss equals the one-node run's bit for bit.

Skipped, with one line, where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from procs import Proc

from rrfp.train import checkpoint as ck

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

TRAIN = ["--stages", "2", "--steps", "4", "--batch-size", "8", "--microbatches", "4", "--deterministic",
         "--threads", "1", "--max-len", "64"]
RDZV_PORT = 29400  # the documented port: each namespace is a fresh network stack, so it is free
SUBNET = f"198.18.{os.getpid() % 250}"  # RFC 2544's benchmarking range: nothing routes it here
HOSTS = ("rrfp-host0", "rrfp-host1")


def _ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)


def _clean_env() -> dict:
    """This test's environment without what a launcher or an earlier test may have set: the
    daemons must find everything themselves."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NNODES", "PET_NODE_RANK",
              "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT", "JOB_COMPLETION_INDEX",
              "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RRFP_NODE_ADDR", "RRFP_JOB_SECRET", ck.CRASH_ENV,
              "RRFP_TEST_HOLD_AFTER_STEP"):
        env.pop(k, None)
    return env


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL what still runs in ``ns`` (only this test's processes run there)."""
    out = _ip("netns", "pids", ns)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def hosts():
    """``[(namespace, address)] * 2``: two namespaces joined by a veth pair; deleted (with
    every process left in them) at the end, whatever happened."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts need network namespaces: run as root with iproute2's `ip`")
    tag = f"rrfp{os.getpid()}"
    names = [f"{tag}n0", f"{tag}n1"]
    made: list[str] = []
    try:
        for ns in names:
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [
            ("link", "add", f"{tag}a", "netns", names[0], "type", "veth", "peer", "name", f"{tag}b", "netns", names[1]),
            ("-n", names[0], "addr", "add", f"{SUBNET}.1/24", "dev", f"{tag}a"),
            ("-n", names[1], "addr", "add", f"{SUBNET}.2/24", "dev", f"{tag}b"),
            *[("-n", ns, "link", "set", dev, "up") for ns, dev in zip(names, (f"{tag}a", f"{tag}b"))],
            *[("-n", ns, "link", "set", "lo", "up") for ns in names],
        ]
        for argv in steps:
            r = _ip(*argv)
            if r.returncode != 0:
                pytest.skip(f"cannot join the namespaces: ip {' '.join(argv)}: {r.stderr.strip()}")
        # Each host's own name service (``ip netns exec`` mounts /etc/netns/NS/* over /etc):
        # both hosts by name, this machine's host name on loopback as many images have it,
        # and no name server (none is reachable from inside).
        for ns in names:
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n"
                                       f"{SUBNET}.1 {HOSTS[0]}\n{SUBNET}.2 {HOSTS[1]}\n")
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
        yield [(names[0], f"{SUBNET}.1"), (names[1], f"{SUBNET}.2")]
    finally:
        for ns in made:
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns)  # takes the veth pair with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _losses(path: Path) -> dict[int, str]:
    """``--loss-file``: step -> the loss as float.hex (exact)."""
    return dict((int(a), b) for a, b in (ln.split() for ln in path.read_text().splitlines()))


def _daemons(hosts, workdir: Path, train: list[str], env: dict) -> list[Proc]:
    """The documented command on each host (docs/operations.md), node 0's address as the master."""
    master = HOSTS[0]
    procs = []
    for rank, (ns, _addr) in enumerate(hosts):
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "rrfp", "node",
                "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master, "--master-port", str(RDZV_PORT),
                "--metrics-addr", "0.0.0.0", "--metrics-port", "9400", "--max-restarts", "0",
                "--job-id", "two-hosts",
                "--", *TRAIN, "--job-secret-file", str(workdir / "secret"),
                "--checkpoint-dir", str(workdir / "ck"), *train]
        procs.append(Proc(argv, env))
    return procs


def _finish(procs: list[Proc], timeout: float) -> list[int]:
    try:
        return [p.finish(timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_two_hosts_both_planes_sigterm_and_resume(hosts, tmp_path):
    env = _clean_env()
    ref = Proc([sys.executable, "-m", "rrfp", "train", *TRAIN, "--loss-file", str(tmp_path / "ref.txt"), "--quiet"],
               env)
    assert ref.finish(900) == 0, ref.output()
    want = _losses(tmp_path / "ref.txt")
    assert sorted(want) == [1, 2, 3, 4]
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)

    # ZeroMQ data plane, CURVE with the job secret. The last rank (node 1) holds after step 1
    # (test hook) until a stop is asked, so the SIGTERM lands inside step 2 without a timer.
    d0, d1 = _daemons(hosts, tmp_path, ["--transport", "zmq", "--loss-file", str(tmp_path / "zmq.txt")],
                      dict(env, RRFP_TEST_HOLD_AFTER_STEP="1"))
    try:
        d1.wait_for("holding after step 1", 900)
        d1.p.send_signal(signal.SIGTERM)
        rc = _finish([d1, d0], 600)
    finally:
        d0.kill()
        d1.kill()
    out = d0.output() + "\n--- node 1 ---\n" + d1.output()
    assert rc == [143, 143], out  # preempted: a restart rule matches 143 (rrfp.train.stop.PREEMPTED)
    assert f"node 0 of 2 at {hosts[0][1]}" in d0.output() and f"node 1 of 2 at {hosts[1][1]}" in d1.output(), out
    assert "stopped after step 2 on request (SIGTERM)" in d0.output(), out
    assert "stopped on SIGTERM" in d1.output() and "checkpoint" in d1.output(), out
    assert "stopped because a peer node was preempted (SIGTERM)" in d0.output(), out
    assert ck.latest(tmp_path / "ck") == ck.step_dir(tmp_path / "ck", 2)
    assert _losses(tmp_path / "zmq.txt") == {k: want[k] for k in (1, 2)}

    # Both resume, over the torch data plane (gloo across the veth pair), and finish.
    d0, d1 = _daemons(hosts, tmp_path, ["--transport", "torch", "--loss-file", str(tmp_path / "torch.txt")], env)
    rc = _finish([d0, d1], 900)
    out = d0.output() + "\n--- node 1 ---\n" + d1.output()
    assert rc == [0, 0], out
    assert f"resumed from {ck.step_dir(tmp_path / 'ck', 2)} at step 2" in d0.output(), out
    assert _losses(tmp_path / "torch.txt") == {k: want[k] for k in (3, 4)}
    assert ck.latest(tmp_path / "ck") == ck.step_dir(tmp_path / "ck", 4)
