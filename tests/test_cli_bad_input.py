"""Bad input found by the adversarial passes: one line, exit code 2, before any process starts,
nothing lost (no folder created, no file changed)."""

from __future__ import annotations

import json

import pytest

from rrfp.cli import main

from cli_lines import error_line
from rrfp.errors import UsageError

NODE_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
            "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launch(no_launch, monkeypatch):
    """conftest's: fail the test if anything would start a process; and no job or node
    variables inherited from the environment."""
    for k in NODE_ENV:
        monkeypatch.delenv(k, raising=False)


def _one_line(capsys, cmd: str) -> str:
    return f"rrfp {cmd}: error: {error_line(capsys, cmd)}"


@pytest.mark.parametrize("addr", ["bad host", "", "a/b", "[::1"])
def test_node_bad_master_addr(addr, capsys, no_launch):
    assert main(["node", "--master-addr", addr, "--", "--stages", "2"]) == 2
    line = _one_line(capsys, "node")
    assert f"--master-addr={addr!r}: expected a host name, an IPv4 address or an IPv6 address" in line


@pytest.mark.parametrize("host", ["head-0.job.svc", "10.0.0.1", "::1", "fe80::1", "2001:db8::7", "node_1", "a",
                                  "bad host", "", "a/b", "[::1", "[::1]", "fe80::1%eth0", "h:1", "x y.z", "ü.example"])
def test_node_host_check_accepts_only_what_the_agent_accepts(host):
    """rrfp node checks hosts before torch loads; whatever it accepts, the elastic agent's own
    endpoint parser accepts too (the agent would otherwise fail with a traceback)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from rrfp.node.cli import _check_host

    try:
        _check_host(host, "--master-addr")
    except UsageError:
        return
    assert parse_rendezvous_endpoint(f"{host}:29500", default_port=29500) == (host, 29500)


def test_node_bad_master_addr_from_the_environment_names_the_variable(capsys, no_launch, monkeypatch):
    monkeypatch.setenv("PET_MASTER_ADDR", "bad host")
    assert main(["node", "--", "--stages", "2"]) == 2
    assert "PET_MASTER_ADDR='bad host': expected a host name" in _one_line(capsys, "node")


def test_node_good_addresses_pass(no_launch):
    import argparse

    from rrfp.node.cli import resolve

    for addr in ("head-0.job.svc", "10.0.0.1", "::1", "fe80::1"):
        ns = argparse.Namespace(nnodes=None, nproc_per_node=None, node_rank=None, master_addr=addr,
                                master_port=None, max_restarts=3, metrics_port=0, metrics_linger=0.0,
                                metrics_addr="127.0.0.1", heartbeat_timeout=60.0, node_addr="127.0.0.1",
                                job_id="rrfp", extra=["--", "--stages", "2"])
        assert resolve(ns).master_addr == addr


def test_node_refuses_dotted_digits_that_are_no_ipv4_address_without_a_lookup(capsys, no_launch):
    # A name lookup of 999.9.9.9 waited over a minute before failing.
    assert main(["node", "--master-addr", "999.9.9.9", "--", "--stages", "2"]) == 2
    assert "--master-addr='999.9.9.9': not an IPv4 address (four numbers 0-255)" in _one_line(capsys, "node")


def test_node_bad_node_addr(capsys, no_launch):
    assert main(["node", "--node-addr", "no such host", "--", "--stages", "2"]) == 2
    assert "--node-addr='no such host': expected a host name" in _one_line(capsys, "node")


def test_node_master_port_0_only_on_node_0(capsys, no_launch):
    """Port 0 (any free port) is node 0's to pick and tell; another node must be told it."""
    assert main(["node", "--nnodes", "2", "--node-rank", "1", "--master-port", "0", "--", "--stages", "2"]) == 2
    assert "--master-port=0: expected a port in 1..65535 (0, any free port, on node 0 only)" in _one_line(capsys, "node")
    assert main(["node", "--master-port", "65536", "--", "--stages", "2"]) == 2
    assert "--master-port=65536: expected a port in 1..65535" in _one_line(capsys, "node")


def test_node_run_dir_that_is_a_file(tmp_path, capsys, no_launch):
    f = tmp_path / "file"
    f.write_text("keep me")
    assert main(["node", "--run-dir", str(f), "--", "--stages", "2"]) == 2
    assert f"--run-dir={str(f)!r}: is a file, expected a folder" in _one_line(capsys, "node")
    assert f.read_text() == "keep me"
    assert main(["node", "--run-dir", str(f / "below"), "--", "--stages", "2"]) == 2
    assert f"--run-dir={str(f / 'below')!r}: cannot write into the folder" in _one_line(capsys, "node")


# ----------------------------------------------------------------------------- checkpoints
SMALL = ["--stages", "2", "--batch-size", "4", "--microbatches", "2", "--max-len", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint (2 ranks, 2 steps, with the digests of its files): its folder."""
    import os
    import subprocess
    import sys

    from rrfp.train import checkpoint as ck

    d = tmp_path_factory.mktemp("ck")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", *SMALL, "--steps", "2", "--checkpoint-dir", str(d),
                        "--quiet"], capture_output=True, text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert ck.latest(d) == ck.step_dir(d, 2)
    return d


def _copy(checkpoint, tmp_path):
    import shutil

    return shutil.copytree(checkpoint, tmp_path / "ck")


def _resume(capsys, ckdir, *flags) -> tuple[int, str, str]:
    rc = main(["train", *SMALL, "--checkpoint-dir", str(ckdir), "--resume", "auto", *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_damaged_shard_is_one_line_naming_the_file(checkpoint, tmp_path, capsys, no_launch):
    from rrfp.train import checkpoint as ck

    d = _copy(checkpoint, tmp_path)
    step = ck.step_dir(d, 2)
    shard = step / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    n = len(data)
    data[n // 2] ^= 1  # one bit inside a tensor's bytes: DCP itself would load it without a word
    shard.write_bytes(bytes(data))
    rc, out, err = _resume(capsys, d, "--steps", "4")
    assert (rc, out) == (2, "")
    assert err == (f"rrfp train: error: checkpoint {str(step)!r}: shard __1_0.distcp differs from the one "
                   "written with it (damaged after saving)\n")
    shard.write_bytes(bytes(data[: n // 2]))
    rc, _, err = _resume(capsys, d, "--steps", "4")
    assert rc == 2 and err == (f"rrfp train: error: checkpoint {str(step)!r}: shard __1_0.distcp has {n // 2} "
                               f"bytes, expected {n} (truncated or damaged)\n")
    # An intact older checkpoint is named as the way on (never taken silently).
    import shutil

    older = ck.step_dir(d, 1)
    shutil.copytree(checkpoint / step.name, older)
    rc, _, err = _resume(capsys, d, "--steps", "4")
    assert rc == 2 and err == (f"rrfp train: error: checkpoint {str(step)!r}: shard __1_0.distcp has {n // 2} "
                               f"bytes, expected {n} (truncated or damaged); the newest intact one is "
                               f"{str(older)!r} (resume it with --resume {older})\n")
    shutil.rmtree(older)
    shard.unlink()
    rc, _, err = _resume(capsys, d, "--steps", "4")
    assert rc == 2 and "shard __1_0.distcp is unreadable (No such file or directory)" in err and err.count("\n") == 1
    (step / ".metadata").write_bytes(b"not a pickle")
    rc, _, err = _resume(capsys, d, "--steps", "4")
    assert rc == 2 and ".metadata differs from the one written with it" in err and err.count("\n") == 1


@pytest.mark.timeout(300)
def test_ranks_check_their_share_and_name_the_first_damaged_file(checkpoint, tmp_path):
    """What each rank runs at load time (Checkpointer._check_files): its share of the files,
    every one of which must have its digest; DCP's own failure becomes one line."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from rrfp.train import checkpoint as ck
    from rrfp.train.ckpt_verify import METADATA, check_files, first_line, shard_names

    d = _copy(checkpoint, tmp_path)
    step = ck.step_dir(d, 2)
    meta = ck.read_meta(step)
    assert shard_names(meta) == ["__0_0.distcp", "__1_0.distcp"]
    assert check_files(step, meta) is None
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "__0_0.distcp differs" in check_files(step, meta, only=["__0_0.distcp", METADATA])
    assert check_files(step, meta, only=["__1_0.distcp"]) is None  # rank 1's share is intact
    shard.write_bytes(bytes(data[:-10]))
    assert "__0_0.distcp has" in check_files(step, meta) and "truncated" in check_files(step, meta)
    cut = {**meta, "files": {k: v for k, v in meta["files"].items() if k != "__1_0.distcp"}}
    assert check_files(step, cut, only=["__0_0.distcp"]) == (
        f"checkpoint {str(step)!r}: shard __1_0.distcp has no digest in its rrfp.json, so it cannot be verified")
    try:
        raise RuntimeError("PytorchStreamReader failed reading zip archive\nmore\nlines")
    except RuntimeError as e:
        wrapped = CheckpointException("read", {1: _wrap_exception(e)})
    assert first_line(wrapped) == "rank 1: RuntimeError: PytorchStreamReader failed reading zip archive"


@pytest.mark.timeout(300)
def test_a_checkpoint_without_its_digests_is_refused_in_one_line(checkpoint, tmp_path, capsys, no_launch):
    """rrfp.json's 'files' deleted (as in the field trial) no longer switches the checks off."""
    from rrfp.train import checkpoint as ck

    d = _copy(checkpoint, tmp_path)
    step = ck.step_dir(d, 2)
    meta = json.loads((step / ck.META_FILE).read_text())
    del meta["files"]
    (step / ck.META_FILE).write_text(json.dumps(meta))
    rc, out, err = _resume(capsys, d, "--steps", "4")
    assert (rc, out) == (2, "")
    assert err == (f"rrfp train: error: checkpoint {str(step)!r}: its rrfp.json records no digests of its files "
                   "('files' is missing or has no .metadata), so it cannot be verified before loading: expected a "
                   "checkpoint as rrfp train commits it\n")
    from rrfp.cli import main as rrfp_main

    assert rrfp_main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records no digests of its files" in err and not (tmp_path / "hf").exists()


@pytest.mark.timeout(300)
def test_resume_past_or_at_the_end(checkpoint, capsys, no_launch):
    from rrfp.train import checkpoint as ck

    step = ck.step_dir(checkpoint, 2)
    rc, out, err = _resume(capsys, checkpoint, "--steps", "1")
    assert (rc, out) == (2, "")
    assert err == (f"rrfp train: error: --resume auto (newest checkpoint {str(step)!r}) is at step 2, past "
                   "--steps=1: --steps counts every optimizer step of the run, expected at least 2\n")
    # A finished run started again (a restarted job): nothing to do, said in one line, exit 0.
    rc, out, err = _resume(capsys, checkpoint, "--steps", "2")
    assert (rc, err) == (0, "")
    assert out == (f"rrfp train: nothing to do: checkpoint {step} is at step 2, --steps=2 (--steps counts every "
                   "optimizer step of the run: raise it to train further)\n")
    rc, out, err = main(["train", *SMALL, "--resume", str(step), "--steps", "1"]), *capsys.readouterr()
    assert rc == 2 and f"--resume={str(step)!r} is at step 2, past --steps=1" in err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags,needle", [
    (["--seed", "3"], "was written with --seed 0, this run has --seed 3: expected the same\n"),
    (["--max-len", "64"], "was written with --max-len 32, this run has --max-len 64"),
    (["--batch-size", "8"], "was written with --batch-size 4, this run has --batch-size 8"),
    (["--model", "small"], "was written with --model tiny, this run has --model small"),
])
def test_resume_with_other_flags_is_refused_before_any_process_starts(checkpoint, capsys, no_launch, flags, needle):
    rc, out, err = _resume(capsys, checkpoint, "--steps", "4", *flags)
    assert (rc, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("rrfp train: error: --resume auto (newest checkpoint ") and needle in err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags,layout", [
    (["--dp", "2"], {"dp": 2}), (["--stages", "4"], {"stages": 4}), (["--tp", "2"], {"tp": 2}),
    (["--virtual-stages", "2"], {"virtual_stages": 2}),
    (["--placement", "v", "--virtual-stages", "2"], {"placement": "v", "virtual_stages": 2}),
])
def test_resume_under_another_layout_passes_the_checks_and_launches(checkpoint, capsys, no_launch, flags, layout):
    """A checkpoint keyed by the model's names resumes under any layout (tests/test_ckpt_layouts.py
    runs them); one keyed by stage index (format 2) only under another --dp."""
    import argparse

    from rrfp.train import checkpoint as ck

    with pytest.raises(AssertionError, match="a process was launched"):
        _resume(capsys, checkpoint, "--steps", "4", *flags)
    assert capsys.readouterr().err == ""
    meta = ck.read_meta(ck.step_dir(checkpoint, 2))
    args = argparse.Namespace(**{**meta["args"], **layout})
    assert ck.check_compatible(meta, args, "it") is None
    why = ck.check_compatible({**meta, "format": 2}, args, "it")
    if "dp" in layout:
        assert why is None
    else:
        assert why.endswith("expected the same (a checkpoint of format 2, keyed by stage index, resumes under "
                            "another --dp only)")


@pytest.mark.timeout(300)
def test_node_refuses_a_checkpoint_that_does_not_fit(checkpoint, capsys, no_launch):
    # rrfp node resumes automatically (--resume auto): checked by the daemon before the agent starts.
    assert main(["node", "--", *SMALL, "--steps", "4", "--seed", "5", "--checkpoint-dir", str(checkpoint)]) == 2
    assert "was written with --seed 0, this run has --seed 5" in _one_line(capsys, "node")


# ----------------------------------------------------------------------------- progress lines
def test_notes_print_after_the_step_line_they_follow():
    """Rank 0 prints step k's line only once every rank's statistics for k are in; an
    evaluation or a committed checkpoint of step k can be known before that (forced order
    here: the notes arrive first) and must still come after it."""
    from types import SimpleNamespace

    from rrfp.scheduler.tasks import Placement
    from rrfp.train.progress import Output
    from rrfp.train.report import Reporter

    class Lines:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines += [ln for ln in text.splitlines() if ln]

        def flush(self):
            pass

    stream = Lines()
    args = SimpleNamespace(steps=3, microbatches=2, quiet=False, hint="bf", skip_nonfinite=False)
    rep = Reporter(args, 2, Placement(2, 1, "loop"), Output(3, stream=stream, bar=False))

    def stats(step, src):
        rep.add({"kind": "stats", "step": step, "busy": 0.5, "wall": 1.0, "peak": 1,
                 "loss": 2.0 - step / 10 if src == 1 else None}, src)

    for k in range(3):
        rep.step_time[k], rep.tokens[k] = 1.0, 10
    stats(0, 0)
    rep.add({"kind": "eval", "step": 1, "loss": 3.5}, 1)   # evaluated after step 1 ...
    rep.note(1, "checkpoint after step 1")                  # ... and checkpointed ...
    assert stream.lines == []                               # ... before rank 1's step-1 statistics
    stats(0, 1)
    rep.flush()
    stats(1, 0)
    stats(1, 1)
    rep.flush()
    rep.note(2, "checkpoint after step 2")                  # its step line is out: at once
    rep.note(3, "stopped after step 3")
    rep.flush_notes()                                        # a failing run still tells it
    assert [ln.split()[0] + " " + ln.split()[1] if ln.startswith("step") else ln for ln in stream.lines] == [
        "step 1/3", "eval after step    1/3  validation loss  3.5000", "checkpoint after step 1",
        "step 2/3", "checkpoint after step 2", "stopped after step 3"]


@pytest.mark.parametrize("flags,needle", [
    (["--hint", "nope"], "unknown hint 'nope'"),
    (["--steps", "abc"], "invalid int value: 'abc'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_rrfp_train_refuses_bad_flags_before_importing_torch(flags, needle):
    # A fresh interpreter: whether torch got imported is a fact of that process alone.
    import subprocess
    import sys

    code = ("import sys\nfrom rrfp.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('torch' in sys.modules, rc)\n")
    p = subprocess.run([sys.executable, "-c", code, "train", *flags], capture_output=True, text=True, timeout=600)
    assert p.stdout.split() == ["False", "2"], (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp train: error: ") and needle in lines[0], p.stderr


def test_an_hf_folder_with_fewer_positions_than_max_len_names_the_most_it_takes(tmp_path):
    import argparse
    import json

    from rrfp.train.models import hf_layers, hf_missing

    if hf_missing() is not None:
        pytest.skip(hf_missing())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "n_layer": 2}))
    args = argparse.Namespace(model=f"hf:{tmp_path}", tp=1, max_len=128)
    with pytest.raises(Exception, match=rf"^--max-len=128 exceeds the 64 positions of --model='hf:{tmp_path}': "
                                        r"expected --max-len 64 or less$"):
        hf_layers(args)
