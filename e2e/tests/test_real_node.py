"""The test cluster's nodes are real: the kubelet with containerd and runc, pods in their own network
namespaces on the node's bridge, kube-proxy for Service addresses, CoreDNS for names, `kubectl logs`
and `exec` through the API server, cgroup memory limits enforced by the kernel (OOMKilled, exit
137), GPU pods scheduled onto the GPU node by its label, taint and `nvidia.com/gpu` capacity,
pods of the two nodes reaching each other, and nothing of theirs leaving this machine.
Runs unchanged on kind (its nodes must hold the images; the GPU tests need a node labelled like ours)."""

from __future__ import annotations

import json

import pytest
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

BUSYBOX = "busybox:1.36"
GPU_PLACEMENT = {
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


def pod(name: str, namespace: str, image: str, command: list[str], **spec) -> dict:
    container = {"name": "main", "image": image, "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 1, **spec},
    }


def apply(cluster, *objects: dict) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    )


def get_pod(cluster, namespace: str, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)


def finished(cluster, namespace: str, name: str) -> dict | None:
    status = get_pod(cluster, namespace, name).get("status", {})
    return status if status.get("phase") in ("Succeeded", "Failed") else None


def test_logs_exec_and_a_pod_of_its_own_network(cluster, namespace):
    apply(cluster, pod("shell", namespace, BUSYBOX, ["sh", "-c", "echo started on $(hostname); sleep 600"]))
    cluster.kubectl("wait", "--for=condition=Ready", "pod/shell", "-n", namespace, "--timeout=120s")
    wait_for(lambda: "started on shell" in cluster.logs(namespace, "shell"), what="the container's log")
    status = get_pod(cluster, namespace, "shell")["status"]
    assert status["podIP"] != status["hostIP"], "the pod has an address of its own"
    inside = cluster.kubectl("exec", "shell", "-n", namespace, "--", "ip", "addr", "show", "eth0")
    assert status["podIP"] in inside.stdout, inside.stdout


def test_service_names_and_addresses_reach_pods(cluster, namespace):
    web = pod(
        "web",
        namespace,
        BUSYBOX,
        ["sh", "-c", "mkdir -p /www && echo served-by-web > /www/index.html && httpd -f -p 8080 -h /www"],
        container={"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}},
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    # The port differs from the target port: only kube-proxy's rewrite gets the client there.
    fetch = f"nslookup web.{namespace}.svc.cluster.local && wget -q -O- http://web.{namespace}.svc:80/"
    apply(cluster, web, service)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/web", "-n", namespace, "--timeout=120s")
    apply(cluster, pod("client", namespace, BUSYBOX, ["sh", "-c", fetch], restartPolicy="Never"))
    status = wait_for(lambda: finished(cluster, namespace, "client"), timeout_s=120, what="the client pod")
    log = cluster.logs(namespace, "client")
    assert status["phase"] == "Succeeded", log
    cluster_ip = json.loads(cluster.kubectl("get", "svc", "web", "-n", namespace, "-o", "json").stdout)[
        "spec"
    ]
    assert cluster_ip["clusterIP"] in log and "served-by-web" in log, log


def test_pods_reach_the_api_server_with_their_service_account(cluster, namespace):
    script = (
        "import json, ssl, urllib.request\n"
        "base = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "token = open(base + '/token').read()\n"
        "context = ssl.create_default_context(cafile=base + '/ca.crt')\n"
        "request = urllib.request.Request('https://kubernetes.default.svc/version',"
        " headers={'Authorization': 'Bearer ' + token})\n"
        "print(json.load(urllib.request.urlopen(request, context=context))['gitVersion'])\n"
    )
    apply(
        cluster,
        pod("api", namespace, fleet_setup.TESTKIT_IMAGE, ["python", "-c", script], restartPolicy="Never"),
    )
    status = wait_for(lambda: finished(cluster, namespace, "api"), timeout_s=120, what="the API client pod")
    log = cluster.logs(namespace, "api")
    assert status["phase"] == "Succeeded" and log.startswith("v1."), log


def test_a_container_over_its_memory_limit_is_oom_killed_by_the_kernel(cluster, namespace):
    hog = "b = bytearray(256 * 2**20)\nprint('allocated', flush=True)\n"  # 256 MiB, touched
    apply(
        cluster,
        pod(
            "hog",
            namespace,
            fleet_setup.TESTKIT_IMAGE,
            ["python", "-c", hog],
            restartPolicy="Never",
            container={"resources": {"limits": {"memory": "96Mi"}}},
        ),
    )
    status = wait_for(lambda: finished(cluster, namespace, "hog"), timeout_s=120, what="the hog to end")
    (container,) = status["containerStatuses"]
    terminated = container["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled" and terminated["exitCode"] == 137, terminated
    assert "allocated" not in cluster.logs(namespace, "hog")


def test_gpu_pods_land_on_the_gpu_node_and_others_stay_off_it(cluster, namespace):
    gpus = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    apply(
        cluster,
        pod("trainer", namespace, BUSYBOX, ["sleep", "600"], container=gpus, **GPU_PLACEMENT),
        pod("plain", namespace, BUSYBOX, ["sleep", "600"]),
        # Asks for a GPU but does not tolerate the GPU node's taint: nowhere to go.
        pod("untolerated", namespace, BUSYBOX, ["sleep", "600"], container=gpus),
    )
    cluster.kubectl(
        "wait", "--for=condition=Ready", "pod/trainer", "pod/plain", "-n", namespace, "--timeout=120s"
    )
    assert get_pod(cluster, namespace, "trainer")["spec"]["nodeName"] in cluster.node_names(gpu=True)
    assert get_pod(cluster, namespace, "plain")["spec"]["nodeName"] in cluster.node_names(gpu=False)
    pending = wait_for(
        lambda: (s := get_pod(cluster, namespace, "untolerated")["status"]).get("conditions") and s,
        what="the scheduler's verdict",
    )
    assert pending["phase"] == "Pending"
    assert any(c["type"] == "PodScheduled" and c["status"] == "False" for c in pending["conditions"])


def test_a_pod_on_one_node_reaches_a_pod_on_the_other_through_a_service(cluster, namespace):
    server = pod(
        "gpu-web",
        namespace,
        BUSYBOX,
        ["sh", "-c", "mkdir -p /www && echo from-the-gpu-node > /www/index.html && httpd -f -p 8080 -h /www"],
        container={"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}},
        **GPU_PLACEMENT,
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gpu-web", "namespace": namespace},
        "spec": {"selector": {"app": "gpu-web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    apply(cluster, server, service)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/gpu-web", "-n", namespace, "--timeout=120s")
    # (No `-T`: Debian's static busybox 1.35 wget crashes with SIGSEGV when given a timeout.)
    fetch = ["wget", "-q", "-O-", f"http://gpu-web.{namespace}.svc/"]
    apply(cluster, pod("cpu-client", namespace, BUSYBOX, fetch, restartPolicy="Never"))
    status = wait_for(lambda: finished(cluster, namespace, "cpu-client"), timeout_s=120, what="the client")
    log = cluster.logs(namespace, "cpu-client")
    assert status["phase"] == "Succeeded" and "from-the-gpu-node" in log, log
    placed = {
        name: get_pod(cluster, namespace, name)["spec"]["nodeName"] for name in ("gpu-web", "cpu-client")
    }
    assert placed["gpu-web"] in cluster.node_names(gpu=True)
    assert placed["cpu-client"] in cluster.node_names(gpu=False)


OUTSIDE = "198.51.100.1"  # TEST-NET-2: routed out of this machine's uplink, answered by nobody


@pytest.mark.local_cluster(reason="the guard is the local cluster's (kind keeps its own pod network)")
def test_pods_never_reach_beyond_this_machine(cluster, namespace):
    import subprocess

    from rolloutfleet_testkit.node import host

    if subprocess.run(["ip", "route", "get", OUTSIDE], capture_output=True).returncode != 0:
        pytest.skip(f"this machine has no route to {OUTSIDE}: nothing would be forwarded anyway")
    before = host.guard_dropped()
    assert host.GUARD_OUT in before, f"the guard is not up: {before}"
    apply(
        cluster,
        pod(
            "escape",
            namespace,
            BUSYBOX,
            ["nc", "-w", "3", OUTSIDE, "80"],
            restartPolicy="Never",
        ),
    )
    status = wait_for(
        lambda: finished(cluster, namespace, "escape"), timeout_s=120, what="the escape attempt"
    )
    assert status["phase"] == "Failed", cluster.logs(namespace, "escape")
    after = host.guard_dropped()
    assert after[host.GUARD_OUT] > before[host.GUARD_OUT], (before, after)
