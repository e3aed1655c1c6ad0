"""The process kubelet (test harness) under the real control plane: pods scheduled by the real
scheduler and created by the real controllers run as local processes, with their own IPs, probes,
restarts, graceful deletion and volumes.

Tests that look at the host side of the harness (pod IPs reachable from here, the GPU node, volume
directories) are skipped on an external cluster without the harness (e.g. kind).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from waiting import wait_for

pytestmark = pytest.mark.e2e


def read(call: Callable[..., Any], *args: Any) -> dict | None:
    """An object as a plain dict via the official client (None when absent)."""
    try:
        return json.loads(call(*args, _preload_content=False).data)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def apply(cluster, namespace: str, *manifests: dict) -> None:
    document = {"apiVersion": "v1", "kind": "List", "items": list(manifests)}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(document))


def condition(obj: dict | None, kind: str) -> str | None:
    for entry in ((obj or {}).get("status") or {}).get("conditions") or []:
        if entry["type"] == kind:
            return entry["status"]
    return None


def pod(name: str, command: list[str], image: str = "busybox:1.36", **spec: Any) -> dict:
    containers = [{"name": "main", "image": image, "command": command}]
    body = {"containers": containers, "terminationGracePeriodSeconds": 5, **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


@pytest.fixture
def ns(cluster, namespace: str, kube) -> str:
    """The test's namespace, once its default ServiceAccount exists (pods are refused before)."""
    core = client.CoreV1Api(kube)
    wait_for(lambda: read(core.read_namespaced_service_account, "default", namespace), what="default SA")
    return namespace


@pytest.fixture
def harness(cluster):
    """The in-process process kubelet; skips tests that need it on clusters without it."""
    if cluster.kubelet is None:
        pytest.skip("needs the process kubelet (local control plane)")
    return cluster.kubelet


@pytest.fixture
def host_dir(ns: str) -> Iterator[Path]:
    """A directory outside the harness's state dir, for mountPaths and hostPath volumes."""
    path = Path(f"/tmp/rf-e2e-{ns}-{os.getpid()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_pod_gets_its_own_ip_becomes_ready_and_serves_http(cluster, harness, ns, kube):
    core = client.CoreV1Api(kube)
    web = pod(
        "web",
        ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        image="python:3.11",
    )
    main = web["spec"]["containers"][0]
    main["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    main["ports"] = [{"name": "http", "containerPort": 8080}]
    main["readinessProbe"] = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    apply(cluster, ns, web)

    ready = wait_for(
        lambda: condition(obj := read(core.read_namespaced_pod, "web", ns), "Ready") == "True" and obj,
        what="the web pod to be Ready",
    )
    status = ready["status"]
    assert status["phase"] == "Running" and ready["spec"]["nodeName"] == "rf-cpu-node"
    ip = status["podIP"]
    assert ip.startswith("127.") and not ip.startswith("127.0.0.")
    assert status["podIPs"] == [{"ip": ip}] and status["hostIP"] == "127.0.0.1"
    (container,) = status["containerStatuses"]
    assert container["ready"] and container["started"] and "running" in container["state"]
    assert container["containerID"].startswith("process://")
    kinds = {c["type"]: c for c in status["conditions"]}
    assert {"PodScheduled", "Initialized", "ContainersReady", "Ready"} <= set(kinds)
    assert all(c["lastTransitionTime"] for c in kinds.values())
    assert httpx.get(f"http://{ip}:8080/", timeout=5).status_code == 200


def test_service_and_per_pod_names_resolve_inside_pods(cluster, harness, ns, kube):
    """Cluster DNS stand-in: Service names and hostname.subdomain names resolve in every pod, and
    follow the endpoint when the pod behind it is replaced."""
    core = client.CoreV1Api(kube)
    web = pod(
        "web",
        ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        image="python:3.11",
        hostname="web-0",
        subdomain="webs",
    )
    web["metadata"]["labels"] = {"app": "web"}
    main = web["spec"]["containers"][0]
    main["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    main["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    port = [{"port": 8080, "targetPort": 8080}]
    services = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"selector": {"app": "web"}, "ports": port}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "webs"},
         "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": port}},
    ]  # fmt: skip
    apply(cluster, ns, web, *services)
    ip = wait_for(
        lambda: (
            condition(obj := read(core.read_namespaced_pod, "web", ns), "Ready") == "True"
            and obj["status"]["podIP"]
        ),
        what="the web pod to be Ready",
    )
    hosts = harness.state_dir / "cluster-dns" / "hosts"
    names = [f"web.{ns}.svc", f"web.{ns}.svc.cluster.local", f"web-0.webs.{ns}.svc"]
    wait_for(lambda: all(f"{ip}\t" in line for line in _hosts_lines(hosts, names)), what="DNS entries")

    fetch = "; ".join(
        ["import sys, urllib.request as u"]
        + [f"u.urlopen('http://{name}:8080/', timeout=5).read()" for name in names]
    )
    apply(cluster, ns, pod("client", ["python3", "-c", fetch], image="python:3.11", restartPolicy="Never"))
    phase = wait_for(
        lambda: (
            ((read(core.read_namespaced_pod, "client", ns) or {}).get("status") or {}).get("phase")
            in ("Succeeded", "Failed")
            and read(core.read_namespaced_pod, "client", ns)["status"]["phase"]
        ),
        what="the client pod to finish",
    )
    assert phase == "Succeeded", (harness.log_path(ns, "client", "main")).read_text()[-2000:]

    # A replacement gets a new address; the names follow it.
    core.delete_namespaced_pod("web", ns, grace_period_seconds=0)
    wait_for(lambda: read(core.read_namespaced_pod, "web", ns) is None, what="the web pod to go")
    apply(cluster, ns, web)
    new_ip = wait_for(
        lambda: (
            condition(obj := read(core.read_namespaced_pod, "web", ns), "Ready") == "True"
            and obj["status"]["podIP"]
        ),
        what="the replacement to be Ready",
    )
    assert new_ip != ip
    wait_for(lambda: all(f"{new_ip}\t" in line for line in _hosts_lines(hosts, names)), what="new entries")


def _hosts_lines(hosts: Path, names: list[str]) -> list[str]:
    """The hosts-file line naming each of `names` ("" for a name that is missing)."""
    lines = hosts.read_text().splitlines()
    return [next((line + "\t" for line in lines if name in line.split()), "") for name in names]


def test_pods_act_with_their_service_accounts_rbac(cluster, harness, ns, kube):
    core = client.CoreV1Api(kube)
    cluster.kubectl("create", "serviceaccount", "reader", "-n", ns)
    cluster.kubectl("create", "role", "pod-reader", "-n", ns, "--verb=list", "--resource=pods")
    cluster.kubectl(
        "create", "rolebinding", "reader", "-n", ns, "--role=pod-reader", f"--serviceaccount={ns}:reader"
    )
    script = (
        "import sys\nfrom kubernetes import client, config\nconfig.load_kube_config()\n"
        f"try:\n    client.CoreV1Api().list_namespaced_pod('{ns}')\nexcept client.ApiException as e:\n"
        "    sys.exit(e.status // 100)\n"
    )
    allowed = pod("allowed", ["python3", "-c", script], image="python:3.11", restartPolicy="Never")
    allowed["spec"]["serviceAccountName"] = "reader"
    denied = pod("denied", ["python3", "-c", script], image="python:3.11", restartPolicy="Never")
    apply(cluster, ns, allowed, denied)

    def phase(name: str) -> str | None:
        phase = ((read(core.read_namespaced_pod, name, ns) or {}).get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    assert wait_for(lambda: phase("allowed"), what="the reader pod to finish") == "Succeeded"
    assert wait_for(lambda: phase("denied"), what="the default-SA pod to finish") == "Failed"
    terminated = read(core.read_namespaced_pod, "denied", ns)["status"]["containerStatuses"][0]["state"]
    assert terminated["terminated"]["exitCode"] == 4  # 403 Forbidden


def test_gpu_pods_need_the_toleration_and_land_on_the_gpu_node(cluster, harness, ns, kube):
    core = client.CoreV1Api(kube)
    resources = {"limits": {"nvidia.com/gpu": "1"}}
    untolerated = pod("no-toleration", ["sleep", "3600"])
    untolerated["spec"]["containers"][0]["resources"] = resources
    engine = pod(
        "engine",
        ["sleep", "3600"],
        nodeSelector={"nvidia.com/gpu.present": "true"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    engine["spec"]["containers"][0]["resources"] = resources
    apply(cluster, ns, untolerated, engine)

    running = wait_for(
        lambda: (p := read(core.read_namespaced_pod, "engine", ns))["status"].get("phase") == "Running" and p,
        what="the tolerating GPU pod to run",
    )
    assert running["spec"]["nodeName"] == "rf-gpu-node"

    def failed_scheduling() -> bool:
        listing = read(core.list_namespaced_event, ns)
        return any(
            e["reason"] == "FailedScheduling" and e["involvedObject"]["name"] == "no-toleration"
            for e in listing["items"]
        )

    wait_for(failed_scheduling, what="a FailedScheduling event for the untolerated pod")
    pending = read(core.read_namespaced_pod, "no-toleration", ns)
    assert pending["status"]["phase"] == "Pending" and not pending["spec"].get("nodeName")
    assert condition(pending, "PodScheduled") == "False"


def test_crashing_container_is_restarted_with_growing_restart_count(cluster, ns, kube):
    core = client.CoreV1Api(kube)
    apply(cluster, ns, pod("crasher", ["sh", "-c", "exit 3"]))

    def restarted_twice() -> dict | None:
        obj = read(core.read_namespaced_pod, "crasher", ns)
        statuses = (obj.get("status") or {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    # Backoff here is 1 s then 2 s (a real kubelet: 10 s then 20 s), hence the generous bound for kind.
    container = wait_for(restarted_twice, timeout_s=45, what="two restarts")
    last = container["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"
    assert read(core.read_namespaced_pod, "crasher", ns)["status"]["phase"] == "Running"


def test_graceful_deletion_sends_sigterm_and_the_volume_keeps_what_was_written(cluster, harness, ns, kube):
    core = client.CoreV1Api(kube)
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "dumps"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    script = (
        "trap 'echo drained > /dumps/term; exit 0' TERM; echo up > /dumps/up; while true; do sleep 0.1; done"
    )
    trapper = pod(
        "trapper",
        ["sh", "-c", script],
        terminationGracePeriodSeconds=20,
        volumes=[{"name": "dumps", "persistentVolumeClaim": {"claimName": "dumps"}}],
    )
    trapper["spec"]["containers"][0]["volumeMounts"] = [{"name": "dumps", "mountPath": "/dumps"}]
    apply(cluster, ns, claim, trapper)
    claim_dir = harness.state_dir / "pvc" / ns / "dumps"
    wait_for(lambda: (claim_dir / "up").exists(), what="the pod to start and write to its claim")

    started = time.monotonic()
    cluster.kubectl("delete", "pod", "trapper", "-n", ns, "--wait=false")
    wait_for(lambda: read(core.read_namespaced_pod, "trapper", ns) is None, what="the pod object to go")
    elapsed = time.monotonic() - started
    assert (claim_dir / "term").read_text() == "drained\n"
    assert elapsed < 10, f"a pod that exits on SIGTERM was removed only after {elapsed:.1f}s"

    # A replacement pod with the same claim sees the files.
    reader = pod(
        "reader",
        ["sh", "-c", "grep -q drained /dumps/term"],
        restartPolicy="Never",
        volumes=[{"name": "dumps", "persistentVolumeClaim": {"claimName": "dumps"}}],
    )
    reader["spec"]["containers"][0]["volumeMounts"] = [{"name": "dumps", "mountPath": "/dumps"}]
    apply(cluster, ns, reader)
    wait_for(
        lambda: read(core.read_namespaced_pod, "reader", ns)["status"].get("phase") == "Succeeded",
        what="the replacement pod to read its predecessor's file",
    )


def test_a_container_ignoring_sigterm_is_killed_after_the_grace_period(cluster, ns, kube):
    core = client.CoreV1Api(kube)
    stubborn = pod("stubborn", ["sh", "-c", "trap '' TERM; while true; do sleep 0.1; done"])
    stubborn["spec"]["terminationGracePeriodSeconds"] = 3
    apply(cluster, ns, stubborn)
    wait_for(
        lambda: read(core.read_namespaced_pod, "stubborn", ns)["status"].get("phase") == "Running",
        what="the pod to run",
    )
    time.sleep(0.5)  # let the shell install its trap
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", ns, "--wait=false")
    wait_for(lambda: read(core.read_namespaced_pod, "stubborn", ns) is None, timeout_s=20, what="removal")
    elapsed = time.monotonic() - started
    assert 2.5 <= elapsed < 8, f"grace period 3 s, pod removed after {elapsed:.1f}s"


def test_deployment_pods_become_ready_and_go_with_their_owner(cluster, ns, kube):
    apps, core = client.AppsV1Api(kube), client.CoreV1Api(kube)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sleepers"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "sleepers"}},
            "template": {
                "metadata": {"labels": {"app": "sleepers"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox:1.36",
                            "command": ["sleep", "3600"],
                            "readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 1},
                        }
                    ],
                },
            },
        },
    }
    apply(cluster, ns, deployment)
    wait_for(
        lambda: (
            (read(apps.read_namespaced_deployment, "sleepers", ns)["status"].get("readyReplicas") or 0) == 2
        ),
        timeout_s=45,
        what="both replicas Ready",
    )
    pods = read(core.list_namespaced_pod, ns)["items"]
    assert len(pods) == 2
    assert {ref["kind"] for p in pods for ref in p["metadata"]["ownerReferences"]} == {"ReplicaSet"}
    assert all(condition(p, "Ready") == "True" for p in pods)

    cluster.kubectl("delete", "deployment", "sleepers", "-n", ns, "--wait=false")
    wait_for(
        lambda: (
            not read(core.list_namespaced_pod, ns)["items"]
            and not read(apps.list_namespaced_replica_set, ns)["items"]
        ),
        timeout_s=45,
        what="garbage collection of the ReplicaSet and its pods",
    )


def test_volumes_appear_at_their_mount_paths(cluster, harness, ns, kube, host_dir):
    core = client.CoreV1Api(kube)
    inside = host_dir / "inside"  # mountPaths: empty directories on the host, filled only in the pod
    shared = host_dir / "hostpath"
    cluster.kubectl("create", "configmap", "settings", "-n", ns, "--from-literal=mode=fast")
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    script = (
        f"set -e; echo scratch > {inside}/scratch/a; echo claim > {inside}/claim/b; "
        f"cp {inside}/config/mode {inside}/host/mode; cat {inside}/single-key > {inside}/host/single; "
        f"if touch {inside}/config/x 2>/dev/null; then exit 9; fi; pwd > {inside}/host/pwd"
    )
    user = pod(
        "user",
        ["sh", "-c", script],
        restartPolicy="Never",
        volumes=[
            {"name": "scratch", "emptyDir": {}},
            {"name": "claim", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "host", "hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}},
            {"name": "config", "configMap": {"name": "settings"}},
        ],
    )
    main = user["spec"]["containers"][0]
    main["workingDir"] = str(inside / "scratch")
    main["volumeMounts"] = [
        {"name": "scratch", "mountPath": f"{inside}/scratch"},
        {"name": "claim", "mountPath": f"{inside}/claim"},
        {"name": "host", "mountPath": f"{inside}/host"},
        {"name": "config", "mountPath": f"{inside}/config", "readOnly": True},
        {"name": "config", "mountPath": f"{inside}/single-key", "subPath": "mode"},
    ]
    apply(cluster, ns, claim, user)

    def finished() -> dict | None:
        obj = read(core.read_namespaced_pod, "user", ns)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    done = wait_for(finished, what="the volume pod to finish")
    log = harness.log_path(ns, "user", "main")
    assert done["status"]["phase"] == "Succeeded", log.read_text() if log.exists() else "(no log)"
    assert (shared / "mode").read_text() == "fast"
    assert (shared / "single").read_text() == "fast"
    assert (shared / "pwd").read_text() == f"{inside}/scratch\n"
    assert (harness.state_dir / "pvc" / ns / "data" / "b").read_text() == "claim\n"
    uid = done["metadata"]["uid"]
    empty_dir = harness.state_dir / "pods" / f"{ns}_user_{uid}" / "volumes" / "scratch"
    assert (empty_dir / "a").read_text() == "scratch\n"
    # The pod's mounts were private to it: on the host the mountPaths are empty directories.
    assert not any((inside / "scratch").iterdir()) and not any((inside / "claim").iterdir())
