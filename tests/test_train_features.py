"""`rrfp train`'s job features: config file, --stages under torchrun, evaluation, learning-rate
schedule, global gradient clipping, bf16 autocast, progress output, log file, trace steps,
`| head`, --version. Each against an independent reference (torch's own clipping and
schedulers on one process, hand-computed values)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from handover import host_store, rank_env
from rrfp.cli import main

TEXT = "\n\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200))


def _no_launch(monkeypatch, seen=None):
    def fake_launch(args):
        if seen is not None:
            seen.append(args)
        return 0

    monkeypatch.setattr("rrfp.train.cli.launch", fake_launch)


@pytest.mark.parametrize("argv,needle", [
    (["--eval-every", "-1"], "--eval-every=-1"),
    (["--warmup", "50", "--steps", "10"], "--warmup=50: expected 0..10"),
    (["--min-lr", "1.0"], "--min-lr=1.0"),
    (["--clip-grad", "0"], "--clip-grad=0.0"),
    (["--clip-grad", "nan"], "--clip-grad=nan"),
    (["--trace-steps", "3:5"], "needs --trace DIR"),
    (["--trace", "TRACE", "--trace-steps", "5:3"], "--trace-steps='5:3': expected 1 <= A <= B <= --steps=40"),
    (["--trace", "TRACE", "--trace-steps", "x"], "--trace-steps='x': expected A:B"),
    (["--log-file", "/no/such/dir/x.log"], "--log-file='/no/such/dir/x.log'"),
    (["--log-file", "TMPDIR"], "--log-file='TMPDIR': is a folder, expected a file path"),
    (["--log-file", "/dev/full"], "--log-file='/dev/full': is not a regular file, expected a file path"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
])
def test_bad_job_flags_are_one_line_and_exit_2(argv, needle, capsys, monkeypatch, tmp_path):
    _no_launch(monkeypatch)
    argv = [str(tmp_path / "tr") if a == "TRACE" else a for a in argv]
    argv = [str(tmp_path) if a == "TMPDIR" else a for a in argv]
    needle = needle.replace("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) if "invalid choice" in needle else _nullcontext() as exc:
        code = main(["train", *argv])
    code = exc.value.code if exc is not None and hasattr(exc, "value") else code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_config_file_keys_are_the_flags_and_the_command_line_wins(tmp_path, monkeypatch):
    seen = []
    _no_launch(monkeypatch, seen)
    cfg = tmp_path / "job.toml"
    cfg.write_text('steps = 7\nbatch-size = 16\nhint = "bfw"\ndeterministic = true\nlr_schedule = "cosine"\n')
    assert main(["train", "--config", str(cfg), "--steps", "9"]) == 0
    args = seen[0]
    assert (args.steps, args.batch_size, args.hint, args.deterministic, args.lr_schedule) == (9, 16, "bfw", True, "cosine")


@pytest.mark.parametrize("text,needle", [
    ("stepz = 3\n", "unknown key 'stepz' (expected one of:"),
    ("steps = 'many'\n", "key 'steps': expected int, got 'many'"),
    ("steps = 2.5\n", "key 'steps': expected an integer"),
    ("deterministic = 1\n", "key 'deterministic': expected true or false"),
    ("placement = 'diagonal'\n", "'diagonal' is not one of loop, v"),
    ("steps = [\n", "not valid TOML"),
])
def test_bad_config_is_one_line(tmp_path, monkeypatch, capsys, text, needle):
    _no_launch(monkeypatch)
    cfg = tmp_path / "job.toml"
    cfg.write_text(text)
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_stages_default_to_the_world_size_under_torchrun(monkeypatch, capsys):
    from rrfp.train import early

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    monkeypatch.setattr("rrfp.train.worker.main", lambda args: seen.append(args.stages) or 0)
    assert main(["train"]) == 0 and seen == [2]
    assert main(["train", "--stages", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rrfp train: error: --pp=4 but this torchrun job has 2 processes (world size): "
                   "drop --pp or launch 4 processes per pipeline"]
    monkeypatch.delenv("WORLD_SIZE")
    args = early.argparse.Namespace(stages=None)
    early.resolve_stages(args)
    assert args.stages == 4


def test_lr_schedule_is_warmup_then_cosine():
    from rrfp.train.optim import lr_scheduler

    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = lr_scheduler(opt, steps=10, warmup=4, schedule="cosine", min_lr=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.9 * (1 + math.cos(math.pi * k / 6)) / 2 for k in range(6)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # after the last step: min_lr
    with pytest.raises(ValueError, match="warm-up 11 steps"):
        lr_scheduler(opt, steps=10, warmup=11, schedule="cosine", min_lr=0.0)


def _clip_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(rank_env(rank, 2, port))
    import torch.distributed as dist

    from rrfp.parallel.clip import clip_grad_norm_

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    mine = params[:2] if rank == 0 else params[2:]  # each rank holds its stage's parameters
    total = clip_grad_norm_(mine, 1.0)
    torch.save({"total": total, "grads": [p.grad for p in mine]}, f"{out}/clip{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_clip_grad_norm_is_global_across_stages(tmp_path):
    from handover import process

    store, port = host_store(2)
    procs = [process(_clip_rank, r, port, str(tmp_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0, 0]
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]]
    torch.manual_seed(0)
    for p, g in zip(ref, [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]):
        p.grad = g.clone()
    ref_total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    r0, r1 = (torch.load(tmp_path / f"clip{r}.pt") for r in range(2))
    assert r0["total"] == pytest.approx(float(ref_total), rel=1e-6) == r1["total"]
    for got, want in zip(r0["grads"] + r1["grads"], ref):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_forward_and_float32_logits():
    from rrfp.train.precision import use_autocast

    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    seen = []
    lin[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    use_autocast(lin, "bf16", "cpu", last=True)
    out = lin(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    mid = torch.nn.Linear(4, 3)
    use_autocast(mid, "bf16", "cpu", last=False)
    assert mid(torch.randn(2, 4)).dtype == torch.bfloat16
    plain = torch.nn.Linear(4, 3)
    use_autocast(plain, "fp32", "cpu", last=False)
    assert plain(torch.randn(2, 4)).dtype == torch.float32 and "forward" not in plain.__dict__


def test_progress_bar_on_a_terminal_plain_lines_otherwise(tmp_path):
    from rrfp.train.progress import Output

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    out = Output(3, stream=tty, log_file=str(tmp_path / "a.log"))
    assert out.bar is not None
    for k in range(3):
        out.step(f"step {k + 1}/3 line", postfix=f"loss {k}")
    out.message("eval line")
    out.close()
    text = tty.getvalue()
    assert "3/3" in text and "eval line" in text and "step 1/3 line" not in text
    assert (tmp_path / "a.log").read_text().splitlines() == ["step 1/3 line", "step 2/3 line", "step 3/3 line",
                                                            "eval line"]
    pipe = io.StringIO()
    out = Output(2, stream=pipe)
    assert out.bar is None
    out.step("step 1/2 line")
    out.close()
    assert pipe.getvalue() == "step 1/2 line\n"


def test_a_terminal_0_columns_wide_gets_plain_lines_not_an_invisible_bar():
    """A pty nobody sized (``script``, some CI runners) reports 0 columns: a tqdm bar there
    draws nothing, so the run showed no step at all; it gets plain lines. Sized, the bar."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    from rrfp.train.progress import Output

    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            assert tty.isatty() and os.get_terminal_size(slave).columns == 0
            out = Output(2, stream=tty)
            assert out.bar is None
            out.step("step 1/2 line")
            out.close()
            tty.flush()
            assert b"step 1/2 line" in os.read(master, 4096)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            out = Output(2, stream=tty)
            assert out.bar is not None
            out.close()
    finally:
        os.close(slave)
        os.close(master)


def test_version():
    p = subprocess.run([sys.executable, "-m", "rrfp", "--version"], capture_output=True, text=True, timeout=60)
    import rrfp

    assert p.returncode == 0 and p.stdout.strip() == f"rrfp {rrfp.__version__}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_with_every_feature(tmp_path):
    """Config file, evaluation on a held-out split, warm-up + cosine, clipping, bf16, log file,
    trace steps: one 2-rank run."""
    data = tmp_path / "code.py"
    data.write_text(TEXT)
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'stages = 2\nsteps = 4\nbatch-size = 4\nmicrobatches = 2\nmax-len = 32\ndata = ["{data}"]\n'
                   'eval-every = 2\neval-batches = 1\nwarmup = 1\nlr-schedule = "cosine"\nclip-grad = 0.5\n'
                   'precision = "bf16"\n')
    log = tmp_path / "run.log"
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--config", str(cfg), "--log-file", str(log),
                        "--trace", str(tmp_path / "tr"), "--trace-steps", "2:3"],
                       capture_output=True, text=True, timeout=230)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    evals = [l for l in lines if l.startswith("eval after step")]
    assert [l.split()[3] for l in evals] == ["2/4", "4/4"], p.stdout
    assert all(math.isfinite(float(l.split()[-1])) for l in evals)
    # The run's summary, after its last step and eval lines (the memory and trace lines follow it).
    last = max(i for i, l in enumerate(lines) if l.startswith(("step", "eval")))
    assert any("validation loss" in l for l in lines[last + 1:]), p.stdout
    logged = log.read_text().splitlines()
    assert [l for l in logged if l.startswith(("step", "eval"))] == [l for l in lines if l.startswith(("step", "eval"))]
    recs = [json.loads((tmp_path / "tr" / f"records.rank{r}.json").read_text())["records"] for r in range(2)]
    assert {rec[1] for part in recs for rec in part} == {1, 2}  # steps 2..3, 0-based


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_into_head_ends_quietly(tmp_path):
    p = subprocess.Popen(
        # --hint bf: auto's announcements would interleave with the step lines (printed a step late)
        f"{sys.executable} -m rrfp train --stages 2 --steps 100000 --batch-size 4 --microbatches 2 --max-len 32 "
        "--hint bf | head -n 2", shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        executable="/bin/bash",
    )
    out, err = p.communicate(timeout=230)
    assert p.returncode == 0 and len(out.splitlines()) == 2 and out.startswith("step    1/100000"), (out, err)
    assert err == "", err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_bf16_autocast_on_cuda():
    from rrfp.train.precision import use_autocast

    lin = torch.nn.Sequential(torch.nn.Linear(4, 3)).cuda()
    seen = []
    lin[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    use_autocast(lin, "bf16", "cuda", last=True)
    out = lin(torch.randn(2, 4, device="cuda"))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32 and lin[0].weight.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_auto_lines_go_through_rank_0s_output_and_its_log_file(tmp_path):
    """auto's announcements are rank 0's output lines like the step lines: whole lines on stdout
    (on a terminal above the progress bar, not glued onto it) and in --log-file, in the same order."""
    log = tmp_path / "run.log"
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--stages", "2", "--steps", "12", "--batch-size", "4",
                        "--microbatches", "2", "--max-len", "32", "--log-file", str(log)],
                       capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    shown = [l for l in p.stdout.splitlines() if l.startswith("rrfp train: hint auto")]
    assert shown and shown[0].startswith("rrfp train: hint auto: steps 1-3 of this run measure costs"), p.stdout
    assert [l for l in log.read_text().splitlines() if l.startswith("rrfp train: hint auto")] == shown
