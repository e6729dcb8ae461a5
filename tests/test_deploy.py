"""deploy/, validated offline: every kustomization renders (``kubectl kustomize``), core kinds
and embedded pod templates pass kubernetes-validate (strict), JobSet / TrainJob /
TrainingRuntime / PodMonitor pass the CRD schemas vendored in deploy/schemas, and the Grafana
dashboard passes its schema and queries only metrics that rrfp/obs/metrics.py defines."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install -e '.[test]')")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency")

from rrfp.obs.metrics import METRIC_NAMES  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SCHEMAS = DEPLOY / "schemas"
DASHBOARD = DEPLOY / "common" / "rrfp-dashboard.json"
K8S_VERSION = "1.33.0"
"""The Kubernetes release whose core schemas the manifests are checked against (JobSet needs
1.27 or newer; Trainer v2.3 is tested on 1.31 and newer)."""

OVERLAYS = sorted(str(k.parent.relative_to(DEPLOY)) for k in DEPLOY.rglob("kustomization.yaml"))
"""Every kustomization under deploy/ (base, overlays/trainer and the parts they build on)."""
CORE_KINDS = {"Service", "ConfigMap", "PersistentVolumeClaim", "Secret", "NetworkPolicy"}
CRD_SCHEMAS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-jobset.x-k8s.io-v1alpha2.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-trainer.kubeflow.org-v1alpha1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainingruntime-trainer.kubeflow.org-v1alpha1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
}


# ------------------------------------------------------------------ helpers
def render(overlay: str) -> list[dict]:
    """The documents ``kubectl kustomize deploy/OVERLAY`` renders (a fresh copy each call)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not on PATH")
    return copy.deepcopy(_render(overlay))


@functools.cache
def _render(overlay: str) -> list[dict]:
    p = subprocess.run([shutil.which("kubectl"), "kustomize", str(DEPLOY / overlay)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def strict(schema):
    """A CRD schema as the API server's strict field validation applies it: an object with
    ``properties`` accepts no other field unless it says so (pruning would drop them)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(api_version: str, kind: str) -> jsonschema.Validator:
    vendored = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    assert (vendored["apiVersion"], vendored["kind"]) == (api_version, kind)
    schema = strict(vendored["schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # checked by the API server's ObjectMeta
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)]


def pod_jobs(doc: dict) -> list[dict]:
    """The batch/v1 Job templates a JobSet or TrainingRuntime embeds, as Job objects (their
    pod templates are the parts the vendored CRD schemas leave open)."""
    spec = doc["spec"] if doc["kind"] == "JobSet" else doc["spec"]["template"]["spec"]
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{doc['metadata']['name']}-{rj['name']}"},
             "spec": rj["template"]["spec"]} for rj in spec["replicatedJobs"]]


def core_validate(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kustomization_renders_and_validates(overlay: str) -> None:
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is a test dependency")
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert {"PodMonitor", "ConfigMap", "PersistentVolumeClaim", "PrometheusRule", "NetworkPolicy"} <= set(kinds)
    assert {"JobSet", "TrainJob"} & set(kinds) or overlay == "common"
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if doc["kind"] in CORE_KINDS:
            core_validate(doc)
        elif key in CRD_SCHEMAS:
            assert crd_errors(doc) == [], f"{doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] in ("JobSet", "TrainingRuntime"):
                for job in pod_jobs(doc):
                    core_validate(job)
        else:
            pytest.fail(f"{overlay}: no validator for {key}")


def test_the_base_runs_the_daemon_as_asked() -> None:
    docs = {d["kind"]: d for d in render("base")}
    js, svc = docs["JobSet"], docs["Service"]
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert c["command"] == ["rrfp", "node"]
    nnodes = int(next(a for a in args if a.startswith("--nnodes=")).split("=")[1])
    assert job["parallelism"] == job["completions"] == nnodes and job["completionMode"] == "Indexed"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"  # one pod per node
    # Rendezvous at node 0's pod, by the headless service's DNS name.
    flag = {a.split("=")[0]: a.split("=", 1)[1] for a in args if "=" in a}
    assert flag["--master-addr"] == f"{js['metadata']['name']}-{rj['name']}-0-0.{js['spec']['network']['subdomain']}"
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == js["spec"]["network"]["subdomain"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(flag["--master-port"]) == ports["rdzv"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    assert f"--metrics-port={ports['metrics']}" in args and "--metrics-addr=0.0.0.0" in args
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["terminationGracePeriodSeconds"] >= 30
    env = {e["name"]: e for e in c["env"]}
    assert env["RRFP_JOB_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "rrfp-job-secret"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert f"--checkpoint-dir={mounts['checkpoints']}" in args
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    pm = docs["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= job["template"]["metadata"]["labels"].items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_trainer_overlay_uses_the_base_pod_and_pet_variables() -> None:
    base = {d["kind"]: d for d in render("base")}
    docs = {d["kind"]: d for d in render("overlays/trainer")}
    assert "JobSet" not in docs and "Service" not in docs  # the Trainer makes its own
    tj, rt = docs["TrainJob"], docs["TrainingRuntime"]
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                        "name": rt["metadata"]["name"]}
    assert "torch" in rt["spec"]["mlPolicy"]  # the torch policy sets PET_* on the node container
    (rj,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    assert rj["template"]["spec"]["template"] == base["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    args = tj["spec"]["trainer"]["args"]
    assert not any(a.startswith(("--nnodes", "--nproc-per-node", "--node-rank", "--master-")) for a in args)


def test_validators_reject_broken_manifests() -> None:
    import kubernetes_validate

    docs = {d["kind"]: d for d in render("base") + render("overlays/trainer")}
    bad_svc = copy.deepcopy(docs["Service"])
    bad_svc["spec"]["ports"][0]["port"] = "rdzv"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        core_validate(bad_svc)
    typo = copy.deepcopy(docs["PersistentVolumeClaim"])
    typo["spec"]["accesModes"] = typo["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        core_validate(typo)
    (job,) = pod_jobs(docs["JobSet"])
    del job["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match="'name' is a required property"):
        core_validate(job)
    js = copy.deepcopy(docs["JobSet"])
    js["spec"]["replicatedJobs"][0]["replica"] = 1  # a typo of "replicas"
    assert any("replica" in e for e in crd_errors(js))
    js = copy.deepcopy(docs["JobSet"])
    js["spec"]["failurePolicy"]["restartStrategy"] = "Sometimes"
    assert any("Sometimes" in e for e in crd_errors(js))
    tj = copy.deepcopy(docs["TrainJob"])
    del tj["spec"]["runtimeRef"]
    assert any("runtimeRef" in e for e in crd_errors(tj))
    pm = copy.deepcopy(docs["PodMonitor"])
    pm["spec"]["podMetricsEndpoints"][0]["scheme"] = "gopher"
    assert any("gopher" in e for e in crd_errors(pm))


# ---------------------------------------------------------------- dashboard
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def dashboard_exprs() -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names (inside ``{}`` or ``by (...)``), ranges or strings."""
    e = re.sub(r'"[^"]*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def exposed(name: str) -> bool:
    return name in METRIC_NAMES or any(name == f"{base}_{s}" for base in METRIC_NAMES for s in ("bucket", "sum", "count"))


def test_dashboard_matches_its_schema_and_shows_the_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    schema = json.loads((SCHEMAS / "grafana-dashboard.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(dash)
    titles = [p["title"] for p in dash["panels"]]
    for want in ("Bubble % per rank", "Step time", "Tokens/s", "In-flight", "Rejected messages", "Restarts",
                 "Learning rate", "Grad norm", "TFLOP/s", "MFU", "Memory"):
        assert any(t.startswith(want) for t in titles), want
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    broken = copy.deepcopy(dash)
    del broken["panels"][0]["gridPos"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_dashboard_filters_every_query_by_job_and_namespace() -> None:
    """The ``namespace`` and ``job`` variables (``job``: the JobSet's name, podmonitor.yaml's
    jobLabel) list what the scraped series carry, and every selector of every query uses both."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["namespace"]["query"]["query"] == "label_values(rrfp_steps_total, namespace)"
    assert variables["job"]["query"]["query"] == 'label_values(rrfp_steps_total{namespace="$namespace"}, job)'
    for title, expr in dashboard_exprs():
        selectors = re.findall(r"\b(rrfp_[a-z_]+)(\{[^}]*\})?", expr)
        assert selectors, (title, expr)
        for name, labels in selectors:
            assert 'namespace="$namespace"' in labels and 'job="$job"' in labels, (title, name, expr)
    pm = next(d for d in render("common") if d["kind"] == "PodMonitor")
    assert pm["spec"]["jobLabel"] == "jobset.sigs.k8s.io/jobset-name"


def test_dashboard_queries_name_only_defined_metrics() -> None:
    seen = set()
    for title, expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, f"{title}: {expr} selects no metric"
        assert all(exposed(n) for n in names), f"{title}: {sorted(n for n in names if not exposed(n))} not defined"
        seen |= names
    bubble = next(e for t, e in dashboard_exprs() if t.startswith("Bubble"))
    assert metric_names(bubble) == {"rrfp_busy_seconds_total", "rrfp_idle_seconds_total"}
    assert "_fraction" not in json.dumps(json.loads(DASHBOARD.read_text()))
    # The checker itself: an unknown metric is caught, label names and functions are not metrics.
    assert metric_names('sum by (rank) (rate(rrfp_bubble_fraction{rank="0"}[5m]))') == {"rrfp_bubble_fraction"}
    assert not exposed("rrfp_bubble_fraction") and exposed("rrfp_step_duration_seconds_bucket")
