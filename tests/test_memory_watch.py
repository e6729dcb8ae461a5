"""Memory you can watch (issue 31): a rank's bytes by kind against independent counts, the
process's peak reset per step, the limit read from cgroup files, and the figures on the step
line, in the summary, the Prometheus gauges and TensorBoard."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rrfp.model.gpt import GPT, GPT_PRESETS, GPTConfig, lm_loss, split_gpt
from rrfp.obs.memory import PeakMeter, memory_limit, read_status_bytes
from rrfp.obs.metrics import METRIC_NAMES, RankMetrics
from rrfp.runtime.doors.local import LocalPipeline
from rrfp.train.memory import RankMemory, mem_problem, step_text, summary_text

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MIB = 1 << 20
GIB = 1 << 30


def _mem(params: int, rss: int, headroom: int | None = 5 * GIB, **more) -> dict:
    return {"params": params, "grads": params, "optimizer": 2 * params, "activations": 3 * MIB, "gathered": 0,
            "rss": rss, "cuda_allocated": None, "cuda_reserved": None, "limit": 8 * GIB, "headroom": headroom, **more}


# ---------------------------------------------------------------- the rank's bytes by kind
def test_a_pipelines_bytes_by_kind_match_counts_made_apart():
    """2 stages in one process, strict GPipe (every forward before any backward, so each rank's
    peak holds all M microbatches): parameters and gradients = sum(numel * itemsize) of each
    stage, AdamW = two moments + a 4-byte step per parameter; activations = M x what one
    microbatch saves for backward, counted by the benchmarks' ActivationMeter on the same
    stage outside the pipeline."""
    from benchmarks.harness import ActivationMeter

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, max_len=16)
    stages = split_gpt(GPT(cfg, seed=0), 2)
    M, B, T = 3, 2, 16
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (B, T), generator=g) for _ in range(M)]
    ys = [torch.randint(0, 256, (B, T), generator=g) for _ in range(M)]
    with LocalPipeline(stages, M, lm_loss, hint="strict-gpipe") as pipe:
        mems = [RankMemory([st], torch.optim.AdamW(st.parameters()), SimpleNamespace(runtimes=[rt]))
                for st, rt in zip(stages, pipe.runtimes)]
        for m in mems:
            m.begin_step()
        pipe.step(microbatches=[(x,) for x in xs], targets=ys)
        for m in mems:
            m.optimizer.step()
        got = [m.fields(st) for m, st in zip(mems, pipe.last_stats)]
    for st, f in zip(stages, got):
        n = sum(p.numel() * p.element_size() for p in st.parameters())
        assert f["params"] == f["grads"] == n
        assert f["optimizer"] == 2 * n + 4 * len(list(st.parameters()))
        assert f["gathered"] == 0
    # One microbatch's saved bytes per stage, counted apart (parameters excluded, the loss's
    # saved tensors part of the last stage's forward, as the runtime counts them).
    want = []
    h = stages[0](xs[0]).detach().requires_grad_(True)
    for i, (st, x) in enumerate(((stages[0], xs[0]), (stages[1], h))):
        meter = ActivationMeter()
        meter.exclude(list(st.parameters()))
        with meter.hooks():
            out = st(x)
            if i == 1:
                out = lm_loss(out, ys[0])
        want.append(meter.peak)
        del out
    assert [f["activations"] for f in got] == [M * w for w in want]
    assert all(f["rss"] > 0 for f in got)


def test_peak_rss_is_the_steps_own():
    """Reset at a step's start, VmHWM shows what the step touched (64 MiB more than the RSS
    before it), and the next step's peak no longer has it."""
    meter = PeakMeter("cpu")
    if not meter.resettable:
        pytest.skip("/proc/self/clear_refs refuses the peak reset here")
    meter.reset()
    before = read_status_bytes("VmRSS")
    x = torch.ones(64 * MIB // 4)  # touched: resident
    peak = meter.read().rss
    assert peak >= before + 64 * MIB
    del x
    meter.reset()
    assert meter.read().rss < peak - 32 * MIB
    assert meter.read().rss_source == "VmHWM, reset per step"


def _tree(tmp_path, cgroup_line: str, files: dict[str, str]):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16000000 kB\nMemFree: 1 kB\nMemAvailable:   12000000 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for path, text in files.items():
        f = cg / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return proc, cg


def test_the_limit_is_the_cgroups_working_set_or_the_hosts(tmp_path):
    # cgroup v2, limit 4 GiB on the job's folder, usage 3 GiB of which 1 GiB inactive page
    # cache: 2 GiB available (as the kubelet counts the working set).
    proc, cg = _tree(tmp_path / "v2", "0::/job", {
        "cgroup.controllers": "memory", "memory.max": "max",
        "job/memory.max": str(4 * GIB), "job/memory.current": str(3 * GIB),
        "job/memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 5\n"})
    assert memory_limit(proc, cg) == (4 * GIB, 2 * GIB, "cgroup v2")
    # cgroup v1 without a limit ("no limit" is 2**63 rounded to a page): the host's figures.
    proc, cg = _tree(tmp_path / "v1", "4:memory:/a", {
        "memory/a/memory.limit_in_bytes": "9223372036854771712", "memory/a/memory.usage_in_bytes": "5"})
    assert memory_limit(proc, cg) == (16000000 * 1024, 12000000 * 1024, "host")
    # cgroup v1 with a limit above what the host has free: the host's availability binds.
    proc, cg = _tree(tmp_path / "v1b", "4:memory:/a", {
        "memory/a/memory.limit_in_bytes": str(64 * GIB), "memory/a/memory.usage_in_bytes": str(GIB),
        "memory/a/memory.stat": "total_inactive_file 0\n"})
    assert memory_limit(proc, cg) == (64 * GIB, 12000000 * 1024, "cgroup v1 (host MemAvailable smaller)")


# ---------------------------------------------------------------- where the figures go
def test_step_line_field_summary_and_checks():
    mems = [_mem(MIB, int(0.5 * GIB)), _mem(2 * MIB, GIB // 4), None]
    assert step_text(mems) == "mem/rank [0.50 0.25 -] GiB"
    assert step_text([None, None]) == ""
    cuda = _mem(MIB, GIB, cuda_allocated=GIB, cuda_reserved=3 * GIB)
    assert step_text([cuda]) == "mem/rank [3.00] GiB"  # a GPU rank: its peak reserved
    s = summary_text(mems[:2], "how")
    assert s.startswith("memory/rank at the last step, MiB: params [1.00 2.00]  grads [1.00 2.00]  optimizer [2.00 4.00]  "
                        "activations [3.00 3.00]  gathered [0.00 0.00]; peak GiB: rss [0.50 0.25]  headroom [5.00 5.00] (how)")
    assert mem_problem(mems[0]) is None
    assert mem_problem({**mems[0], "headroom": -5}) is None  # past the limit: reported, not refused
    assert mem_problem({**mems[0], "params": -1}) == "mem.params=-1 is not a non-negative integer byte count"
    assert mem_problem({**mems[0], "grads": None}) == "mem.grads=None is not a non-negative integer byte count"
    assert mem_problem({**mems[0], "rss": 1.5}) == "mem.rss=1.5 is not a non-negative integer byte count"
    assert mem_problem([1]) == "mem=[1] is not a dict"


def test_rank_zero_prints_the_memory_field_and_drops_forged_figures(capsys):
    from rrfp.scheduler.tasks import Placement
    from rrfp.train.progress import Output
    from rrfp.train.report import Reporter

    args = SimpleNamespace(steps=1, microbatches=2, quiet=False, hint="bf", skip_nonfinite=False)
    out = io.StringIO()
    rep = Reporter(args, 2, Placement(2, 1, "loop"), Output(1, stream=out, bar=False))
    rep.memory_sources = "RSS VmHWM, reset per step"
    rep.step_time[0], rep.tokens[0] = 1.0, 10
    base = {"kind": "stats", "step": 0, "busy": 0.5, "wall": 1.0, "peak": 1}
    rep.add({**base, "loss": None, "mem": _mem(MIB, GIB)}, 0)
    rep.add({**base, "loss": 2.0, "mem": _mem(-4, GIB)}, 1)  # forged: dropped
    rep.flush()
    assert out.getvalue() == "" and "mem.params=-4 is not a non-negative integer" in capsys.readouterr().err
    rep.add({**base, "loss": 2.0, "mem": _mem(MIB, GIB // 2)}, 1)
    rep.flush()
    rep.summary(1.0)
    text = out.getvalue()
    assert "peak in-flight [1 1]  mem/rank [1.00 0.50] GiB" in text
    assert "memory/rank at the last step, MiB: params [1.00 1.00]" in text and "(RSS VmHWM, reset per step)" in text


def _samples(registry) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gauges_by_kind_peaks_and_headroom():
    m = RankMetrics(3, [3], registry=CollectorRegistry())
    m.observe_memory(_mem(MIB, GIB, headroom=-GIB, gathered=7))
    got = _samples(m.registry)
    r = ("rank", "3")
    assert {k: got[("rrfp_memory_bytes", (("kind", k), r))] for k in ("params", "grads", "optimizer", "activations",
                                                                     "gathered")} == \
        {"params": MIB, "grads": MIB, "optimizer": 2 * MIB, "activations": 3 * MIB, "gathered": 7}
    assert got[("rrfp_memory_peak_bytes", (r, ("what", "rss")))] == GIB
    assert ("rrfp_memory_peak_bytes", (r, ("what", "cuda_reserved"))) not in got  # not measured on a CPU rank
    assert got[("rrfp_memory_headroom_bytes", (r,))] == -GIB and got[("rrfp_memory_limit_bytes", (r,))] == 8 * GIB
    assert {"rrfp_memory_bytes", "rrfp_memory_peak_bytes", "rrfp_memory_headroom_bytes",
            "rrfp_memory_limit_bytes"} <= set(METRIC_NAMES)


def test_gauges_are_served_on_the_metrics_endpoint():
    import urllib.request

    from rrfp.obs.server import MetricsServer

    m = RankMetrics(0, [0], registry=CollectorRegistry())
    m.observe_memory(_mem(5 * MIB, GIB))
    server = MetricsServer(m.registry, "127.0.0.1", 0, lock=m.lock)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    assert 'rrfp_memory_bytes{kind="params",rank="0"} 5.24288e+06' in text
    assert 'rrfp_memory_headroom_bytes{rank="0"} 5.36870912e+09' in text


def test_tensorboard_gets_each_ranks_bytes_by_kind(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rrfp.train.stepline import StepExtras

    ex = StepExtras(argparse.Namespace(peak_tflops=None, tensorboard=str(tmp_path)))
    row = {"step": 1, "loss": 2.5, "tok_s": 100.0, "seconds": 0.5, "bubble": [0.25, 0.5], "lr": 1e-3,
           "grad_norm": 5.0, "tflops": [2.0, 1.0], "mfu": None, "mem": [_mem(MIB, GIB), _mem(2 * MIB, GIB // 2)]}
    ex.publish(row)
    ex.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got["rank/1/memory/params"] == [(2, 2 * MIB)] and got["rank/0/memory/optimizer"] == [(2, 2 * MIB)]
    assert got["rank/1/memory/rss"] == [(2, GIB // 2)] and got["rank/0/memory/headroom"] == [(2, 5 * GIB)]
    assert got["rank/0/memory/activations"] == [(2, 3 * MIB)] and "rank/0/memory/cuda_reserved" not in got


# ---------------------------------------------------------------- a real sharded run
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sharded_run_shows_half_the_parameters_on_the_step_line_and_in_tensorboard(tmp_path):
    """``rrfp train --pp 2 --dp 2 --dp-shard full``: each rank's parameter bytes (TensorBoard)
    are half of its stage's sum(numel * 4) counted on the stage built apart (within FSDP2's
    padding of dim-0 shards), its gathered bytes its stage's whole parameters + gradients, and
    the step line carries the memory field."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--pp", "2", "--dp", "2", "--dp-shard", "full",
                        "--steps", "2", "--batch-size", "8", "--microbatches", "2", "--max-len", "32", "--threads", "1",
                        "--hint", "1f1b", "--tensorboard", str(tmp_path / "tb")],
                       capture_output=True, text=True, timeout=840, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [s for s in p.stdout.splitlines() if s.startswith("step    2/2")]
    assert lines and "mem/rank [" in lines[0] and lines[0].endswith("] GiB")
    assert "memory/rank at the last step, MiB: params [" in p.stdout
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    cfg = dataclasses.replace(GPT_PRESETS["tiny"], max_len=32)
    stages = split_gpt(GPT(cfg, seed=0), 2)
    for r, st in enumerate(stages):
        whole = sum(q.numel() * q.element_size() for q in st.parameters())
        params = acc.Scalars(f"rank/{r}/memory/params")[-1].value
        assert whole / 2 <= params <= whole / 2 * 1.02, (r, params, whole)
        assert acc.Scalars(f"rank/{r}/memory/grads")[-1].value == params
        assert acc.Scalars(f"rank/{r}/memory/gathered")[-1].value == 2 * whole
        assert acc.Scalars(f"rank/{r}/memory/activations")[-1].value > 0
