"""The step line's learning rate, gradient norm, TFLOP/s and MFU: the FLOP formula against
torch.utils.flop_counter, the gradient norm against torch's over the unsplit model, the fields
against hand-computed values, TensorBoard and Prometheus gauges, and a real run against a
single-process reference."""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rrfp.model.gpt import GPT, GPT_PRESETS, lm_loss, split_gpt
from rrfp.train.flops import StepFlops, peak_tflops, stage_flop_rates
from rrfp.train.stepline import StepExtras, fields_problem, grad_norm_share, rank_fields

CFG = dataclasses.replace(GPT_PRESETS["tiny"], max_len=64)


def _measured(stage, x):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The math backend runs attention as matmuls the counter sees (it has no rule for the CPU's
    # fused attention kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = stage(*x) if isinstance(x, tuple) else stage(x)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("b,t", [(3, 17), (2, 64)])
def test_formula_is_within_2_percent_of_torchs_flop_counter(b, t):
    stages = split_gpt(GPT(CFG, seed=0), 2)
    ids = torch.randint(0, 256, (b, t))
    hidden = stages[0](ids).detach().requires_grad_(True)
    for st, x in ((stages[0], ids), (stages[1], hidden)):
        a, c = stage_flop_rates(st)
        want = _measured(st, x)
        assert b * t * (a + c * t) == pytest.approx(want, rel=0.02)


def test_formula_is_within_2_percent_for_a_hugging_face_stage():
    pytest.importorskip("transformers")
    from rrfp.hf import hf_model, split_hf

    stages = split_hf(hf_model("llama", max_len=64), 2)
    ids = torch.randint(0, 256, (2, 40))
    h = tuple(t.detach() for t in stages[0](ids))
    h = (h[0].requires_grad_(True), *h[1:])
    for st, x in ((stages[0], ids), (stages[1], h)):
        a, c = stage_flop_rates(st)
        assert 2 * 40 * (a + c * 40) == pytest.approx(_measured(st, x), rel=0.02)


def test_step_flops_counts_training_forwards_only():
    st = split_gpt(GPT(CFG, seed=0), 1)[0]
    counter = StepFlops([st])
    a, c = stage_flop_rates(st)
    st(torch.randint(0, 256, (2, 10)))
    st(torch.randint(0, 256, (1, 30)))
    with torch.no_grad():
        st(torch.randint(0, 256, (4, 50)))  # an evaluation: no backward follows
    assert counter.take() == 2 * 10 * (a + 10 * c) + 30 * (a + 30 * c)
    assert counter.take() == 0.0


def test_shares_of_the_gradient_norm_add_up_to_torchs_norm_of_the_unsplit_model():
    model = GPT(CFG, seed=1)
    stages = split_gpt(model, 3)
    ids = torch.randint(0, 256, (4, 20))
    targets = torch.randint(0, 256, (4, 20))
    lm_loss(model(ids), targets).backward()
    h = ids
    for st in stages:
        h = st(h)
    lm_loss(h, targets).backward()
    shares = [grad_norm_share(st.parameters(), None) for st in stages]
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert math.sqrt(sum(shares)) == pytest.approx(float(want), rel=1e-6)


def test_fields_text_and_checks():
    args = argparse.Namespace(peak_tflops=2.0, tensorboard=None)
    ex = StepExtras(args)
    per_rank = {0: {"wall": 2.0, **rank_fields(1e-3, 9.0, 4e12)}, 1: {"wall": 4.0, **rank_fields(1e-3, 16.0, 4e12)}}
    f = ex.fields(per_rank)
    assert f == {"lr": 1e-3, "grad_norm": 5.0, "tflops": [2.0, 1.0], "mfu": 0.75}
    assert ex.text(f) == "lr 1.00e-03  grad norm  5.0000  TFLOP/s/rank  1.5000  MFU 75.00%"
    assert StepExtras(argparse.Namespace(peak_tflops=None, tensorboard=None)).fields(per_rank)["mfu"] is None
    assert fields_problem(per_rank[0]) is None
    assert fields_problem({**per_rank[0], "flops": float("nan")}) == "flops=nan is not a finite non-negative number"
    assert fields_problem({**per_rank[0], "grad_sq": -1.0}) == "grad_sq=-1.0 is not a finite non-negative number"
    assert "lr=None" in fields_problem({"grad_sq": 0.0, "flops": 0.0})


def test_peak_is_the_flag_else_the_gpu_table(monkeypatch):
    assert peak_tflops(7.5, torch.device("cpu")) == 7.5
    assert peak_tflops(None, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in [("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA A100-SXM4-40GB", 312.0),
                       ("NVIDIA H200", 989.4), ("Quadro P400", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert peak_tflops(None, torch.device("cuda", 0)) == want, name


def test_tensorboard_and_gauges_get_the_printed_values(tmp_path):
    pytest.importorskip("tensorboard")
    from prometheus_client import CollectorRegistry
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rrfp.obs.metrics import RankMetrics

    metrics = RankMetrics(0, [0], registry=CollectorRegistry())
    ex = StepExtras(argparse.Namespace(peak_tflops=4.0, tensorboard=str(tmp_path)), metrics=metrics)
    row = {"step": 0, "loss": 2.5, "tok_s": 100.0, "seconds": 0.5, "bubble": [0.25, 0.5], "lr": 1e-3,
           "grad_norm": 5.0, "tflops": [2.0, 1.0], "mfu": 0.375}
    ex.publish(row)
    ex.evaluation(1, 2.25)
    ex.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got["train/loss"] == [(1, 2.5)] and got["train/grad_norm"] == [(1, 5.0)]
    assert got["train/tflops_per_rank"] == [(1, 1.5)] and got["train/mfu"] == [(1, 0.375)]
    assert got["rank/1/bubble"] == [(1, 0.5)] and got["eval/loss"] == [(1, 2.25)]
    assert got["train/lr"] == [(1, pytest.approx(1e-3))]
    metrics.observe_rates(lr=1e-3, tflops=2.0, mfu=0.5)
    value = lambda name: metrics.registry.get_sample_value(name, {"rank": "0"})  # noqa: E731
    assert (value("rrfp_learning_rate"), value("rrfp_model_tflops"), value("rrfp_mfu"), value("rrfp_grad_norm")) == \
        (1e-3, 2.0, 0.5, 5.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_prints_torchs_gradient_norm_and_the_learning_rate(tmp_path):
    """Step 1 of `rrfp train --stages 2` against the unsplit model on one process, same batch."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rrfp.data.batches import BatchSampler, pad_batch
    from rrfp.data.text import load_samples
    from rrfp.train.worker import SAMPLE_POOL

    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--stages", "2", "--steps", "1", "--batch-size", "8",
         "--microbatches", "4", "--max-len", "64", "--lr", "0.002", "--peak-tflops", "3",
         "--tensorboard", str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=840, cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(s for s in p.stdout.splitlines() if s.startswith("step    1/1"))
    assert "lr 2.00e-03" in line and "MFU" in line
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    norm = acc.Scalars("train/grad_norm")[0].value
    tflops, mfu = acc.Scalars("train/tflops_per_rank")[0].value, acc.Scalars("train/mfu")[0].value
    samples = load_samples(None, 64, 0, limit=SAMPLE_POOL)
    tokens, targets = pad_batch(BatchSampler(samples, 8, 0).batch(0))
    model = GPT(CFG, seed=0)
    lm_loss(model(tokens), targets).backward()
    want = float(torch.nn.utils.get_total_norm([q.grad for q in model.parameters()]))
    assert norm == pytest.approx(want, rel=1e-5)
    assert f"grad norm {want:7.4f}" in line
    assert mfu == pytest.approx(tflops / 3, rel=1e-5)


def test_rank_zero_prints_the_fields_and_drops_a_peers_forged_ones(capsys):
    import io
    from types import SimpleNamespace

    from rrfp.scheduler.tasks import Placement
    from rrfp.train.progress import Output
    from rrfp.train.report import Reporter

    args = SimpleNamespace(steps=1, microbatches=2, quiet=False, hint="bf", skip_nonfinite=False)
    out = io.StringIO()
    rep = Reporter(args, 2, Placement(2, 1, "loop"), Output(1, stream=out, bar=False))
    rep.extras = StepExtras(argparse.Namespace(peak_tflops=None, tensorboard=None))
    rep.step_time[0], rep.tokens[0] = 1.0, 10
    base = {"kind": "stats", "step": 0, "busy": 0.5, "wall": 1.0, "peak": 1}
    rep.add({**base, "loss": None, **rank_fields(1e-3, 3.0, 2e12)}, 0)
    rep.add({**base, "loss": 2.0, "lr": 1e-3, "grad_sq": float("inf"), "flops": 1e12}, 1)  # forged: dropped
    rep.flush()
    assert out.getvalue() == "" and "grad_sq=inf is not a finite non-negative number" in capsys.readouterr().err
    rep.add({**base, "loss": 2.0, **rank_fields(1e-3, 1.0, 1e12)}, 1)
    rep.flush()
    assert "lr 1.00e-03  grad norm  2.0000  TFLOP/s/rank  1.5000  step" in out.getvalue()
