"""rrfp/obs: the metrics a step records, the HTTP server, multiprocess mode and the flags."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rrfp.obs.metrics import GAUGE_MODES, METRIC_NAMES, NodeMetrics, RankMetrics, last_heartbeats, node_registry
from rrfp.obs.server import MetricsServer, add_flags, check_flags, serve_node
from rrfp.scheduler.tasks import parse_action


def samples(text: str) -> dict[tuple, float]:
    """``{(sample name, sorted label items): value}`` from Prometheus' text format."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def rec(task: str, start: float, end: float):
    return SimpleNamespace(task=parse_action(task), start=start, end=end)


def test_a_step_is_recorded_in_base_units_by_stage_kind_and_direction() -> None:
    m = RankMetrics(1, [1, 3])
    # Rank 1 of 2 with virtual stages 1 and 3: hand-made records, 0.5 s + 0.25 s on stage 1,
    # 1.0 s on stage 3, in a 2.5 s step.
    st = SimpleNamespace(busy=1.75, wall=2.5, peak_mb_inflight=3,
                         records=[rec("1F0", 0, 0.5), rec("3F0", 1, 2), rec("1B0", 2, 2.25)])
    m.observe(st, loss=2.5, tokens=0, seconds=2.75,
              transport={"messages_sent": 4, "bytes_sent": 400, "messages_received": 3, "bytes_received": 300,
                         "rejected": 1}, runtime_rejected=2)
    st2 = SimpleNamespace(busy=0.5, wall=1.0, peak_mb_inflight=2, records=[rec("3I1", 0, 0.25), rec("3W1", 0.5, 0.75)])
    m.observe(st2, loss=None, seconds=1.25,
              transport={"messages_sent": 6, "bytes_sent": 650, "messages_received": 3, "bytes_received": 300,
                         "rejected": 1}, runtime_rejected=5)
    got = samples(generate_latest(m.registry).decode())
    r = ("rank", "1")
    assert got[("rrfp_busy_seconds_total", (r, ("stage", "1")))] == pytest.approx(0.75)
    assert got[("rrfp_busy_seconds_total", (r, ("stage", "3")))] == pytest.approx(1.5)
    assert got[("rrfp_idle_seconds_total", (r, ("stage", "1,3")))] == pytest.approx(0.75 + 0.5)
    assert got[("rrfp_steps_total", (r,))] == 2
    assert {k: got[("rrfp_tasks_total", (("kind", k), r))] for k in "FBIW"} == {"F": 2, "B": 1, "I": 1, "W": 1}
    assert got[("rrfp_messages_total", (("direction", "sent"), r))] == 6
    assert got[("rrfp_message_bytes_total", (("direction", "sent"), r))] == 650
    assert got[("rrfp_message_bytes_total", (("direction", "received"), r))] == 300
    assert got[("rrfp_rejected_messages_total", (r, ("reason", "decode")))] == 1
    assert got[("rrfp_rejected_messages_total", (r, ("reason", "routing")))] == 5
    assert got[("rrfp_tokens_total", (r,))] == 0
    assert got[("rrfp_step_duration_seconds_count", (r,))] == 2
    assert got[("rrfp_step_duration_seconds_sum", (r,))] == pytest.approx(4.0)
    assert got[("rrfp_step_duration_seconds_bucket", (("le", "2.5"), r))] == 1  # 1.25 s, not 2.75 s
    assert got[("rrfp_loss", (r,))] == 2.5  # the step without a loss keeps the last one
    assert got[("rrfp_peak_inflight_microbatches", (r,))] == 2
    assert abs(got[("rrfp_last_heartbeat_timestamp_seconds", (r,))] - time.time()) < 3600
    names = {fam.name for fam in text_string_to_metric_families(generate_latest(m.registry).decode())}
    assert not any(n.endswith("_fraction") for n in names)
    # Every family served is declared (the dashboard test checks its queries against the list).
    assert {n + "_total" if n + "_total" in METRIC_NAMES else n for n in names} <= set(METRIC_NAMES)


def test_without_records_busy_goes_to_the_first_stage() -> None:
    m = RankMetrics(0, [0])
    m.observe(SimpleNamespace(busy=0.3, wall=0.4, peak_mb_inflight=1), tokens=17)
    got = samples(generate_latest(m.registry).decode())
    assert got[("rrfp_busy_seconds_total", (("rank", "0"), ("stage", "0")))] == pytest.approx(0.3)
    assert got[("rrfp_idle_seconds_total", (("rank", "0"), ("stage", "0")))] == pytest.approx(0.1)
    assert got[("rrfp_tokens_total", (("rank", "0"),))] == 17


def test_heartbeat_beats_from_the_event_loop_and_stops() -> None:
    import asyncio

    m = RankMetrics(0, [0])
    m.heartbeat.labels("0").set(0)

    def beat() -> float:
        return m.registry.get_sample_value("rrfp_last_heartbeat_timestamp_seconds", {"rank": "0"})

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(m.start_heartbeat(interval=0.01))
        assert beat() > 0  # the first beat is immediate
        m.heartbeat.labels("0").set(0)
        # The next beat comes from the loop's timer alone: run the loop until it has beaten.
        loop.run_until_complete(_until(lambda: beat() > 0))
        timer = m._timer
        m.stop_heartbeat()
        assert timer is not None and timer.cancelled() and m._timer is None
    finally:
        loop.close()


async def _until(cond) -> None:
    import asyncio

    while not cond():
        await asyncio.sleep(0.005)


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_server_serves_metrics_routes_and_404_on_loopback() -> None:
    m = RankMetrics(2, [2])
    srv = MetricsServer(m.registry, port=0, routes={"/healthz": lambda: (503, "rank 2: heartbeat 99 s old\n")},
                        lock=m.lock)
    try:
        assert srv.addr == "127.0.0.1"
        status, ctype, body = get(f"http://127.0.0.1:{srv.port}/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert 'rrfp_steps_total{rank="2"} 0.0' in body
        assert get(f"http://127.0.0.1:{srv.port}/healthz")[::2] == (503, "rank 2: heartbeat 99 s old\n")
        assert get(f"http://127.0.0.1:{srv.port}/nope")[0] == 404
        # A scrape waits for a step being recorded: it takes the metrics' lock.
        with m.lock:
            t = threading.Thread(target=get, args=(f"http://127.0.0.1:{srv.port}/metrics",))
            t.start()
            t.join(0.2)
            assert t.is_alive()
        t.join(10)
        assert not t.is_alive()
    finally:
        srv.close()


def test_a_port_in_use_is_one_line_naming_it() -> None:
    m = RankMetrics(0, [0])
    srv = MetricsServer(m.registry, port=0)
    try:
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127.0.0.1:{srv.port}: "):
            MetricsServer(m.registry, port=srv.port)
    finally:
        srv.close()


@pytest.mark.parametrize("argv, problem", [
    (["--metrics-port", "0"], "--metrics-port=0: expected a port in 1..65534 (ranks serve on port + rank, for 2 ranks)"),
    (["--metrics-port", "65535"], "--metrics-port=65535: expected a port in 1..65534"),
    (["--metrics-linger", "-1"], "--metrics-linger=-1.0: expected a non-negative number of seconds"),
    (["--metrics-linger", "nan"], "--metrics-linger=nan: expected a non-negative number of seconds"),
    (["--metrics-addr", "not a host!"], "--metrics-addr='not a host!': expected an IP address or a host name"),
    (["--metrics-port", "9400", "--metrics-addr", "0.0.0.0", "--metrics-linger", "30"], None),
])
def test_flags_are_checked_before_anything_starts(argv, problem) -> None:
    p = argparse.ArgumentParser()
    add_flags(p, "port")
    got = check_flags(p.parse_args(argv), n_ports=2)
    assert got == problem if problem is None else got.startswith(problem)


def test_the_daemon_may_ask_for_any_free_port() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, "port", port_default=9400)
    assert p.parse_args([]).metrics_port == 9400
    assert check_flags(p.parse_args(["--metrics-port", "0"]), allow_any_port=True) is None
    assert check_flags(p.parse_args(["--metrics-port", "0"]), n_ports=4, allow_any_port=True) is None  # rrfp train
    assert check_flags(p.parse_args(["--metrics-port", "0"])) == "--metrics-port=0: expected a port in 1..65535"


def test_train_refuses_a_bad_linger_with_exit_2() -> None:
    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--metrics-linger", "-5"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].endswith("--metrics-linger=-5.0: expected a non-negative number of seconds")


RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from rrfp.obs.metrics import RankMetrics
    rank, loss, beat, busy = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    m = RankMetrics(rank, [rank])
    assert m.registry is None, "expected multiprocess mode"
    m.observe(SimpleNamespace(busy=busy, wall=2 * busy, peak_mb_inflight=rank + 1), loss=loss, tokens=10)
    m.heartbeat.labels(str(rank)).set(beat)
    m.observe_memory({"params": int(busy * 1000), "rss": 7, "headroom": int(loss * 100), "cuda_reserved": None})
""")


def test_multiprocess_mode_merges_ranks_and_restarts(tmp_path, monkeypatch) -> None:
    d = tmp_path / "prom"
    d.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(d)}
    # Rank 0 twice (a restart: a new pid, an older heartbeat), rank 1 once; each a process.
    for rank, loss, beat, busy in ((0, 3.0, 2000.0, 1.0), (0, 2.0, 1000.0, 0.5), (1, 9.0, 1500.0, 0.25)):
        subprocess.run([sys.executable, "-c", RANK_SCRIPT, str(rank), str(loss), str(beat), str(busy)],
                       check=True, env={**__import__("os").environ, **env}, timeout=300)
    got = samples(generate_latest(node_registry(d)).decode())
    r0, r1 = ("rank", "0"), ("rank", "1")
    assert got[("rrfp_busy_seconds_total", (r0, ("stage", "0")))] == pytest.approx(1.5)  # counters add up
    assert got[("rrfp_idle_seconds_total", (r0, ("stage", "0")))] == pytest.approx(1.5)
    assert got[("rrfp_steps_total", (r0,))] == 2
    assert got[("rrfp_tokens_total", (r1,))] == 10
    assert got[("rrfp_loss", (r0,))] == 2.0  # mostrecent: the restarted process wrote last
    assert got[("rrfp_loss", (r1,))] == 9.0
    assert got[("rrfp_last_heartbeat_timestamp_seconds", (r0,))] == 2000.0  # max
    assert not any("pid" in dict(labels) for _, labels in got)
    assert last_heartbeats(d) == {0: 2000.0, 1: 1500.0}
    # The daemon's endpoint: the ranks' values, its own restarts counter and its routes.
    srv = serve_node(d, port=0, routes={"/readyz": lambda: (200, "ready\n")})
    try:
        NodeMetrics(3, srv.registry).restarts.labels("3").inc()
        served = samples(get(f"http://127.0.0.1:{srv.port}/metrics")[2])
        assert served[("rrfp_restarts_total", (("node", "3"),))] == 1
        assert served[("rrfp_steps_total", (r0,))] == 2
        assert get(f"http://127.0.0.1:{srv.port}/readyz")[::2] == (200, "ready\n")
    finally:
        srv.close()
    # Memory gauges: the restarted process's values (mostrecent), unmeasured ones absent.
    assert got[("rrfp_memory_bytes", (("kind", "params"), r0))] == 500
    assert got[("rrfp_memory_headroom_bytes", (r0,))] == 200 and got[("rrfp_memory_headroom_bytes", (r1,))] == 900
    assert got[("rrfp_memory_peak_bytes", (r1, ("what", "rss")))] == 7
    assert not any(name == "rrfp_memory_peak_bytes" and ("what", "cuda_reserved") in labels for name, labels in got)
    assert set(GAUGE_MODES) == {"rrfp_loss", "rrfp_peak_inflight_microbatches", "rrfp_last_heartbeat_timestamp_seconds",
                                "rrfp_learning_rate", "rrfp_grad_norm", "rrfp_model_tflops", "rrfp_mfu",
                                "rrfp_memory_bytes", "rrfp_memory_peak_bytes", "rrfp_memory_limit_bytes",
                                "rrfp_memory_headroom_bytes"}


def test_node_registry_refuses_a_missing_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        node_registry(tmp_path / "missing")
    assert json.dumps(last_heartbeats(tmp_path)) == "{}"
