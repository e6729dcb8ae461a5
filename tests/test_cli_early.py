"""Every refused flag of rrfp train / node / simulate / export is one line and exit code 2 before
torch is imported: each case runs in a child process that reports, at exit, whether ``torch``
is in ``sys.modules`` and its CPU seconds (``resource.getrusage``, printed, never asserted:
timing goals live in benchmarks/)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# Runs rrfp's main on each command line in turn in one child (none may load torch, so one
# interpreter serves them all and the suite starts one process, not forty); prints one JSON
# report per case: exit code, whether torch is loaded now, CPU seconds so far, stderr.
CHILD = """
import contextlib, io, json, resource, sys
from rrfp.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "cpu_s": ru.ru_utime + ru.ru_stime,
                      "err": err.getvalue().strip().splitlines()}), flush=True)
"""

NODE_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
            "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "RRFP_JOB_SECRET")


def run_child(cases: list[list[str]], cwd) -> list[dict]:
    """One report per command line of ``cases``, run in order in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in NODE_ENV}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                       timeout=600, cwd=cwd, env=env)
    reports = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(cases), p.stderr[-3000:]
    before = 0.0
    for argv, r in zip(cases, reports):
        print(f"rrfp {' '.join(argv)}: {r['cpu_s']:.2f} s CPU since start, {r['cpu_s'] - before:.2f} s this case")
        before = r["cpu_s"]
    return reports


CASES = [
    (["train", "--hint", "nope"], "--hint='nope': unknown hint 'nope'"),
    (["train", "--hint", "bff"], "--hint='bff': unknown hint 'bff' (did you mean 'bf'?)"),
    (["train", "--hint", "strict-no_such.csv"], "--hint='strict-no_such.csv': cannot read no_such.csv: No such file or directory"),
    (["train", "--pp", "0"], "--pp=0: expected a positive integer"),
    (["train", "--stages", "0"], "--pp=0: expected a positive integer"),
    (["train", "--pp", "5"], "--pp=5 x --virtual-stages=1 = 5 stages exceeds the 4 layers of model 'tiny'"),
    (["train", "--pp", "2", "--dp", "2", "--tp", "3"], "--tp=3: expected a divisor of the 2 attention heads"),
    (["train", "--microbatches", "16", "--batch-size", "8"], "--microbatches=16 exceeds --batch-size=8"),
    (["train", "--microbatches", "8", "--dp", "2", "--batch-size", "8", "--pp", "2"],
     "--microbatches=8 x --dp=2 exceeds --batch-size=8"),
    (["train", "--pp", "2", "--dp-shard", "full"], "--dp-shard full shards each stage over the DP replicas: expected --dp 2"),
    (["train", "--pp", "2", "--dp", "2", "--dp-shard", "optimizer"], "--dp-shard optimizer: not available: under FSDP2"),
    (["train", "--pp", "2", "--dp", "2", "--dp-shard", "full", "--precision", "bf16", "--deterministic"],
     "--dp-shard full --precision bf16 with --deterministic"),
    (["train", "--hint", "zb-v"], "--hint='zb-v' needs --virtual-stages 2 --placement v"),
    (["train", "--hint", "order:F0 F0"], "--hint='order:F0 F0'"),
    (["train", "--memory-budget", "12qq"], "--memory-budget='12qq': memory size '12qq'"),
    (["train", "--memory-budget", "-5MiB"], "--memory-budget='-5MiB': memory size '-5MiB': expected a positive size"),
    (["train", "--memory-budget", "1f1b"], "--memory-budget='1f1b': memory budget '1f1b': the runtime takes a size"),
    (["train", "--inflight-limit", "0"], "--inflight-limit='0': expected a positive integer or '1f1b'"),
    (["train", "--model", "nope"], "--model='nope': expected one of tiny, small, medium, multimodal"),
    (["train", "--model", "multimodal", "--pp", "5"], "5 stages exceeds the 4 layers of model 'multimodal'"),
    (["train", "--model", "hf:gpt2", "--pp", "5"], "5 stages exceeds the 4 layers of model 'hf:gpt2'"),
    (["train", "--model", "hf:/no/such/folder"], "--model='hf:/no/such/folder': expected one of hf:gpt2"),
    (["train", "--lr", "nan"], "--lr=nan: expected a finite, positive learning rate"),
    (["train", "--launch-ahead", "3"], "--launch-ahead=3: expected 1 or 2"),
    (["train", "--executor", "cuda", "--device", "cpu"], "--executor cuda: needs --device cuda"),
    (["train", "--tensorboard", ""], "--tensorboard='': expected a folder for the event files"),
    (["train", "--peak-tflops", "-1"], "--peak-tflops=-1.0: expected a positive, finite TFLOP/s"),
    (["train", "--grad-accum", "0"], "--grad-accum=0: expected a positive integer"),
    (["train", "--trace-steps", "1:2"], "--trace-steps='1:2' needs --trace DIR"),
    (["train", "--warmup", "50"], "--warmup=50: expected 0..40 (--steps)"),
    (["train", "--data", "/no/such/text"], "--data: data path '/no/such/text' does not exist"),
    (["train", "--loss-file", "/no/such/dir/x"], "--loss-file='/no/such/dir/x'"),
    (["train", "--metrics-port", "70000"], "--metrics-port=70000: expected a port in 0..65532"),
    (["train", "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir DIR"),
    (["train", "--resume", "/no/such/ckpt"], "--resume='/no/such/ckpt': not a committed checkpoint"),
    (["node", "--nnodes", "0"], "--nnodes=0: expected a positive integer"),
    (["node", "--heartbeat-timeout", "0"], "--heartbeat-timeout=0.0: expected a positive number of seconds"),
    (["node", "--", "--pp", "0"], "--pp=0: expected a positive integer"),
    (["node", "--nnodes", "3", "--", "--pp", "4"], "--pp=4 is not a multiple of 3 nodes"),
    (["node", "--", "--memory-budget", "-1.5GB"], "--memory-budget='-1.5GB': memory size '-1.5GB': expected a positive size"),
    (["train", "--lr", "-1e-3"], "--lr=-0.001: expected a finite, positive learning rate"),
    (["node", "--master-addr", "bad host"], "--master-addr='bad host': expected a host name, an IPv4 address or an IPv6"),
    (["node", "--master-addr", "999.9.9.9"], "--master-addr='999.9.9.9': not an IPv4 address (four numbers 0-255)"),
    (["node", "--node-addr", "[::1"], "--node-addr='[::1': expected a host name, an IPv4 address or an IPv6 address"),
    (["simulate", "--pp", "0"], "--pp=0: expected a positive integer"),
    (["simulate", "--inflight-limit", "x"], "--inflight-limit='x': expected a positive integer or '1f1b'"),
    (["simulate", "--limit", "0"], "--inflight-limit='0': expected a positive integer or '1f1b'"),
    (["export", "/no/such/ckpt", "--out", "m.pt"], "'/no/such/ckpt': not a committed checkpoint"),
    (["train", "--steps", "99999999999999999999999"], "--steps=99999999999999999999999: expected at most 1000000000"),
    (["node", "--job-id", ""], "--job-id='': expected a non-empty job name"),
    (["train", "--job-secret-file", "/no/such/secret"], "--job-secret-file: job secret file '/no/such/secret': "),
    # An empty value (an unset shell variable) was taken as no flag: a run without the
    # checkpoints, trace, secret or ports it was asked for, exit 0.
    (["train", "--checkpoint-dir", "", "--checkpoint-every", "1"], "--checkpoint-dir='': expected a folder path"),
    (["train", "--trace", ""], "--trace='': expected a folder path"),
    (["train", "--job-secret-file", ""], "--job-secret-file='': expected a file path"),
    (["train", "--port-range", ""], "--port-range='': expected LO-HI"),
    (["node", "--", "--checkpoint-dir", ""], "--checkpoint-dir='': expected a folder path"),
    (["simulate", "--costs", ""], "--costs '': expected a cost file"),
    (["simulate", "--baseline", ""], "--baseline '': expected a hint name, auto or none"),
]


def test_refused_before_torch_loads(tmp_path):
    for (argv, needle), r in zip(CASES, run_child([argv for argv, _ in CASES], tmp_path)):
        assert not r["torch"], f"rrfp {' '.join(argv)} loaded torch"
        assert r["rc"] == 2 and len(r["err"]) == 1, (argv, r)
        assert r["err"][0].startswith(f"rrfp {argv[0]}: error: ") and needle in r["err"][0], (argv, r)


def test_a_busy_metrics_port_is_found_before_any_rank_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # Rank 1 of 2 would serve on the busy port.
        train, node = run_child([["train", "--pp", "2", "--metrics-port", str(port - 1)],
                                 ["node", "--metrics-port", str(port)]], tmp_path)
    for r in (train, node):
        assert r["rc"] == 2 and len(r["err"]) == 1 and not r["torch"], r
    assert f"--metrics-port={port - 1}: port {port} (rank 1's endpoint) on 127.0.0.1 is not free" in train["err"][0]
    assert f"--metrics-port={port}: port {port} on 127.0.0.1 is not free" in node["err"][0]


def test_a_good_command_line_passes_the_early_checks(tmp_path):
    """The early checks accept what the ranks run (here stopped by too little text in --data,
    which only the late check counts, after torch loaded)."""
    text = tmp_path / "short.txt"
    text.write_text("a few words, far from a batch of samples\n")
    secret = tmp_path / "secret"
    secret.write_text("a job secret of more than sixteen bytes\n")
    (r,) = run_child([["train", "--hint", "1F1B", "--pp", "2", "--tensorboard", str(tmp_path / "tb"),
                       "--job-secret-file", str(secret), "--data", str(text)]], tmp_path)
    assert r["rc"] == 2 and len(r["err"]) == 1 and "samples in --data" in r["err"][0], r
    assert r["torch"]  # the late checks ran: the early ones let the command line through


@pytest.mark.parametrize("argv,limits", [
    (["--hint", "1F1B"], [4, 3, 2, 1]),  # PyTorch's Schedule1F1B: p - rank in flight
    (["--hint", "Schedule1F1B", "--inflight-limit", "2"], [2, 2, 2, 2]),  # an explicit limit wins
    (["--hint", "ScheduleGPipe"], [8, 8, 8, 8]),  # GPipe holds every microbatch
    (["--hint", "bf"], [32, 32, 32, 32]),  # a policy keeps the default
    (["--hint", "1f1b", "--memory-budget", "64MiB"], [32, 32, 32, 32]),  # a budget replaces the schedule's limit
])
def test_rrfp_train_takes_pytorch_schedule_names_and_keeps_their_memory(argv, limits, monkeypatch):
    """What the ranks pass to the pipeline (rrfp.train.early.inflight_limits), resolved as the
    pipeline resolves it, against the schedules' own peaks in flight on 4 ranks, 8 microbatches."""
    from rrfp.cli import main
    from rrfp.runtime.doors.config import RuntimeConfig, plan
    from rrfp.train.early import inflight_limits

    seen = []
    monkeypatch.setattr("rrfp.train.cli.launch", lambda args: seen.append(args) or 0)
    assert main(["train", "--pp", "4", "--microbatches", "8", *argv]) == 0
    (args,) = seen
    config = RuntimeConfig(hint=args.hint, inflight_limit=inflight_limits(args, 4), memory_budget=args.memory_budget)
    assert plan(config, 4, 1, 8).limits == limits
