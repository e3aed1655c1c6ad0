"""The control plane itself: a real kube-apiserver with RBAC, controller manager and scheduler,
driven with kubectl. Runs unchanged on kind (KUBECONFIG) and on the local control plane."""

from __future__ import annotations

import json

import pytest
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      # sleep as PID 1 ignores SIGTERM: without this, deleting a running pod waits out the default
      # 30 s grace period (the test measured 2.5 s or 32 s, depending on whether the pods had started).
      terminationGracePeriodSeconds: 0
      containers:
      - {name: web, image: "busybox:1.36", command: ["sleep", "600"]}
"""


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def test_version_is_a_real_release(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"].startswith("v1.") and version["gitVersion"] != "v0.0.0"
    assert int(version["minor"].rstrip("+")) >= 30


def test_apply_get_describe_scale_delete(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=DEPLOYMENT)
    assert get_json(cluster, "deployment", "web", "-n", namespace)["spec"]["replicas"] == 1
    assert "Replicas:" in cluster.kubectl("describe", "deployment", "web", "-n", namespace).stdout
    cluster.kubectl("scale", "deployment", "web", "-n", namespace, "--replicas=3")

    def three_pods():
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=web")["items"]
        return len(pods) == 3 and pods

    pods = wait_for(three_pods, what="the controller manager to create 3 pods", timeout_s=60)
    # Created by the real ReplicaSet controller: owned by the ReplicaSet, which the Deployment owns.
    owners = {ref["kind"] for pod in pods for ref in pod["metadata"]["ownerReferences"]}
    assert owners == {"ReplicaSet"}
    cluster.kubectl("delete", "deployment", "web", "-n", namespace)
    wait_for(
        lambda: not get_json(cluster, "pods", "-n", namespace)["items"],
        what="garbage collection of pods",
        timeout_s=60,
    )
    assert not get_json(cluster, "replicasets", "-n", namespace)["items"]


def test_rbac_auth_can_i(cluster, namespace):
    assert cluster.kubectl("auth", "can-i", "create", "pods", "-n", namespace).stdout.strip() == "yes"
    cluster.kubectl("create", "serviceaccount", "router", "-n", namespace)
    cluster.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list,watch", "--resource=pods"
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "router-reads-pods",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:router",
    )
    who = f"--as=system:serviceaccount:{namespace}:router"
    assert cluster.kubectl("auth", "can-i", "watch", "pods", "-n", namespace, who).stdout.strip() == "yes"
    denied = cluster.kubectl("auth", "can-i", "delete", "pods", "-n", namespace, who, check=False)
    assert denied.stdout.strip() == "no" and denied.returncode == 1
    other = cluster.kubectl("auth", "can-i", "list", "pods", "-n", "default", who, check=False)
    assert other.stdout.strip() == "no"


def test_deleting_an_owner_collects_its_dependents(cluster, namespace):
    cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=a=b")
    owner_uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(dependent))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(
        lambda: (
            cluster.kubectl("get", "configmap", "dependent", "-n", namespace, check=False).returncode != 0
        ),
        what="the garbage collector to delete the dependent",
        timeout_s=60,
    )
