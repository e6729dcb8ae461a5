"""Bad input found by the adversarial passes: one line, exit code 2, before any process starts,
nothing lost (no folder created, no file changed)."""

from __future__ import annotations

import pytest

from rrfp.cli import main

NODE_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
            "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything would start a process."""
    def refuse(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr("rrfp.train.cli.launch", refuse)
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", refuse)
    for k in NODE_ENV:
        monkeypatch.delenv(k, raising=False)


def _one_line(capsys, cmd: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rrfp {cmd}: error: "), err
    return err[0]


@pytest.mark.parametrize("addr", ["bad host", "", "a/b", "[::1"])
def test_node_bad_master_addr(addr, capsys, no_launch):
    assert main(["node", "--master-addr", addr, "--", "--stages", "2"]) == 2
    line = _one_line(capsys, "node")
    assert f"--master-addr={addr!r}: expected a host name, an IPv4 address or an IPv6 address" in line


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
                                metrics_addr="127.0.0.1", heartbeat_timeout=60.0, node_addr="10.0.0.2",
                                extra=["--", "--stages", "2"])
        assert resolve(ns).master_addr == addr


def test_node_bad_node_addr(capsys, no_launch):
    assert main(["node", "--node-addr", "no such host", "--", "--stages", "2"]) == 2
    assert "--node-addr='no such host': expected a host name" in _one_line(capsys, "node")


def test_node_run_dir_that_is_a_file(tmp_path, capsys, no_launch):
    f = tmp_path / "file"
    f.write_text("keep me")
    assert main(["node", "--run-dir", str(f), "--", "--stages", "2"]) == 2
    assert f"--run-dir={str(f)!r}: is a file, expected a folder" in _one_line(capsys, "node")
    assert f.read_text() == "keep me"
    assert main(["node", "--run-dir", str(f / "below"), "--", "--stages", "2"]) == 2
    assert f"--run-dir={str(f / 'below')!r}: cannot write into the folder" in _one_line(capsys, "node")
