"""The hostile cases of the field trial (issue 32 item 5), each one line and a non-zero exit
before anything runs: input files that are devices, FIFOs, huge or nested thousands deep; a
damaged ``rrfp.json``; output paths that are kernel interfaces; simulator studies without
bound and flags the chosen mode would ignore; a full disk during a save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp.cli import main

from cli_lines import error_line as _line


@pytest.fixture
def fifo(tmp_path) -> str:
    path = tmp_path / "fifo"
    os.mkfifo(path)  # nobody writes: reading it would block for ever
    return str(path)


@pytest.fixture
def huge(tmp_path) -> str:
    path = tmp_path / "huge"
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: reading it whole would take that much memory
    return str(path)


@pytest.mark.parametrize("kind, tail", [("dev_zero", "is a device, not a regular file: expected a file"),
                                        ("fifo", "is a FIFO, not a regular file: expected a file"),
                                        ("huge", f"is {8 << 30} bytes, expected at most {1 << 20}")])
def test_config_naming_dev_zero_a_fifo_or_a_huge_file_is_refused_unread(kind, tail, request, capsys, no_launch):
    path = "/dev/zero" if kind == "dev_zero" else request.getfixturevalue(kind)
    assert main(["train", "--config", path]) == 2
    assert _line(capsys, "train") == f"--config={path!r}: {tail}"


@pytest.mark.parametrize("kind, tail", [("dev_zero", "is a device, not a regular file: expected a file"),
                                        ("fifo", "is a FIFO, not a regular file: expected a file"),
                                        ("huge", f"is {8 << 30} bytes, expected at most {1 << 16}")])
def test_job_secret_file_naming_dev_zero_a_fifo_or_a_huge_file_is_refused_unread(kind, tail, request, capsys,
                                                                                   no_launch):
    path = "/dev/zero" if kind == "dev_zero" else request.getfixturevalue(kind)
    assert main(["train", "--job-secret-file", path]) == 2
    assert _line(capsys, "train") == f"--job-secret-file: job secret file {path!r}: {tail}"


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000])
def test_toml_nested_5000_deep_is_refused_in_one_line(value, tmp_path, capsys, no_launch):
    cfg = tmp_path / "deep.toml"
    cfg.write_text(f"steps = 3\ndata = {value}\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert _line(capsys, "train") == (f"--config={str(cfg)!r}: arrays or inline tables nested 5000 deep, expected at "
                                      "most 16 (a flag takes a value or a list)")


def test_toml_nesting_counts_brackets_outside_strings_and_comments_only():
    from rrfp.train.config import nesting

    text = ('# [[[[[[\n[table]\na = "[[[[ \\" [[["\nb = \'[[[[\'\nc = """ [[[[ "" """\n'
            "d = '''[[[[['''\ne = [[1, [2]], {x = [3]}]\n")
    import tomllib

    tomllib.loads(text)  # valid TOML
    assert nesting(text) == 3  # e's [[2]] and [{x = [3]}]


def _meta(**change) -> dict:
    """A committed checkpoint's description, as rrfp writes it (format 3)."""
    meta = {"format": 3, "step": 2, "world_size": 2,
            "args": {"stages": 2, "virtual_stages": 1, "placement": "loop", "model": "tiny", "max_len": 64, "tp": 1,
                     "seed": 0, "batch_size": 8, "dp": 1, "dp_shard": "none"},
            "data": {"next_step": 2, "n_samples": 8192}, "run_id": "r", "lr_schedule": {"last_epoch": 2},
            "hint": "strict-1f1b", "model_config": {"kind": "gpt", "config": {"n_layer": 4}},
            "files": {"__0_0.distcp": {"bytes": 10, "sha256": "0" * 64}}}
    meta.update(change)
    return meta


@pytest.mark.parametrize("change, tail", [
    ({"args": []}, '"args" is an empty list, expected an object of the run\'s flags'),
    ({"data": {}}, '"data.next_step" is missing or null, expected an integer >= 0'),
    ({"data": {"next_step": 2, "n_samples": "8192"}}, '"data.n_samples" is the string \'8192\', expected an integer >= 0'),
    ({"args": {**_meta()["args"], "max_len": None}}, '"args.max_len" is missing or null, expected an integer'),
    ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}},
     "\"files\" names '../../etc/passwd', expected a file name inside the checkpoint folder"),
    ({"step": True}, '"step" is true, expected a number of steps >= 0'),
    ({"model_config": {"kind": "gpt"}}, '"model_config" lacks its kind or config, expected {"kind": ..., "config": {...}}'),
])
def test_rrfp_json_with_args_a_list_or_data_empty_is_refused_in_one_line(change, tail, tmp_path, capsys, no_launch):
    ck = tmp_path / "step-00000002"
    ck.mkdir()
    (ck / "rrfp.json").write_text(json.dumps(_meta(**change)))
    assert main(["train", "--resume", str(ck)]) == 2
    assert _line(capsys, "train") == f"--resume={str(ck)!r}: {ck / 'rrfp.json'}: {tail}"
    assert main(["export", str(ck), "--out", str(tmp_path / "hf")]) == 2
    assert _line(capsys, "export") == f"{str(ck)!r}: {ck / 'rrfp.json'}: {tail}"


@pytest.mark.parametrize("flag", ["--log-file", "--loss-file"])
def test_log_and_loss_file_on_proc_self_mem_are_refused_before_launch(flag, capsys, no_launch):
    assert main(["train", flag, "/proc/self/mem"]) == 2
    line = _line(capsys, "train")
    assert line.startswith(f"{flag}='/proc/self/mem': is a kernel interface on proc (/proc), not a file"), line


def test_export_out_on_proc_self_mem_is_refused_before_reading(tmp_path, capsys):
    ck = tmp_path / "step-00000002"
    ck.mkdir()
    (ck / "rrfp.json").write_text(json.dumps(_meta()))
    assert main(["export", str(ck), "--out", "/proc/self/mem"]) == 2
    assert _line(capsys, "export").startswith("--out='/proc/self/mem': ")


@pytest.mark.parametrize("argv, tail", [
    (["--sweep", "--depths", "100000"], "--depths 100000: expected at most 1024"),
    (["--sweep", "--depths", "1024", "--mb-per-stage", "4"],
     "--depths x --mb-per-stage x --jitter-levels x --imbalance x --seeds x hints: 150,994,944 tasks to simulate in "
     "all, expected at most 50,000,000 (fewer or shallower points)"),
    (["--sweep", "--seeds", "100000"], "--seeds 100000: expected at most 1000"),
    (["--suite", "--suite-ranks", "100000"], "--suite-ranks 100000: expected at most 1024"),
    (["--suite", "--suite-ranks", "256"],
     "--suite-ranks x --suite-scenarios x --seeds x hints: 849,346,560 tasks to simulate in all, expected at most "
     "50,000,000 (fewer or shallower points)"),
])
def test_simulate_sweep_with_depths_100000_is_refused_in_one_line(argv, tail, tmp_path, capsys):
    assert main(["simulate", *argv, "--out", str(tmp_path / "sweep")] if "--sweep" in argv
                else ["simulate", *argv]) == 2
    assert _line(capsys, "simulate") == tail
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, tail", [
    (["--encoder-stages", "100"], "--encoder-stages 100: the pipeline has 4 stages (4 ranks x 1 virtual), expected "
                                  "at most that many"),
    (["--encoder-stages", "2"], "--encoder-stages changes nothing without --images or --encoder-scale or --imbalance"),
    (["--samples-per-mb", "8"], "--samples-per-mb changes nothing without --images"),
    (["--depths", "4,8", "--seeds", "3"], "a single run (without --sweep or --suite) does not read --depths (a --sweep "
                                          "axis), --seeds (a single run simulates --seed; --seeds counts the seeds of "
                                          "--sweep and --suite)"),
    (["--suite-jobs", "2"], "a single run (without --sweep or --suite) does not read --suite-jobs (sets up --suite)"),
    (["--sweep", "-p", "8", "--jitter", "J2"], "--sweep does not read --ranks (--depths sets them), --jitter "
                                               "(--jitter-levels sets it)"),
    (["--sweep", "--csv", "x.csv", "--trace", "t"], "--sweep does not read --csv (a sweep writes --out PREFIX.csv), "
                                                    "--trace (a sweep writes no traces)"),
    (["--sweep", "--suite"], "--sweep and --suite: expected one of them (a sweep and a suite are separate studies)"),
])
def test_simulate_refuses_encoder_stages_100_and_other_flags_its_mode_does_not_read(argv, tail, capsys):
    assert main(["simulate", *argv]) == 2
    assert _line(capsys, "simulate") == tail


def test_simulate_suite_reads_plugin_for_its_hints(capsys):
    """``--plugin`` makes a plugin's hints names ``--hint`` takes, so ``--suite`` reads it: the
    suite goes on to its own checks (here the bound on its work), not "does not take --plugin"."""
    assert main(["simulate", "--suite", "--plugin", "json", "--suite-ranks", "256"]) == 2
    assert _line(capsys, "simulate").startswith("--suite-ranks x --suite-scenarios x --seeds x hints: 849,346,560 tasks")


def test_save_errors_name_no_space_left_and_the_folder(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as "unexpected pos": the line says what it is
    (the file system is full) and where, and the job's half-written folder is deleted."""
    from torch.distributed.checkpoint.api import CheckpointException

    from rrfp.train import ckpt_verify
    from rrfp.train.ckpt_lock import job_tag

    half = tmp_path / f".tmp-step-00000004-{job_tag()}-abc"
    half.mkdir()
    kept = tmp_path / "step-00000002"
    kept.mkdir()

    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(ckpt_verify.os, "statvfs", lambda path: Full())
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with pytest.raises(ckpt_verify.CheckpointNotSaved) as e:
        with ckpt_verify.save_errors(tmp_path, 4, rank=0):
            raise CheckpointException("write", {0: (err, None), 1: (err, None)})
    assert str(e.value) == (f"the checkpoint of step 4 could not be written in {str(tmp_path)!r} (No space left on "
                            f"device (12288 bytes free); rank 0: RuntimeError: [enforce fail at inline_container.cc:672]"
                            f" . unexpected pos 704 vs 598); the last committed checkpoint is kept")
    assert not half.exists() and kept.is_dir()


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_disk_during_a_checkpoint_save_is_one_line_naming_no_space_left(tmp_path):
    """``rrfp train`` saving into a 6 MiB tmpfs: the checkpoint of step 2 (4 MiB) fits, the one
    of step 4 does not. Every rank says so in one line naming "No space left" and the folder,
    no traceback (main: 594 lines, 20 tracebacks), exit 1; step 2's checkpoint is intact and
    no half-written folder is left."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "6m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        ck = disk / "ck"
        p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--pp", "2", "--steps", "4", "--checkpoint-every", "2",
                            "--checkpoint-keep", "2", "--batch-size", "8", "--microbatches", "4", "--max-len", "64",
                            "--threads", "1", "--checkpoint-dir", str(ck), "--quiet"],
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 1, p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) <= 5, p.stderr
        said = [ln for ln in p.stderr.splitlines() if ln.startswith("rrfp train: rank ")]
        # torch reports the full disk either as the writer's OSError (Errno 28) or as its zip writer's
        # "unexpected pos", which save_errors prefixes with the free bytes: both name it.
        assert said and all(f"could not be written in {str(ck)!r} (" in ln and "No space left on device" in ln
                            for ln in said), said
        assert sorted(d.name for d in ck.iterdir() if not d.name.startswith(".rrfp-")) == ["step-00000002"]
        from rrfp.train.checkpoint import read_meta
        from rrfp.train.ckpt_verify import check_files

        assert check_files(ck / "step-00000002", read_meta(ck / "step-00000002")) is None
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_per_run_secret_is_in_no_ranks_environment(tmp_path):
    """``rrfp train``'s per-run secret reaches its ranks in memory: each holds it as a file of
    mode 0600 that no folder holds (``memfd_create``, README "Security"), not in their
    environment, which ``/proc/<rank>/environ`` shows for the process's whole life (main: it
    is there), and no ``rrfp-secret-*`` folder of the launcher's is ever made (before: one in
    /dev/shm, which a SIGKILLed launcher left behind)."""
    import glob
    import signal
    import stat
    import tempfile

    from procs import Proc, rank_pids

    env = {k: v for k, v in os.environ.items() if k not in ("RRFP_JOB_SECRET", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    launcher = Proc([sys.executable, "-m", "rrfp", "train", "--pp", "2", "--steps", "100000", "--batch-size", "4",
                     "--microbatches", "2", "--max-len", "32", "--threads", "1"], dict(env, OMP_NUM_THREADS="1"))
    try:
        launcher.wait_for("loss", 600)  # a step line: both ranks run
        ranks = rank_pids(launcher.p.pid)
        assert sorted(ranks) == [0, 1], ranks
        secrets = []
        for pid in ranks.values():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [e for e in environ if e.startswith(b"RRFP_JOB_SECRET=")]
            (fd,) = [f for f in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(f) == "/memfd:rrfp-job-secret (deleted)"]
            st = os.stat(fd)
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.getuid())
            secrets.append(fd.read_bytes().strip())
        assert len(secrets[0]) >= 16 and secrets[0] == secrets[1]
        assert not [f for d in ("/dev/shm", tempfile.gettempdir()) for f in glob.glob(f"{d}/rrfp-secret-{launcher.p.pid}-*")]
        launcher.p.send_signal(signal.SIGTERM)
        assert launcher.finish(300) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
