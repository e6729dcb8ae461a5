"""Attacks on running ``rrfp train`` jobs over 127.0.0.1, a poisoned step, and a launcher
SIGKILLed during start-up."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zmq
from test_security import SECRET, attack, raw_attack

from rrfp.transport.codec import encode
from rrfp.transport.keys import Direction, MsgKey

pytestmark = pytest.mark.slow

JOB = "train-local"  # rrfp train's job id without TORCHELASTIC_RUN_ID
STEPS, PAUSE = 8, 3
ARGS = ["train", "--stages", "4", "--steps", str(STEPS), "--batch-size", "8", "--microbatches", "4", "--max-len", "32",
        "--deterministic", "--watchdog", "600"]


class Job:
    """A 4-rank ``rrfp train`` job whose rendezvous store this test hosts: every rank is a
    store client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent), so the store
    exists before any rank starts and the attacker never races a rank to connect to it.

    Each rank's stderr is read line by line by a thread, so the test can wait for a line
    (an event) rather than for time to pass."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=600))
        self.loss_file = tmp / f"{name}.losses"
        self.out = [tmp / f"{name}.rank{r}.out" for r in range(4)]
        self.err: list[list[str]] = [[] for _ in range(4)]
        self._said = threading.Condition()
        self.procs = []
        for r in range(4):
            e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "RANK": str(r),
                 "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1", "RRFP_JOB_SECRET": SECRET,
                 "TORCHELASTIC_USE_AGENT_STORE": "True", **(env or {})}
            e.pop("TORCHELASTIC_RUN_ID", None)
            with open(self.out[r], "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "rrfp", *args, "--loss-file", str(self.loss_file)],
                    stdout=out, stderr=subprocess.PIPE, text=True, env=e))
        self._readers = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in range(4)]
        for t in self._readers:
            t.start()

    def _read(self, r: int) -> None:
        for line in self.procs[r].stderr:
            with self._said:
                self.err[r].append(line)
                self._said.notify_all()

    def key(self, name: str) -> str:
        return f"default_pg/0//{name}"  # the default process group's prefix on the job's store

    def wait_keys(self, names: list[str]) -> None:
        self.store.wait([self.key(n) for n in names], datetime.timedelta(seconds=600))

    def endpoint(self, rank: int) -> str:
        self.wait_keys([f"rrfp/{JOB}/zmq/{rank}"])
        return bytes(self.store.get(self.key(f"rrfp/{JOB}/zmq/{rank}"))).decode().split("\t")[0]

    def wait_said(self, rank: int, text: str, n: int) -> None:
        """Until rank ``rank`` has printed ``n`` lines containing ``text`` (or exited)."""
        with self._said:
            ok = self._said.wait_for(lambda: sum(text in ln for ln in self.err[rank]) >= n
                                     or self.procs[rank].poll() is not None, timeout=600)
        assert ok and sum(text in ln for ln in self.err[rank]) >= n, "".join(self.err[rank])[-3000:]

    def finish(self) -> tuple[list[int], list[str]]:
        codes = [p.wait(timeout=600) for p in self.procs]
        for t in self._readers:
            t.join(30)
        return codes, ["".join(e) for e in self.err]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(1800)
def test_attacks_on_a_running_job_are_refused_counted_and_change_nothing(tmp_path):
    # Forced order, no timers: the attacked job pauses after step PAUSE on every rank
    # (test hook RRFP_TEST_PAUSE_AFTER_STEP) until the attacks are over and every attacked
    # rank has logged each refusal; the undisturbed reference runs beside it.
    ref = Job(tmp_path, "ref", ARGS)
    job = Job(tmp_path, "attacked", ARGS, {"RRFP_TEST_PAUSE_AFTER_STEP": str(PAUSE)})
    try:
        # Routing-id squatting at start-up: as soon as rank 2 publishes, claim to be rank 1.
        grad = MsgKey(JOB, 1, 0, 2, Direction.GRAD)
        assert attack(job.endpoint(2), encode(grad, [torch.zeros(4)]), b"1") != zmq.EVENT_HANDSHAKE_SUCCEEDED
        job.wait_keys([f"rrfp/test/paused/{r}" for r in range(4)])
        ep = {r: job.endpoint(r) for r in range(4)}
        act = MsgKey(JOB, PAUSE, 0, 1, Direction.ACT)
        stats = {"kind": "stats", "step": PAUSE, "loss": 123.456, "busy": 0.0, "wall": 1.0, "peak": 1}
        attacks = [
            (ep[2], encode(grad, [torch.full((8, 32, 32), float("nan"))]), b"3"),              # forged gradient
            (ep[1], encode(act, [torch.full((8, 32, 32), 1.5)]), b"0"),                        # forged activation
            (ep[0], encode(MsgKey(JOB, PAUSE, 0, 0, Direction.CTL), [], stats), b"3"),          # forged statistics
            (ep[2], [b"\x81", bytearray(300 << 20)], b"3"),                                    # over 256 MiB
            (ep[2], [b"\x81"] + [b"\0" * (1 << 20)] * 64, b"3"),                                # multi-frame
        ]
        for e, frames, rid in attacks:
            assert attack(e, frames, rid) != zmq.EVENT_HANDSHAKE_SUCCEEDED
        raw_attack(ep[3], b"GET /metrics HTTP/1.0\r\n\r\n")  # not ZeroMQ at all
        # Store-key overwrite mid-run: a relay's endpoint for rank 1, unsigned. The ranks read
        # endpoints only at start-up, so it must change nothing (the in-process test
        # test_outsiders_are_refused_counted_and_traffic_is_intact counts one at start-up).
        job.store.set(job.key(f"rrfp/{JOB}/zmq/1"), "tcp://127.0.0.1:9\t" + "0" * 64)
        expect = {0: 1, 1: 1, 2: 4, 3: 1}  # stats; activation; squat, gradient, oversized, multi-frame; raw
        for r, n in expect.items():
            job.wait_said(r, "refused connection #", n)
        job.store.set(job.key("rrfp/test/resume"), "1")
        codes, errs = job.finish()
        ref_codes, ref_errs = ref.finish()
    finally:
        ref.kill()
        job.kill()
    assert codes == [0] * 4, errs
    assert ref_codes == [0] * 4, ref_errs
    losses = job.loss_file.read_text().splitlines()
    assert len(losses) == STEPS and [ln.split()[0] for ln in losses] == [str(k) for k in range(1, STEPS + 1)]
    assert losses == ref.loss_file.read_text().splitlines()  # bit for bit (float.hex)
    assert "123.456" not in job.out[0].read_text()
    for r, n in expect.items():  # the transport's counters (the metric's rejected_handshake)
        assert f"rank {r}: refused rejected_handshake={n}\n" in errs[r], errs[r][-2000:]
        assert errs[r].count("refused connection #") == n
    assert "refused" not in "".join(ref_errs)


@pytest.mark.timeout(900)
def test_a_poisoned_step_stops_the_run_naming_step_and_rank():
    # A learning rate of 1e30 makes the second step's loss overflow on the last stage.
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--stages", "4", "--steps", "6", "--batch-size", "8",
                        "--microbatches", "4", "--max-len", "32", "--lr", "1e30"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr[-2000:]
    # The launcher's verdict is its last own line (torch's elastic agent may log after it).
    last = [ln for ln in p.stderr.splitlines() if ln.startswith("rrfp train: error: ")][-1]
    # Rank 3 exits on its own (the launcher then names the cause from its error file) or is
    # stopped by the launcher first (then it is named as signalled); rank 3 is named either way.
    # The launcher names the cause: the step and the rank where the non-finite value appeared
    # (which rank exits first, and so is named as failed, depends on who notices first).
    assert "NonFiniteStep: step 2: non-finite loss first on rank 3" in last or last.startswith(
        "rrfp train: error: rank 3 "), p.stderr[-2000:]
    # Every rank that says why names the step and the rank where the non-finite value appeared,
    # unless the others left first and it reports them lost.
    said = re.findall(r"rank (\d): error: (.*)", p.stderr)
    cause = "NonFiniteStep: step 2: non-finite loss first on rank 3"
    assert said and all(why == cause or why.startswith("PeerLost: ") for _, why in said), p.stderr
    assert sum(why == cause for _, why in said) >= 3, p.stderr
    assert "step    2/6" not in p.stdout


def _ranks(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's ranks (tests/procs.py)."""
    from procs import rank_pids

    return rank_pids(launcher)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", ["first-rank-forked", "all-ranks-forked", "training"])
def test_ranks_die_with_a_sigkilled_launcher(point):
    """A rank dies by the kernel's signal the moment its launcher dies (PR_SET_PDEATHSIG):
    SIGKILL, or exit 128 + SIGKILL where the launcher died before the rank set it up. How
    each rank died is asserted, not how fast (a loaded machine decides that): the launcher
    runs under tests/reaper.py, a child subreaper that waits for the orphaned ranks. A rank
    that outlived its launcher would end otherwise (its watchdog's error, exit 1) or never
    (the run has 100000 steps)."""
    reaper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), sys.executable, "-m",
                               "rrfp", "train", "--stages", "2", "--steps", "100000", "--batch-size", "4",
                               "--microbatches", "2", "--max-len", "32"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ranks: set[int] = set()
    try:
        launcher = int(reaper.stdout.readline().split()[1])  # "launched PID"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            ranks |= set(_ranks(launcher).values())
            if (point == "first-rank-forked" and ranks) or (point == "all-ranks-forked" and len(ranks) == 2):
                break
            if point == "training":
                assert reaper.stdout.readline(), "launcher ended before training"
                if len(ranks) == 2:
                    break
        assert ranks, "no rank started"
        reaper.stdin.write(",".join(map(str, sorted(ranks))) + "\n")
        reaper.stdin.flush()
        t_kill = time.monotonic()
        os.kill(launcher, signal.SIGKILL)
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(next(ln for ln in reaper.stdout if ln.startswith("reaped "))),
                                  daemon=True)
        reader.start()
        reader.join(300)  # a hang bound only (SIGKILL is immediate): a rank left alive trains on for ever
        assert got, f"ranks {sorted(r for r in ranks if _alive(r))} still alive 300 s after their launcher's SIGKILL"
        print(f"ranks reaped {time.monotonic() - t_kill:.2f} s after the launcher's SIGKILL")  # for the record
        reaper.wait(60)
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
        if reaper.poll() is None:
            reaper.kill()
            reaper.wait()
    how = json.loads(got[0].split(" ", 1)[1])
    assert set(how.values()) <= {f"signal {int(signal.SIGKILL)}", f"exit {128 + int(signal.SIGKILL)}"}, (point, how)
    assert len(how) == len(ranks)


def _first_step_line(launcher) -> str:
    """The launcher's first step line (auto's announcements, rrfp train's default, come first)."""
    while (line := launcher.stdout.readline()).startswith("rrfp train: hint auto"):
        pass
    return line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks' pids")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("checkpoints", [False, True], ids=["plain", "checkpoint-dir"])
def test_launcher_names_the_rank_killed_from_outside_not_rank_0(tmp_path, checkpoints):
    # The case: rank 1 got a SIGTERM from outside; the others leave because it was
    # lost (or the launcher stops them first), and the launcher must blame rank 1, whatever
    # order it notices the exits in. The launcher knows which ranks it signalled itself
    # (guard.LauncherSignals); with --checkpoint-dir a rank also has a SIGTERM handler.
    extra = ["--checkpoint-dir", str(tmp_path / "ckpt")] if checkpoints else []
    launcher = subprocess.Popen([sys.executable, "-m", "rrfp", "train", "--stages", "4", "--steps", "100000",
                                 "--batch-size", "8", "--microbatches", "4", "--max-len", "32", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _first_step_line(launcher).startswith("step"), launcher.stderr.read()[-2000:]
        by_rank = _ranks(launcher.pid)
        assert sorted(by_rank) == [0, 1, 2, 3]
        # The per-run secret reaches the forked ranks through the zygote's socket, not exec:
        # /proc/<rank>/environ (the zygote's environment at its start) does not hold it.
        assert not any(b"RRFP_JOB_SECRET=" in Path(f"/proc/{pid}/environ").read_bytes() for pid in by_rank.values())
        os.kill(by_rank[1], signal.SIGTERM)
        _, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    verdict = [ln for ln in err.splitlines() if ln.startswith("rrfp train: error: ")][-1]
    assert verdict == "rrfp train: error: rank 1 (pp 1, dp 0, tp 0) died (SIGTERM); ranks 0, 2, 3 stopped too", \
        err[-2000:]
    # Ranks that left on their own (the launcher may stop the slower ones first) name rank 1.
    said = re.findall(r"rank (\d): error: (.*)", err)
    assert all("rank 1 (pp 1, dp 0, tp 0) lost" in why for _, why in said), err[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks' pids")
@pytest.mark.timeout(1500)
def test_a_stalled_tp_rank_is_named_by_its_global_rank_everywhere():
    # --stages 2 --tp 2: global ranks 0 (pp 0, tp 0), 1 (pp 0, tp 1), 2 (pp 1, tp 0), 3 (pp 1,
    # tp 1). Rank 2 stalls (SIGSTOP); rank 0, its pipeline peer, loses pipeline rank 1 past the
    # transport's heartbeat timeout: that is global rank 2, and every report must say so, with
    # coordinates, never a pipeline rank read as a global one. Once a rank has reported, the
    # stalled rank is killed, so the launcher need not wait out its SIGTERM grace.
    launcher = subprocess.Popen([sys.executable, "-m", "rrfp", "train", "--stages", "2", "--tp", "2", "--steps",
                                 "100000", "--batch-size", "8", "--microbatches", "4", "--max-len", "32"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    said = threading.Condition()

    def read() -> None:
        for line in launcher.stderr:
            with said:
                lines.append(line)
                said.notify_all()
        with said:
            said.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    by_rank: dict[int, int] = {}
    try:
        assert _first_step_line(launcher).startswith("step"), "".join(lines)[-2000:]
        by_rank = _ranks(launcher.pid)
        assert sorted(by_rank) == [0, 1, 2, 3]
        os.kill(by_rank[2], signal.SIGSTOP)
        with said:
            said.wait_for(lambda: any(re.search(r"rank \d: error", ln) for ln in lines) or not reader.is_alive(), 600)
        os.kill(by_rank[2], signal.SIGKILL)
        launcher.wait(600)
        reader.join(30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if 2 in by_rank and _alive(by_rank[2]):
            os.kill(by_rank[2], signal.SIGKILL)
    err = "".join(lines)
    assert launcher.returncode == 1, err[-3000:]
    verdict = [ln for ln in err.splitlines() if ln.startswith("rrfp train: error: ")][-1]
    assert verdict.startswith("rrfp train: error: rank 2 (pp 1, dp 0, tp 0) "), err[-3000:]
    named = re.findall(r"rank (\d+) \(pp (\d+), dp (\d+), tp (\d+)\) lost", err)
    assert ("2", "1", "0", "0") in named, err[-3000:]  # rank 0's report of its pipeline peer
    assert all(int(r) == int(p) * 2 + int(t) and d == "0" for r, p, d, t in named), named
    assert not re.search(r"rank \d+ lost", err), err[-3000:]  # no rank named without coordinates


def test_blame_follows_global_ranks_named_with_coordinates():
    """A rank's one-line message names the lost peer as ``rank G (pp p, dp d, tp t)``: the
    launcher follows it to global rank G (no error file read back here), and names it the
    same way. Coordinates are pp-major: rank = (pp x dp_degree + dp) x tp_degree + tp."""
    from types import SimpleNamespace as NS

    from rrfp.parallel.layout import ParallelLayout
    from rrfp.train.cli import describe_failures
    from rrfp.train.guard import blamed_rank

    assert [ParallelLayout.name(r, 2, 2) for r in (0, 3, 6)] == [
        "rank 0 (pp 0, dp 0, tp 0)", "rank 3 (pp 0, dp 1, tp 1)", "rank 6 (pp 1, dp 1, tp 0)"]
    assert all(ParallelLayout.global_rank(3, 2, 2, *map(int, re.findall(r"\d+", ParallelLayout.name(r, 2, 2))[1:])) == r
               for r in range(12))
    line = "rrfp train: rank 0: error: PeerLost: rank 2 (pp 1, dp 0, tp 0) lost: connection closed"
    assert blamed_rank(RuntimeError(line), 0) == 2
    failures = {0: NS(exitcode=1, timestamp=10.0, message=line), 2: NS(exitcode=-15, timestamp=11.0, message=None)}
    assert describe_failures(failures, set(), (1, 2)) == \
        "rank 2 (pp 1, dp 0, tp 0) died (SIGTERM); rank 0 stopped too"
