"""A real ``rrfp train`` scraped over HTTP: the bubble Prometheus would compute from the busy
and idle counters equals the runtime's own accounting (per-step busy and wall seconds, which
``--trace`` writes to ``records.rank*.json``); with a ``prometheus`` binary on PATH, a real
Prometheus server scrapes the run and answers the same question over its HTTP API."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

RANKS, STEPS = 2, 5
DEADLINE = 900.0  # seconds for the whole run: a hang bound, generous for a 2-core machine at load 10-40


def free_port_block(n: int) -> int:
    """A port p with p..p+n-1 free now (the OS's choice for p; checked for the rest)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65535:
            continue
        try:
            socks = []
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def scrape(port: int) -> dict | None:
    """``{(name, frozenset(labels)): value}`` of one rank's endpoint, or None while it is down."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(snap: dict, name: str) -> float:
    return sum(v for (n, _), v in snap.items() if n == name)


def wait_for(cond, proc: subprocess.Popen, what: str, deadline: float):
    """Poll ``cond()`` until it returns a value (the run still alive), with a deadline."""
    while time.monotonic() < deadline:
        got = cond()
        if got is not None:
            return got
        if proc.poll() is not None:
            out = "\n".join(proc.lines)
            pytest.fail(f"run ended (exit {proc.returncode}) before {what}:\n{out[-3000:]}")
        time.sleep(0.02)  # a polling interval, not a synchronisation: the condition decides
    pytest.fail(f"timed out waiting for {what}")


def metrics_ports(proc, deadline: float) -> list[int]:
    """Each rank's metrics port, from its line ``rrfp train: rank R: metrics on http://...:P/metrics``."""
    def ports():
        found = {}
        for ln in list(proc.lines):
            m = re.fullmatch(r"rrfp train: rank (\d+): metrics on http://127\.0\.0\.1:(\d+)/metrics", ln)
            if m:
                found[int(m[1])] = int(m[2])
        return [found[r] for r in range(RANKS)] if len(found) == RANKS else None

    return wait_for(ports, proc, "every rank's metrics line", deadline)


def runtime_bubble(tmp_path: Path, rank: int, from_step: int) -> tuple[float, float]:
    """The runtime's bubble over steps ``from_step..`` (from its per-step busy and wall) and
    the busy seconds of its task records over the same steps."""
    part = json.loads((tmp_path / "tr" / f"records.rank{rank}.json").read_text())
    steps = [s for s in part["steps"] if s[0] >= from_step]
    assert [s[0] for s in steps] == list(range(from_step, STEPS))
    busy, wall = sum(s[2] for s in steps), sum(s[1] for s in steps)
    rec_busy = sum(end - start for _, step, _, start, end in part["records"] if step >= from_step)
    return 1.0 - busy / wall, rec_busy


class Ranks:
    """The ``RANKS`` ranks of one ``rrfp train --metrics-port 0`` job, started by this test on
    a rendezvous store it hosts (tests/handover.py), so it reaches the job's test hooks through
    the store: with ``pause`` every rank waits after that step until :meth:`resume`.
    ``lines`` collects their output as it comes; ``poll()`` and ``returncode`` are the first
    rank's to have exited, as :func:`wait_for` wants."""

    def __init__(self, tmp_path: Path, pause: int) -> None:
        from handover import host_store, rank_env

        data = tmp_path / "text.txt"
        data.write_text("\n\n".join(f"paragraph {i} " + "lorem ipsum dolor sit amet " * 3 for i in range(60)))
        self.store, port = host_store(RANKS)
        self.lines: list[str] = []
        self.procs = []
        for r in range(RANKS):
            env = {**os.environ, **rank_env(r, RANKS, port), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1",
                   "RRFP_TEST_PAUSE_AFTER_STEP": str(pause)}
            env.pop("TORCHELASTIC_RUN_ID", None)
            proc = subprocess.Popen(
                [sys.executable, "-m", "rrfp", "train", "--stages", str(RANKS), "--steps", str(STEPS), "--batch-size",
                 "4", "--microbatches", "4", "--max-len", "16", "--data", str(data), "--quiet", "--trace",
                 str(tmp_path / "tr"), "--metrics-port", "0", "--metrics-linger", "300",
                 "--hint", "bf"],  # one hint throughout: auto would add a split backward's I and W tasks
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            threading.Thread(target=lambda p=proc: self.lines.extend(ln.rstrip("\n") for ln in p.stdout),
                             daemon=True).start()
            self.procs.append(proc)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = next((c for c in (p.poll() for p in self.procs) if c is not None), None)
        return self.returncode

    def wait_paused(self) -> None:
        """Until every rank waits in the pause (the default process group's keys on the store)."""
        import datetime

        self.store.wait([f"default_pg/0//rrfp/test/paused/{r}" for r in range(RANKS)], datetime.timedelta(seconds=600))

    def resume(self) -> None:
        self.store.set("default_pg/0//rrfp/test/resume", "1")

    def stop(self) -> None:
        """SIGTERM ends each rank's linger (or its run, after a failure)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_scraped_counters_give_the_runtimes_bubble(tmp_path) -> None:
    """Forced order, no race with the run: every rank pauses after step ``PAUSE`` (test hook
    RRFP_TEST_PAUSE_AFTER_STEP) while the first scrape is taken, so the window of the rate
    below is exactly steps PAUSE..STEPS-1."""
    pause = 2
    run = Ranks(tmp_path, pause)
    deadline = time.monotonic() + DEADLINE
    try:
        ports = metrics_ports(run, deadline)
        run.wait_paused()
        first = [scrape(ports[r]) for r in range(RANKS)]
        run.resume()
        last = [wait_for(lambda r=r: (s := scrape(ports[r])) and total(s, "rrfp_steps_total") == STEPS and s or None,
                         run, f"rank {r}'s last step", deadline) for r in range(RANKS)]
        wait_for(lambda: (tmp_path / "tr" / "profile.json").exists() or None, run, "the trace", deadline)
        for r in range(RANKS):
            assert total(first[r], "rrfp_steps_total") == pause, f"rank {r}: the scrape during the pause"
            d_busy = total(last[r], "rrfp_busy_seconds_total") - total(first[r], "rrfp_busy_seconds_total")
            d_idle = total(last[r], "rrfp_idle_seconds_total") - total(first[r], "rrfp_idle_seconds_total")
            # rate(busy) / (rate(busy) + rate(idle)) over the window: the scrape interval cancels.
            scraped = d_idle / (d_busy + d_idle)
            ref, rec_busy = runtime_bubble(tmp_path, r, pause)
            assert scraped == pytest.approx(ref, rel=0.02), f"rank {r}"
            assert d_busy == pytest.approx(rec_busy, rel=0.02), f"rank {r}: busy vs the task records"
            assert 0.0 < ref < 1.0
            tasks = total(last[r], "rrfp_tasks_total")
            assert tasks == 2 * 4 * STEPS  # one F and one B per microbatch per step on each rank
            assert total(last[r], "rrfp_messages_total") > 0 and total(last[r], "rrfp_message_bytes_total") > 0
        assert total(last[0], "rrfp_tokens_total") > 0 and total(last[1], "rrfp_tokens_total") == 0
        assert ("rrfp_loss", frozenset({("rank", str(RANKS - 1))})) in last[RANKS - 1]
    finally:
        run.stop()
    assert all(p.returncode is not None for p in run.procs)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary on PATH")
def test_real_prometheus_scrapes_the_run_and_answers_the_dashboard_query(tmp_path) -> None:
    """Forced order: every rank pauses after step 1 until Prometheus has scraped it there, so
    the dashboard's rates see the counters move however slowly Prometheus starts."""
    proc = Ranks(tmp_path, 1)
    deadline = time.monotonic() + DEADLINE
    try:
        ports = metrics_ports(proc, deadline)
    except BaseException:
        proc.stop()
        raise
    prom_port = free_port_block(1)  # Prometheus's own port is still probed free (no hand-over from it here)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: rrfp\n"
        f"    static_configs: [{{targets: [{', '.join(repr(f'127.0.0.1:{p}') for p in ports)}]}}]\n"
    )
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )

    def query(q: str) -> dict[str, float] | None:
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                res = json.load(r)["data"]["result"]
        except OSError:
            return None
        return {x["metric"].get("rank", ""): float(x["value"][1]) for x in res}

    try:
        proc.wait_paused()
        wait_for(lambda: (q := query("rrfp_steps_total")) and len(q) == RANKS and all(v == 1 for v in q.values())
                 or None, proc, "Prometheus to scrape the paused run", deadline)
        proc.resume()
        # Prometheus has the final values once it reports the last step for every rank.
        wait_for(lambda: (q := query("rrfp_steps_total")) and len(q) == RANKS
                 and all(v == STEPS for v in q.values()) or None, proc, "Prometheus to see the last step", deadline)
        wait_for(lambda: (tmp_path / "tr" / "profile.json").exists() or None, proc, "the trace", deadline)
        # Counters start at 0 with the process, so their final values span the whole run.
        whole = query("sum by (rank) (rrfp_idle_seconds_total) / (sum by (rank) (rrfp_busy_seconds_total)"
                      " + sum by (rank) (rrfp_idle_seconds_total))")
        for r in range(RANKS):
            assert whole[str(r)] == pytest.approx(runtime_bubble(tmp_path, r, 0)[0], rel=0.02)
        # The dashboard's own bubble query (a rate over a window covering the run) answers too.
        from test_deploy import dashboard_exprs

        bubble = next(e for title, e in dashboard_exprs() if title.startswith("Bubble"))
        # Grafana fills the dashboard's variables; here the scrape job is "rrfp" and the series
        # carry no namespace label, which PromQL's namespace="" matches.
        got = query(bubble.replace("$__rate_interval", "1h").replace("$namespace", "").replace("$job", "rrfp"))
        assert set(got) == {str(r) for r in range(RANKS)} and all(0 <= v <= 100 for v in got.values()), got
    finally:
        proc.stop()
        prom.terminate()
        prom.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_multiprocess_ranks_are_served_by_one_endpoint(tmp_path) -> None:
    """As under ``rrfp node``: the ranks write to PROMETHEUS_MULTIPROC_DIR, serve nothing
    themselves, and one server over :func:`node_registry` serves them all, also after the
    job ended (the daemon's linger), with the runtime's bubble for the whole run."""
    from rrfp.obs.metrics import last_heartbeats, node_registry
    from rrfp.obs.server import MetricsServer

    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"paragraph {i} " + "lorem ipsum dolor sit amet " * 3 for i in range(60)))
    p = subprocess.run(
        [sys.executable, "-m", "rrfp", "train", "--stages", str(RANKS), "--steps", str(STEPS), "--batch-size", "4",
         "--microbatches", "4", "--max-len", "16", "--data", str(data), "--quiet", "--trace", str(tmp_path / "tr")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    srv = MetricsServer(node_registry(prom_dir), port=0)
    try:
        snap = scrape(srv.port)
    finally:
        srv.close()
    for r in range(RANKS):
        mine = {k: v for k, v in snap.items() if ("rank", str(r)) in k[1]}
        busy, idle = total(mine, "rrfp_busy_seconds_total"), total(mine, "rrfp_idle_seconds_total")
        assert idle / (busy + idle) == pytest.approx(runtime_bubble(tmp_path, r, 0)[0], rel=0.02), f"rank {r}"
        assert total(mine, "rrfp_steps_total") == STEPS
        assert total(mine, "rrfp_step_duration_seconds_count") == STEPS
    assert not any(k for k in snap if "pid" in dict(k[1]))
    assert sorted(last_heartbeats(prom_dir)) == list(range(RANKS))
