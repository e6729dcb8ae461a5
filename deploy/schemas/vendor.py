"""Write the vendored CRD schemas of this folder from the upstream CRD YAML files.

    python deploy/schemas/vendor.py jobset.x-k8s.io_jobsets.yaml trainer.kubeflow.org_trainjobs.yaml \
        trainer.kubeflow.org_trainingruntimes.yaml monitoring.coreos.com_podmonitors.yaml

For each CRD it keeps the served version's ``openAPIV3Schema`` and makes it small: every
``description`` is dropped, ``status`` is dropped (manifests never set it), and the subtrees
listed in PRUNE, which embed whole core Kubernetes types, become "any object": those parts of
our manifests are checked as core kinds with kubernetes-validate instead (tests/test_deploy.py).
Needs PyYAML (a test dependency).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

# kind -> property paths ("[]" steps into a list's items) replaced by an open object.
PRUNE = {
    "JobSet": [
        "spec.replicatedJobs[].template.spec.template",  # a core PodTemplateSpec
        "spec.volumeClaimPolicies[].templates[]",  # core PersistentVolumeClaims
    ],
    "TrainJob": [
        "spec.runtimePatches",  # patches over a whole TrainingRuntime (an embedded JobSet)
    ],
    "TrainingRuntime": [
        "spec.template.spec.replicatedJobs[].template.spec.template",  # a core PodTemplateSpec
        "spec.template.spec.volumeClaimPolicies[].templates[]",  # core PersistentVolumeClaims
    ],
    "PodMonitor": [],
}
OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def prune(schema: dict, path: str) -> None:
    node, steps = schema, path.replace("[]", ".[]").split(".")
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if step == "[]":
            if last:
                node["items"] = dict(OPEN)
            node = node["items"]
        else:
            if last:
                node["properties"][step] = dict(OPEN)
            node = node["properties"][step]


def vendor(crd_file: str) -> Path:
    crd = yaml.safe_load(Path(crd_file).read_text())
    kind, group = crd["spec"]["names"]["kind"], crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = strip(version["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    for path in PRUNE[kind]:
        prune(schema, path)
    out = Path(__file__).parent / f"{kind.lower()}-{group}-{version['name']}.json"
    out.write_text(json.dumps({"apiVersion": f"{group}/{version['name']}", "kind": kind, "schema": schema},
                              indent=1, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    for f in sys.argv[1:]:
        print(vendor(f))
