"""deploy/'s restart and success rules, driven against rrfp's exit codes (issue 32 item 2): a
preempted run (every daemon exits :data:`rrfp.train.stop.PREEMPTED`) is restarted without
counting against ``maxRestarts`` and resumes from its checkpoint; a failure restarts it up to
``maxRestarts``; only a finished run (every pod exits 0) completes the JobSet.

The rules are read from what ``kubectl kustomize`` renders (the JobSet of deploy/base, the
TrainingRuntime's JobSet template of the Trainer overlay) and evaluated here as the Job
controller (batch/v1 ``podFailurePolicy``, ``backoffLimit``; Kubernetes 1.31+) and the JobSet
controller (``failurePolicy.rules``, ``successPolicy``; JobSet v0.12) apply them, the
controllers' documented semantics written out below. No cluster runs here.
"""

from __future__ import annotations

import dataclasses

import pytest

from test_deploy import render

from rrfp.train.stop import PREEMPTED

FINISHED, FAILED, OOM_KILLED = 0, 1, 137


@dataclasses.dataclass
class Pod:
    """How one pod of a Job ended: its container's exit code and the pod's conditions."""

    exit_code: int
    container: str = "node"
    conditions: tuple[str, ...] = ()


def _rule_matches(rule: dict, pod: Pod) -> bool:
    """batch/v1 PodFailurePolicyRule: ``onExitCodes`` (``In``/``NotIn`` over the named
    container's non-zero exit code, any container when unnamed) or ``onPodConditions``
    (a condition of that type with that status, default True)."""
    if "onExitCodes" in rule:
        req = rule["onExitCodes"]
        if req.get("containerName") not in (None, pod.container):
            return False
        inside = pod.exit_code in req["values"]
        return inside if req["operator"] == "In" else (not inside and pod.exit_code != 0)
    return any(c["type"] in pod.conditions and c.get("status", "True") == "True" for c in rule["onPodConditions"])


def job_outcome(job: dict, pods: list[Pod]) -> tuple[str, str | None]:
    """What the Job controller makes of its pods' ends: ``("Complete", None)``,
    ``("Failed", reason)`` with reason ``PodFailurePolicy`` (a ``FailJob`` rule matched) or
    ``BackoffLimitExceeded``, or ``("Running", None)``. The first matching rule acts; a
    failed pod no rule matches counts against ``backoffLimit`` (default 6)."""
    rules = (job.get("podFailurePolicy") or {}).get("rules", [])
    counted = 0
    for pod in pods:
        if pod.exit_code == 0:
            continue
        action = next((r["action"] for r in rules if _rule_matches(r, pod)), "Count")
        assert action in ("FailJob", "Ignore", "Count"), action  # FailIndex needs backoffLimitPerIndex
        if action == "FailJob":
            return "Failed", "PodFailurePolicy"
        counted += action == "Count"
    if counted > job.get("backoffLimit", 6):
        return "Failed", "BackoffLimitExceeded"
    if sum(p.exit_code == 0 for p in pods) >= job["completions"]:
        return "Complete", None
    return "Running", None


def jobset_action(spec: dict, replicated_job: str, reason: str) -> str:
    """The JobSet controller's answer to a failed Job: the first ``failurePolicy.rules`` entry
    whose ``onJobFailureReasons`` and ``targetReplicatedJobs`` (empty: any) match, else
    ``RestartJobSet``."""
    for rule in (spec.get("failurePolicy") or {}).get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("targetReplicatedJobs") and replicated_job not in rule["targetReplicatedJobs"]:
            continue
        return rule["action"]
    return "RestartJobSet"


def run_jobset(spec: dict, attempts: list[list[Pod]]) -> tuple[str, int]:
    """Play ``attempts`` (each: how every pod of the one replicated Job ended) through the
    JobSet's rules; returns its state (``Completed``, ``Failed``, or ``Running`` when the
    attempts ran out) and the restarts counted against ``maxRestarts``."""
    (rj,) = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    max_restarts = (spec.get("failurePolicy") or {}).get("maxRestarts", 0)
    success = spec.get("successPolicy") or {"operator": "All"}
    assert success["operator"] == "All" and success.get("targetReplicatedJobs", [rj["name"]]) == [rj["name"]]
    counted = 0
    for pods in attempts:
        assert len(pods) == job["parallelism"] == job["completions"]
        state, reason = job_outcome(job, pods)
        if state == "Complete":
            return "Completed", counted
        if state == "Running":
            return "Running", counted
        action = jobset_action(spec, rj["name"], reason)
        if action == "FailJobSet":
            return "Failed", counted
        if action == "RestartJobSet":
            if counted >= max_restarts:
                return "Failed", counted
            counted += 1
        else:
            assert action == "RestartJobSetAndIgnoreMaxRestarts", action
    return "Running", counted


def _specs() -> dict[str, dict]:
    """The JobSet spec of each way deploy/ runs rrfp."""
    base = {d["kind"]: d for d in render("base")}
    trainer = {d["kind"]: d for d in render("overlays/trainer")}
    runtime = trainer["TrainingRuntime"]["spec"]["template"]["spec"]
    # The Trainer sets the Job's pod count from the TrainJob's numNodes.
    n = trainer["TrainJob"]["spec"]["trainer"]["numNodes"]
    runtime["replicatedJobs"][0]["template"]["spec"].update(parallelism=n, completions=n)
    return {"jobset": base["JobSet"]["spec"], "trainjob": runtime}


@pytest.fixture(scope="module", params=["jobset", "trainjob"])
def spec(request) -> dict:
    return _specs()[request.param]


def test_a_preempted_job_restarts_without_counting_and_is_never_completed(spec):
    """Every daemon exits 143 after a SIGTERM (the signalled one and its peer; main exited
    0, and the JobSet was Completed mid-run). Ten preemptions in a row restart the set ten
    times, none counted; the eleventh attempt finishes and completes it."""
    preempted = [Pod(PREEMPTED), Pod(PREEMPTED)]
    assert run_jobset(spec, [preempted] * 10) == ("Running", 0)
    assert run_jobset(spec, [preempted] * 10 + [[Pod(FINISHED), Pod(FINISHED)]]) == ("Completed", 0)
    # One pod's SIGTERM (its peer still running when the Job fails) is enough.
    assert job_outcome(spec["replicatedJobs"][0]["template"]["spec"], [Pod(PREEMPTED), Pod(FINISHED)]) == \
        ("Failed", "PodFailurePolicy")
    # An eviction that outlasted the grace period: SIGKILL (137) with the DisruptionTarget condition.
    assert run_jobset(spec, [[Pod(OOM_KILLED, conditions=("DisruptionTarget",)), Pod(PREEMPTED)]] * 5) == ("Running", 0)


def test_failures_restart_up_to_max_restarts_then_fail(spec):
    """A rank's failure (daemon exit 1) or an OOM kill (137, no disruption) counts: the set
    restarts ``maxRestarts`` times, then fails; preemptions in between do not use restarts up."""
    limit = spec["failurePolicy"]["maxRestarts"]
    assert limit >= 1
    failed = [Pod(FAILED), Pod(FINISHED)]
    assert run_jobset(spec, [failed] * limit) == ("Running", limit)
    assert run_jobset(spec, [failed] * (limit + 1)) == ("Failed", limit)
    assert run_jobset(spec, [[Pod(OOM_KILLED), Pod(FINISHED)]] * (limit + 1)) == ("Failed", limit)
    mixed = [failed, [Pod(PREEMPTED)] * 2] * limit + [[Pod(FINISHED)] * 2]
    assert run_jobset(spec, mixed) == ("Completed", limit)


def test_only_exit_0_on_every_pod_completes_the_set(spec):
    assert run_jobset(spec, [[Pod(FINISHED), Pod(FINISHED)]]) == ("Completed", 0)
    for code in (PREEMPTED, FAILED, OOM_KILLED):
        assert run_jobset(spec, [[Pod(FINISHED), Pod(code)]])[0] != "Completed", code


def test_a_restarted_job_resumes_from_the_checkpoint_volume():
    """What a restart starts: the same daemon with ``--resume=auto`` on the checkpoint folder,
    a PersistentVolumeClaim (kept across the JobSet's restarts), and the restart rules name the
    daemon's container; the preemption code is the one rrfp exits with."""
    base = {d["kind"]: d for d in render("base")}
    trainer = {d["kind"]: d for d in render("overlays/trainer")}
    pod = base["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    for args in (c["args"], trainer["TrainJob"]["spec"]["trainer"]["args"]):
        flags = dict(a.split("=", 1) for a in args if "=" in a)
        assert flags["--resume"] == "auto" and flags["--checkpoint-dir"] == "/checkpoints"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in vols[mounts["/checkpoints"]]
    for spec in _specs().values():
        rules = spec["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
        codes = [r["onExitCodes"] for r in rules if "onExitCodes" in r]
        assert codes == [{"containerName": c["name"], "operator": "In", "values": [PREEMPTED]}]
    assert PREEMPTED == 143


def test_the_evaluator_reads_the_rules_it_is_given():
    """The rule evaluator itself, on hand-written specs: no rules means every failure counts
    (main's JobSet); a rule for another reason does not apply."""
    job = {"parallelism": 2, "completions": 2, "backoffLimit": 0}
    plain = {"replicatedJobs": [{"name": "node", "template": {"spec": job}}], "failurePolicy": {"maxRestarts": 1}}
    assert run_jobset(plain, [[Pod(PREEMPTED)] * 2] * 2) == ("Failed", 1)
    assert run_jobset(plain, [[Pod(FINISHED)] * 2]) == ("Completed", 0)  # main's preempted daemons exited 0
    other = dict(plain, failurePolicy={"maxRestarts": 1, "rules": [
        {"name": "x", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]}]})
    assert run_jobset(other, [[Pod(FAILED), Pod(FINISHED)]]) == ("Running", 1)
    assert job_outcome(job, [Pod(FINISHED), Pod(FINISHED)]) == ("Complete", None)
    assert not _rule_matches({"onExitCodes": {"operator": "NotIn", "values": [1]}}, Pod(0))
    assert _rule_matches({"onExitCodes": {"operator": "NotIn", "values": [1]}}, Pod(2))
    assert not _rule_matches({"onExitCodes": {"containerName": "other", "operator": "In", "values": [143]}}, Pod(143))
