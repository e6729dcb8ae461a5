"""``rrfp node`` and checkpoints: two daemons as two nodes of one job on loopback addresses,
graceful SIGTERM, bit-identical resume, a rank SIGKILLed while writing a checkpoint, export.

The reference for every bitwise check is one uninterrupted ``rrfp train`` run (one launcher,
4 ranks) with the same flags in ``--deterministic`` mode. Every wait is on an event (a line a
process printed, a process exit) under a timeout; no sleeps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch

from node_hosts import ADDRS, needs_loopback, node_env
from procs import Proc

from rrfp.train import checkpoint as ck
from rrfp.train.stop import PREEMPTED

TRAIN = ["--steps", "6", "--batch-size", "8", "--microbatches", "4", "--deterministic", "--threads", "1",
         "--max-len", "64"]


def _daemons(ckdir: Path, extra_train: list[str] = (), linger: bool = False, **env: str) -> list[Proc]:
    """Two daemons of one job. Node 0 hosts the rendezvous on a port the OS picks
    (``--master-port 0``) and says which in its first line; node 1 starts with that port, so
    no port is probed free and then raced for."""
    procs = []
    port = 0
    for node, addr in enumerate(ADDRS):
        argv = [sys.executable, "-m", "rrfp", "node", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", ADDRS[0], "--master-port", str(port), "--node-addr", addr,
                "--metrics-addr", addr, "--metrics-port", "0", "--job-id", f"test{os.getpid()}", "--max-restarts", "1"]
        train = [*TRAIN, "--checkpoint-dir", str(ckdir), *extra_train]
        # Node 0 takes its node rank from Kubeflow Trainer's variable, node 1 from the flag,
        # and node 1 passes the train flags without "--".
        if node == 0:
            argv += ["--metrics-linger", "120"] if linger else []
            procs.append(Proc(argv + ["--", *train], node_env(PET_NODE_RANK="0", **env)))
            try:
                line = procs[0].wait_for(", rendezvous ", 600)
            except BaseException:
                procs[0].kill()
                raise
            port = int(line.split(", rendezvous ")[1].split(" ")[0].rsplit(":", 1)[1])
            assert port > 0, line
        else:
            procs.append(Proc(argv + ["--node-rank", "1", *train], node_env(**env)))
    return procs


def _model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a committed checkpoint (DCP, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith(("model.", "optim.")) and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run: its final checkpoint (step 6)."""
    d = tmp_path_factory.mktemp("reference")
    proc = Proc([sys.executable, "-m", "rrfp", "train", *TRAIN, "--checkpoint-dir", str(d), "--quiet"], node_env())
    assert proc.finish(900) == 0, proc.output()
    assert ck.latest(d) == ck.step_dir(d, 6)
    return ck.step_dir(d, 6)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
@needs_loopback
@pytest.mark.timeout(2400)
def test_two_daemons_sigterm_exits_143_then_resume_then_rank_killed_mid_checkpoint(tmp_path, reference):
    """Two daemons (nodes 0 and 1 on 127.0.0.2 and 127.0.0.3, two ranks each) train together.
    Rank 3 holds after step 2 (test hook) until a stop is asked, so rank 0 is inside step 3;
    SIGTERM to node 1's daemon makes all four ranks end step 3, commit a checkpoint and exit
    143. Node 1's daemon exits 143; node 0's, never signalled, says its peer was preempted and
    exits 143 too, restarting nothing (main: every rank and both daemons exited 0, and the
    job looked finished). Started again, they
    resume from step 3; rank 1 SIGKILLs itself while writing the checkpoint of step 4 (after its
    shard is on disk, before the commit); its daemon restarts the group, which resumes from step
    3 again (the half-written step 4 is never loaded) and finishes. The final parameters and
    optimizer state equal the uninterrupted run's bit for bit."""
    ckdir = tmp_path / "ck"
    d0, d1 = _daemons(ckdir, RRFP_TEST_HOLD_AFTER_STEP="2")
    try:
        d1.wait_for("holding after step 2", 900)  # rank 3, on node 1
        url = d0.wait_for("serving http://", 60).split("serving ")[1].split(" ")[0]
        # Node 0's ranks (0 and 1) have run steps, so both have beaten and counted steps.
        assert _get(url + "/readyz") == (200, "ready\n")
        status, body = _get(url + "/healthz")
        assert status == 200 and "rank 0: alive" in body and "rank 1: alive" in body, body
        status, body = _get(url + "/metrics")
        assert status == 200 and 'rrfp_steps_total{rank="0"}' in body and 'rrfp_steps_total{rank="1"}' in body
        assert _get(url + "/nothing")[0] == 404
        t0 = time.monotonic()
        d1.p.send_signal(signal.SIGTERM)
        # What is asserted is the outcome (the step in progress, a checkpoint, exit 143
        # everywhere); the time it takes (Kubernetes' default grace period is 30 s) is printed
        # for the record, not asserted: a loaded machine may be slower, and 600 s only bounds a hang.
        assert d1.finish(600) == PREEMPTED, d1.output()
        assert d0.finish(600) == PREEMPTED, d0.output()
        print(f"SIGTERM to both daemons' exit: {time.monotonic() - t0:.1f} s")  # for the record (pytest -rP)
    finally:
        d0.kill()
        d1.kill()
    assert "stopped after step 3 on request (SIGTERM), the step in progress" in d0.output()
    saved = f"latest checkpoint {ck.step_dir(ckdir, 3)} (step 3)"
    assert f"rrfp node: stopped on SIGTERM: every rank ended the step in progress and exited 143; {saved}" \
        in d1.output(), d1.output()
    assert "rrfp node: stopped because a peer node was preempted (SIGTERM): every rank ended the step in progress " \
        f"and exited 143; {saved}" in d0.output(), d0.output()
    assert "peer node was preempted" in d0.output().splitlines()[-1], d0.output()  # its last word: no restart
    assert ck.latest(ckdir) == ck.step_dir(ckdir, 3)
    assert ck.read_meta(ck.step_dir(ckdir, 3))["step"] == 3

    d0, d1 = _daemons(ckdir, ["--checkpoint-every", "2"], linger=True, **{ck.CRASH_ENV: "1:4"})
    try:
        d0.wait_for("rrfp node: done", 1200)
        # Node 0's daemon keeps serving its final values (--metrics-linger) until SIGTERM.
        url = d0.wait_for("serving http://", 60).split("serving ")[1].split(" ")[0]
        status, body = _get(url + "/metrics")
        assert status == 200 and 'rrfp_restarts_total{node="0"} 1.0' in body, body
        d0.p.send_signal(signal.SIGTERM)
        rc0, rc1 = d0.finish(300), d1.finish(300)
    finally:
        d0.kill()
        d1.kill()
    assert (rc0, rc1) == (0, 0), d0.output() + "\n---\n" + d1.output()
    out = d0.output()
    assert "rank 1: test hook" in out and "killed while writing the checkpoint of step 4" in out
    resumed = [ln for ln in out.splitlines() if "resumed from" in ln]
    assert len(resumed) == 2 and all(ln.endswith(f"{ck.step_dir(ckdir, 3)} at step 3") for ln in resumed), out
    assert ck.latest(ckdir) == ck.step_dir(ckdir, 6)
    got, want = _model_state(ck.step_dir(ckdir, 6)), _model_state(reference)
    assert got.keys() == want.keys() and any(k.startswith("optim.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_export_loads_with_from_pretrained_with_the_pipelined_logits(tmp_path, reference):
    """``rrfp export`` writes a Hugging Face folder (GPT-2 configured as rrfp's GPT); loaded with
    ``from_pretrained`` it gives the logits of the four trained stage modules chained (loaded
    from the same checkpoint by the model's names), bit for bit."""
    transformers = pytest.importorskip("transformers")
    from rrfp.model.gpt import GPT_PRESETS, build_stage
    from rrfp.model.names import full_names

    out = tmp_path / "hf"
    proc = Proc([sys.executable, "-m", "rrfp", "export", str(reference), "--out", str(out)], node_env())
    assert proc.finish(600) == 0, proc.output()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = dataclasses.replace(GPT_PRESETS["tiny"], max_len=64)
    shards = _model_state(reference)
    stages = [build_stage(cfg, 4, s) for s in range(4)]
    for st in stages:
        st.load_state_dict({n: shards[f"model.{full_names(st)[n]}"] for n in st.state_dict()})
    tokens = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    x = tokens
    with torch.no_grad():
        for st in stages:
            x = st(x)
        assert torch.equal(model(tokens).logits, x)


@pytest.mark.slow
def test_export_refuses_a_truncated_shard_in_one_line(tmp_path, reference):
    """A damaged checkpoint is one line naming the shard and its size, exit 2, and no file
    written (the check ``--resume`` makes), not DCP's EOFError traceback."""
    import shutil

    damaged = tmp_path / reference.name
    shutil.copytree(reference, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(100)
    out = tmp_path / "hf"
    proc = Proc([sys.executable, "-m", "rrfp", "export", str(damaged), "--out", str(out)], node_env())
    assert proc.finish(600) == 2, proc.output()
    err = proc.output().strip().splitlines()
    assert len(err) == 1 and f"shard {shard.name} has 100 bytes, expected" in err[0], err
    assert not out.exists()


def test_latest_skips_uncommitted_and_half_written(tmp_path):
    def make(name: str, step: int, meta: bool) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / ".metadata").write_bytes(b"x")
        if meta:
            (d / ck.META_FILE).write_text(json.dumps({"format": ck.FORMAT, "step": step}))

    make("step-00000002", 2, True)
    make("step-00000010", 10, True)
    make("step-00000012", 12, False)  # renamed without a description: not committed
    make(".tmp-step-00000014-abc", 14, True)  # never renamed
    (tmp_path / "step-x").mkdir()
    assert ck.latest(tmp_path) == tmp_path / "step-00000010"
    assert [p.name for p in ck.committed(tmp_path)] == ["step-00000002", "step-00000010"]
    assert ck.latest(tmp_path / "absent") is None


def test_unwritable_checkpoint_dir_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = Proc([sys.executable, "-m", "rrfp", "train", "--checkpoint-dir", str(blocker / "ck")], node_env())
    assert proc.finish(300) == 2
    lines = proc.output().splitlines()
    assert len(lines) == 1 and "--checkpoint-dir=" in lines[0] and "not a writable folder" in lines[0], lines


def test_node_reads_kubernetes_environment(monkeypatch, tmp_path):
    """Flags win over Kubeflow Trainer's PET_* variables, which win over a JobSet's."""
    import argparse

    from rrfp.cli import UsageError
    from rrfp.node.cli import resolve

    def args(**kw):
        base = {"nnodes": None, "nproc_per_node": None, "node_rank": None, "master_addr": None, "master_port": None,
                "max_restarts": 3, "metrics_port": 0, "metrics_linger": 0.0, "metrics_addr": "127.0.0.1",
                "heartbeat_timeout": 60.0, "job_id": "rrfp",
                "extra": ["--", "--steps", "2"]}
        return argparse.Namespace(**{**base, **kw})

    for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
              "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    monkeypatch.setenv("MASTER_ADDR", "head.svc")
    monkeypatch.setenv("PET_MASTER_PORT", "29411")
    monkeypatch.setenv("MASTER_PORT", "1")
    job = resolve(args())
    assert (job.nnodes, job.nproc, job.node_rank, job.master_addr, job.port) == (2, 2, 1, "head.svc", 29411)
    assert job.train_args == ["--steps", "2"]
    monkeypatch.setenv("PET_NODE_RANK", "0")
    assert resolve(args()).node_rank == 0
    assert resolve(args(node_rank=1, master_addr="x")).master_addr == "x"
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    with pytest.raises(UsageError, match=r"--nproc-per-node=3 x 2 nodes != --pp=4"):
        resolve(args())
    monkeypatch.setenv("PET_NPROC_PER_NODE", "two")
    with pytest.raises(UsageError, match="PET_NPROC_PER_NODE='two': expected an integer"):
        resolve(args())
    monkeypatch.delenv("PET_NPROC_PER_NODE")
    job = resolve(args(extra=["--", "--checkpoint-dir", str(tmp_path / "ck")]))
    assert job.train_args[-2:] == ["--resume", "auto"]  # restarted ranks resume


def test_node_address_names_its_interface_for_gloo_and_nccl(monkeypatch):
    """The interface holding the node's address goes to GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME, each only when the user has not set it; an address no interface holds
    gives none, and as ``--node-addr`` it is refused in one line."""
    import argparse

    from rrfp import _net
    from rrfp.cli import UsageError
    from rrfp.node.cli import resolve

    lo = _net.interface_of("127.0.0.1")
    assert lo is not None and socket.if_nametoindex(lo) > 0
    assert _net.socket_ifname_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert _net.socket_ifname_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": lo}
    assert _net.interface_of("203.0.113.77") is None and _net.socket_ifname_env("203.0.113.77", {}) == {}
    assert _net.route_to("127.0.1.1", 1) == "127.0.0.1" and _net.route_to("", 1) == "127.0.0.1"
    for k in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "MASTER_ADDR", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(k, raising=False)
    ns = argparse.Namespace(nnodes=None, nproc_per_node=None, node_rank=None, master_addr=None, master_port=None,
                            max_restarts=3, metrics_port=0, metrics_linger=0.0, metrics_addr="127.0.0.1",
                            heartbeat_timeout=60.0, node_addr="203.0.113.77", job_id="rrfp", extra=["--steps", "2"])
    with pytest.raises(UsageError, match=r"^--node-addr='203.0.113.77': no interface of this host has address"):
        resolve(ns)
    ns.node_addr = "127.0.0.1"
    assert resolve(ns).node_addr == "127.0.0.1"


FAULT = '''import os, signal, sys
if "LOCAL_RANK" in os.environ:  # a rank, not the daemon
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        sys.exit(3)  # the first start fails: the agent restarts the group
    print(f"fault: rank {os.environ['RANK']} attempt {attempt} starting", flush=True)
    signal.pause()  # still starting when SIGTERM comes (SIGTERM's default action ends it)
'''


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigterm_during_a_restart_loop_restarts_nothing(tmp_path):
    """Ranks that fail at start put the daemon in a restart loop (a sitecustomize in the
    ranks' path: attempt 0 exits 3, later attempts never finish starting). SIGTERM while the
    restarted ranks start: they are stopped, none is restarted, the daemon exits 143 with
    one line saying nothing was saved, and never claims a checkpoint without --checkpoint-dir."""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    argv = [sys.executable, "-m", "rrfp", "node", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "0",
            "--max-restarts", "50", "--metrics-port", "0", "--", "--stages", "2", "--steps", "2"]
    d = Proc(argv, node_env(PYTHONPATH=str(tmp_path)))
    try:
        d.wait_for("fault: rank 0 attempt 1 starting", 600)
        d.wait_for("fault: rank 1 attempt 1 starting", 300)
        d.p.send_signal(signal.SIGTERM)
        rc = d.finish(300)
    finally:
        d.kill()
    out = d.output()
    assert rc == 128 + signal.SIGTERM, out
    assert "attempt 2" not in out, out
    assert "rrfp node: stopped on SIGTERM; this stop committed no checkpoint (a rank ended before the step in progress " \
        "could end); nothing saved (no --checkpoint-dir)" \
        in out, out
    assert "then a checkpoint" not in out and "checkpoint and exit" not in out and "step, checkpoint" not in out, out
