"""Rollout workers against a fleet (issue #7), end to end: the example rollout runs as a pod in the
cluster (so it reaches the proxies by their per-pod DNS names, like a real rollout worker) with the
fleet's status as its only configuration. Sessions spread over every proxy and stay on their owner;
when an owner is deleted mid-rollout, or restarted by the memory watchdog, every session completes
with all its turns; a session whose dump was removed on purpose is reported as lost, by name.

The engine is the fixed-latency upstream stand-in (a test stand-in for SGLang) on this machine, behind
the real router; the latency keeps sessions in flight while proxies come and go. When a prompt offers
tools, it answers as a tool-using model would (the calculator stand-in): the second rollout runs
with the calculator tool, so its sessions take tool turns while the watchdog restarts their owners.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from operator_install import installed_operator
from rolloutfleet_operator.plan import is_ready
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.calculator_model import CalculatorModel
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_upstream_stub
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "rollout-e2e"
FLEET = "rl"
REPLICAS = 3
TURN_LATENCY_S = 0.5


@pytest.fixture(scope="module")
def operator_namespace(cluster):
    with installed_operator(cluster, NAMESPACE, "ro"):
        yield NAMESPACE


def get(cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json").stdout)


def proxy_pods(cluster) -> dict[str, dict]:
    pods = get(cluster, "pods", "-l", f"rolloutfleet.dev/fleet={FLEET},app.kubernetes.io/component=proxy")
    return {p["metadata"]["name"]: p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")}


def all_pod_names(cluster) -> set[str]:
    """Every proxy pod the API still has, terminating ones included."""
    pods = get(cluster, "pods", "-l", f"rolloutfleet.dev/fleet={FLEET},app.kubernetes.io/component=proxy")
    return {p["metadata"]["name"] for p in pods["items"]}


def fleet_ready(cluster, replicas: int = REPLICAS) -> bool:
    status = get(cluster, "rf", FLEET).get("status", {})
    conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
    pods = proxy_pods(cluster)
    return conditions.get("Ready") == "True" and len(pods) == replicas and all(map(is_ready, pods.values()))


def start_rollout(cluster, work: Path, name: str, sessions: int, turns: int, *extra: str) -> None:
    """The example rollout as a pod (the test kit's image), configured by the fleet object only."""
    (work / "fleet.json").write_text(
        cluster.kubectl("get", "rf", FLEET, "-n", NAMESPACE, "-o", "json").stdout
    )
    args = ["--fleet-status", "/rollout/fleet.json", "--sessions", str(sessions), "--turns", str(turns)]
    args += ["--stagger-s", "1", "--restart-timeout-s", "240", "--progress-interval-s", "1", *extra]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "rollout",
                    "image": fleet_setup.TESTKIT_IMAGE,
                    "command": ["rolloutfleet-rollout-example"],
                    "args": args,
                    "env": [
                        {
                            "name": "ROLLOUTFLEET_PROXY_ADMIN_KEY",
                            "valueFrom": {"secretKeyRef": {"name": f"{FLEET}-admin-key", "key": "admin-key"}},
                        }
                    ],
                    "volumeMounts": [{"name": "work", "mountPath": "/rollout", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "work", "hostPath": {"path": str(work)}}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    wait_for(
        lambda: "rollout:" in cluster.logs(NAMESPACE, name, "rollout"), timeout_s=120, what=f"{name} to start"
    )


def rollout_summary(cluster, name: str) -> dict:
    phase = wait_for(
        lambda: (
            (get(cluster, "pod", name).get("status") or {}).get("phase") in ("Succeeded", "Failed")
            and get(cluster, "pod", name)["status"]["phase"]
        ),
        timeout_s=300,
        what=f"{name} to finish",
        interval_s=1,
    )
    log = cluster.logs(NAMESPACE, name, "rollout")
    lines = [line for line in log.splitlines() if line.startswith("{")]
    assert lines, f"{name} ended ({phase}) without a summary:\n{log[-3000:]}"
    return json.loads(lines[-1])


def test_sessions_ride_through_proxy_replacement_and_lost_ones_are_named(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path
):
    dumps = fleet_setup.pod_writable(tmp_path / "dumps")
    model = CalculatorModel(test_tokenizer_dir)
    stub = create_upstream_stub(TURN_LATENCY_S, 8, ruled=model.replies())
    with serve_app(stub, host=cluster.host_ip) as engine_url:
        fleet = fleet_setup.external_fleet(
            FLEET,
            NAMESPACE,
            test_tokenizer_dir,
            engine_url,
            REPLICAS,
            dump={"hostPath": {"path": str(dumps)}},
            drainGraceSeconds=10,
            terminationGracePeriodSeconds=30,
            memory={"checkIntervalSeconds": 1, "consecutiveSamples": 1, "cooldownSeconds": 600},
            toolCallParser="qwen25",
        )
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(lambda: fleet_ready(cluster), timeout_s=180, what="the fleet Ready", interval_s=1)

        # 1. An owner deleted mid-rollout, and another's sessions lost on purpose.
        start_rollout(cluster, fleet_setup.pod_writable(tmp_path / "work"), "rollout-a", sessions=24, turns=6)
        time.sleep(3 * TURN_LATENCY_S + 1)  # every session is under way
        before = {name: pod["metadata"]["uid"] for name, pod in proxy_pods(cluster).items()}
        cluster.kubectl("delete", "pod", f"{FLEET}-proxy-1", "-n", NAMESPACE, "--wait=false")
        # proxy-2 leaves with the scale-down (draining its sessions to its dump directory); its
        # dumps are removed while it is gone, so its successor has nothing to restore.
        cluster.kubectl("scale", "rf", FLEET, "-n", NAMESPACE, "--replicas=2")
        live = dumps / f"{FLEET}-proxy-2" / "live"
        # Gone from the API, not only terminating: its drain has finished writing (a listing taken
        # while it drains holds write_atomic's temporary files).
        wait_for(lambda: f"{FLEET}-proxy-2" not in all_pod_names(cluster), timeout_s=90, what="proxy-2 gone")
        wait_for(lambda: live.is_dir() and any(live.iterdir()), timeout_s=30, what="proxy-2's dumps")
        writing = [path.name for path in live.iterdir() if path.name.startswith(".")]
        assert not writing, f"a drain still writing: {writing}"
        removed = sorted(path.name.split(".")[0] for path in live.iterdir())
        for path in list(live.iterdir()):
            path.unlink()
        cluster.kubectl("scale", "rf", FLEET, "-n", NAMESPACE, "--replicas=3")
        summary = rollout_summary(cluster, "rollout-a")

        assert set(summary["sessions_per_proxy"]) == {
            f"http://{FLEET}-proxy-{i}.{FLEET}-proxies.{NAMESPACE}.svc:8000" for i in range(REPLICAS)
        }, "sessions spread over every proxy, each kept by its owner's per-pod DNS name"
        lost = {entry["session_id"]: entry["error"] for entry in summary["failed_sessions"]}
        assert sorted(lost) == removed, "exactly the sessions whose dumps were removed are reported"
        assert all("lost" in error.lower() and sid in error for sid, error in lost.items()), lost
        assert summary["sessions"] == 24 and summary["failures"] == len(removed) > 0
        assert summary["turns"] >= (24 - len(removed)) * 6  # every other session got all its turns
        assert summary["trajectories_exported"] == 24 - len(removed)
        assert proxy_pods(cluster)[f"{FLEET}-proxy-1"]["metadata"]["uid"] != before[f"{FLEET}-proxy-1"]

        # 2. Every owner restarted by the memory watchdog mid-rollout (a budget below any proxy's
        # RSS; one restart each, then a 10-minute cooldown), while sessions take tool turns: nothing
        # is lost.
        wait_for(lambda: fleet_ready(cluster), timeout_s=120, what="the fleet Ready again", interval_s=1)
        start_rollout(cluster, fleet_setup.pod_writable(tmp_path / "work"), "rollout-b", 24, 6, "--tools")
        time.sleep(3 * TURN_LATENCY_S + 1)
        patch = {"spec": {"proxy": {"memory": {"rssBudgetBytes": 1}}}}
        cluster.kubectl("patch", "rf", FLEET, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))
        summary = rollout_summary(cluster, "rollout-b")
        assert summary["failures"] == 0, summary["failed_sessions"]
        assert summary["sessions"] == 24 and summary["turns"] == 24 * 6
        assert summary["tool_calls"] == 24, "each session called the calculator once"
        assert summary["mean_reward"] == 1.0, "each session answered with the tool's result"
        assert summary["trajectories_exported"] == 24
        restarts = get(cluster, "rf", FLEET)["status"]["memoryRestarts"]["total"]
        assert restarts >= 1, "the watchdog restarted proxies during the rollout"
        cluster.kubectl("delete", "rf", FLEET, "-n", NAMESPACE)
