"""Proxies on nodes that go away, on the real nodes of the local cluster: the operator (installed by its
chart, running as a pod on the CPU node) keeps memory restarts within maxUnavailable while a node is
drained, and replaces a proxy whose node stopped (its kubelet killed) without blocking the memory
restarts of the others for longer than the fleet's lostProxyTimeoutSeconds.

The proxies are /stats stand-ins (the test kit image with TESTKIT_PROGRAM=stats-standin, a test
stand-in for the proxy image: rolloutfleet_testkit/stats_standin.py) whose reported RSS the test
sets. They tolerate the GPU node's taint and spread over both nodes (one domain per node; nodes a
pod cannot be scheduled on, such as a cordoned one, do not count), so some run on `rf-gpu-node`,
which the tests drain or stop; the operator, the router and CoreDNS stay on `rf-cpu-node`.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fleet_watch import FleetWatch, all_replaced_and_available, available, proxy_pods
from operator_install import installed_operator
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_upstream_stub
from rolloutfleet_testkit.waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.local_cluster(reason="drains and stops the local cluster's kubelets"),
]

NAMESPACE = "node-failures"
GPU_NODE = "rf-gpu-node"
CPU_NODE = "rf-cpu-node"
MIB = 2**20
STANDIN_RSS = 50 * MIB
BUDGET = 100 * MIB
OVER_BUDGET = 150 * MIB
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPREAD = {
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "nodeTaintsPolicy": "Honor",  # a cordoned (or lost) node is no domain to balance against
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "proxy"}},
        }
    ],
}


@pytest.fixture(scope="module")
def operator_namespace(cluster):
    with installed_operator(cluster, NAMESPACE, "nf"):
        yield NAMESPACE


@pytest.fixture
def engine_url(cluster):
    with serve_app(create_upstream_stub(0.01, 8), host=cluster.host_ip) as url:
        yield url


def get(cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json").stdout)


def condition(cluster, fleet: str, kind: str) -> dict:
    status = get(cluster, "rf", fleet).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def reasons(cluster, name: str) -> list[str]:
    events = get(cluster, "events", "--field-selector", f"involvedObject.name={name}")["items"]
    return [e["reason"] for e in events]


def set_rss(pod: dict, rss_bytes: int) -> None:
    url = f"http://{pod['status']['podIP']}:8000/standin/control"
    answer = httpx.post(url, json={"rss_bytes": rss_bytes}, timeout=10)
    assert answer.status_code == 200, answer.text


def start_standin_fleet(
    cluster, name: str, replicas: int, engine_url, tokenizer_dir, dump_dir, tolerations=(), **proxy
):
    """Stand-in proxies spread over both nodes (`tolerations` beside the GPU node's), with `proxy`
    (e.g. the watchdog's settings); returns the pods once every one is available."""
    fleet = fleet_setup.standin_fleet(
        name,
        NAMESPACE,
        tokenizer_dir,
        engine_url,
        replicas,
        dump_dir,
        rss_bytes=STANDIN_RSS,
        drain_s=2,
        drainGraceSeconds=1,
        terminationGracePeriodSeconds=5,
        tolerations=[GPU_TOLERATION, *tolerations],
        **SPREAD,
        **proxy,
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
    return wait_for(
        lambda: (
            len(pods := proxy_pods(cluster, NAMESPACE, name)) == replicas
            and all(available(p) for p in pods.values())
            and pods
        ),
        timeout_s=120,
        what=f"{replicas} stand-in proxies of {name} available",
        interval_s=0.5,
    )


# Every proxy restarted once at most (a long cooldown), one at a time, two samples over budget.
MEMORY = {
    "rssBudgetBytes": BUDGET,
    "checkIntervalSeconds": 1,
    "consecutiveSamples": 2,
    "maxUnavailable": 1,
    "cooldownSeconds": 600,
}


def on_node(pods: dict[str, dict], node: str) -> list[str]:
    return sorted(name for name, pod in pods.items() if pod["spec"].get("nodeName") == node)


def test_a_drain_during_memory_restarts_never_exceeds_max_unavailable(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path, engine_url
):
    name, replicas = "drain", 4
    pods = start_standin_fleet(
        cluster, name, replicas, engine_url, test_tokenizer_dir, tmp_path, memory=MEMORY
    )
    drained = on_node(pods, GPU_NODE)
    assert len(drained) == 2, {n: p["spec"].get("nodeName") for n, p in pods.items()}  # 2 per node
    before = {n: p["metadata"]["uid"] for n, p in pods.items()}
    drain_result: dict = {}

    def drain() -> None:
        drain_result["run"] = cluster.kubectl(
            "drain",
            GPU_NODE,
            f"--pod-selector=rolloutfleet.dev/fleet={name}",
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=240s",
            check=False,
        )

    try:
        with FleetWatch(cluster, NAMESPACE, name, replicas) as watch:
            for pod in pods.values():  # every proxy over budget: the watchdog wants all four restarted
                set_rss(pod, OVER_BUDGET)
            drainer = threading.Thread(target=drain)
            drainer.start()
            drainer.join(300)
            # Then the memory restarts go on until every original proxy is replaced and Ready.
            wait_for(
                lambda: all_replaced_and_available(proxy_pods(cluster, NAMESPACE, name), before),
                timeout_s=180,
                what="every proxy replaced (drained or restarted for memory) and Ready",
                interval_s=1,
            )
    finally:
        cluster.kubectl("uncordon", GPU_NODE, check=False)
    run = drain_result["run"]
    assert run.returncode == 0, run.stdout + run.stderr
    print(f"\n[drain] {watch.events} pod events; unavailable after each: max {max(watch.unavailable)}")
    assert max(watch.unavailable) == 1, "never more than maxUnavailable (1) proxies down at once"
    now = proxy_pods(cluster, NAMESPACE, name)
    assert not on_node(now, GPU_NODE)
    restarted = get(cluster, "rf", name)["status"]["memoryRestarts"]
    # The two on the CPU node were restarted for memory; a drained one's replacement reports 50 MiB.
    assert 2 <= restarted["total"] <= replicas, restarted
    assert "MemoryRestart" in reasons(cluster, name)
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")


def test_a_proxy_whose_node_stops_is_replaced_and_memory_restarts_of_the_others_continue(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path, engine_url
):
    from rolloutfleet_testkit.node.cluster import start_kubelet, stop_kubelet

    name, timeout_s = "lost", 30
    # The node lifecycle controller evicts pods of a lost node after their toleration of its taints
    # (300 s by default): 2 s here, so the pod is deleted soon and then stuck terminating.
    lost_node_tolerations = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    pods = start_standin_fleet(
        cluster,
        name,
        2,
        engine_url,
        test_tokenizer_dir,
        tmp_path,
        memory=MEMORY,
        lostProxyTimeoutSeconds=timeout_s,
        tolerations=lost_node_tolerations,
    )
    (lost,) = on_node(pods, GPU_NODE)
    (healthy,) = on_node(pods, CPU_NODE)
    uids = {n: p["metadata"]["uid"] for n, p in pods.items()}
    try:
        stopped_at = time.monotonic()
        stop_kubelet(cluster.node_root, GPU_NODE)
        reported = wait_for(
            lambda: (c := condition(cluster, name, "ProxiesLost")).get("status") == "True" and c,
            timeout_s=180,
            what="the ProxiesLost condition",
            interval_s=1,
        )
        lost_after_s = time.monotonic() - stopped_at
        assert reported["reason"] == "NodeLost" and f"{lost} on {GPU_NODE} (NotReady" in reported["message"]
        assert "ProxyLost" in reasons(cluster, name) and "ProxyLost" in reasons(cluster, lost)
        # Over budget while the lost proxy is down: until it is force-deleted and replaced, the
        # other waits (maxUnavailable 1; the PodDisruptionBudget counts it down too).
        set_rss(pods[healthy], OVER_BUDGET)
        wait_for(
            lambda: (
                f"waiting for maxUnavailable: {healthy}"
                in condition(cluster, name, "MemoryPressure")["message"]
            ),
            timeout_s=15,
            what=f"{healthy} held for maxUnavailable",
            interval_s=0.5,
        )
        assert proxy_pods(cluster, NAMESPACE, name)[healthy]["metadata"]["uid"] == uids[healthy]
        assert condition(cluster, name, "ProxiesLost")["status"] == "True"  # not force-deleted yet
        replaced = wait_for(
            lambda: (
                (pod := proxy_pods(cluster, NAMESPACE, name).get(lost))
                and pod["metadata"]["uid"] != uids[lost]
                and available(pod)
                and pod
            ),
            timeout_s=timeout_s + 60,
            what=f"{lost} force-deleted and replaced",
            interval_s=0.5,
        )
        replaced_after_s = time.monotonic() - stopped_at
        assert replaced["spec"]["nodeName"] == CPU_NODE
        assert "ForceDeleted" in reasons(cluster, name)
        # Then the memory restart of the healthy proxy goes on.
        wait_for(
            lambda: (
                (pod := proxy_pods(cluster, NAMESPACE, name).get(healthy))
                and pod["metadata"]["uid"] != uids[healthy]
                and available(pod)
            ),
            timeout_s=60,
            what=f"{healthy} restarted for memory",
            interval_s=0.5,
        )
        status = get(cluster, "rf", name)["status"]
        assert status["memoryRestarts"]["lastPod"] == healthy
        assert condition(cluster, name, "ProxiesLost")["status"] == "False"
        print(
            f"\n[lost] node stopped -> ProxiesLost {lost_after_s:.0f}s -> replacement Ready "
            f"{replaced_after_s:.0f}s (lostProxyTimeoutSeconds {timeout_s})"
        )
    finally:
        start_kubelet(cluster.node_root, GPU_NODE)
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")
