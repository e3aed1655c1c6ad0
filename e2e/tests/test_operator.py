"""The operator, installed with its Helm chart and running as a pod, against the local cluster (real
kubelets): a RolloutFleet becomes proxies, a gateway and engines; status follows Kubernetes
conventions; sessions flow through a proxy to an engine and survive the proxy's replacement; a spec
change rolls the proxies one at a time; scale works both ways (highest ordinals go first); deleting
the fleet garbage-collects everything; an operator killed mid-reconcile converges without
duplicates. Engines are SGLang emulators (test stand-ins for SGLang): the GPU sample's engine
pods on the GPU node, or one served on this machine as an external engine URL."""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from operator_install import installed_operator
from rolloutfleet_operator.plan import is_ready
from rolloutfleet_proxy.settings import ENV
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.controlplane import audit
from rolloutfleet_testkit.demo import QUESTIONS, run_session
from rolloutfleet_testkit.fleet_setup import condition, create_session, one_turn, session_tokens
from rolloutfleet_testkit.processes import serve_app, wait_until_routed
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e
RELEASE = "rf"


@dataclass
class Operator:
    namespace: str
    deployment: str


@pytest.fixture(scope="module")
def operator(cluster):
    """The operator installed by its chart, watching one namespace."""
    with installed_operator(cluster, "operator-e2e", RELEASE) as deployment:
        yield Operator("operator-e2e", deployment)


def get(cluster, namespace: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout)


def proxy_pods(cluster, namespace: str) -> list[str]:
    items = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/component=proxy")["items"]
    return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))


def pod_uid(cluster, namespace: str, name: str) -> str | None:
    result = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout)["metadata"]["uid"] if result.returncode == 0 else None


def test_fleet_lifecycle(cluster, operator, test_tokenizer_dir):
    namespace = operator.namespace
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=0), host=cluster.host_ip) as engine_url:
        fleet = fleet_setup.external_fleet("f1", namespace, test_tokenizer_dir, engine_url, replicas=2)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))

        def ready(replicas: int):
            status = get(cluster, namespace, "rf", "f1").get("status", {})
            ok = status.get("readyReplicas") == replicas and condition(status, "Ready") == "True"
            return ok and status

        status = wait_for(
            lambda: ready(2), timeout_s=120, what="the fleet to be Ready with 2 proxies", interval_s=1
        )
        assert status["observedGeneration"] == 1 and condition(status, "GatewayReady") == "True"
        assert status["selector"] and len(status["proxyEndpoints"]) == 2
        assert proxy_pods(cluster, namespace) == ["f1-proxy-0", "f1-proxy-1"]
        for kind in ("pods", "deployments", "services"):
            for item in get(cluster, namespace, kind, "-l", "app.kubernetes.io/instance=f1")["items"]:
                owners = item["metadata"].get("ownerReferences", [])
                if kind != "pods" or item["metadata"]["name"].startswith("f1-proxy"):
                    assert any(o["kind"] in ("RolloutFleet", "ReplicaSet") for o in owners), item["metadata"][
                        "name"
                    ]

        cluster.kubectl("scale", "rf/f1", "-n", namespace, "--replicas=3")
        wait_for(lambda: ready(3), timeout_s=120, what="scale up to 3", interval_s=1)
        cluster.kubectl("scale", "rf/f1", "-n", namespace, "--replicas=1")
        wait_for(
            lambda: proxy_pods(cluster, namespace) == ["f1-proxy-0"],
            timeout_s=120,
            what="scale down removing the highest ordinals",
            interval_s=1,
        )

        uid = get(cluster, namespace, "pod", "f1-proxy-0")["metadata"]["uid"]
        cluster.kubectl("delete", "pod", "f1-proxy-0", "-n", namespace, "--wait=false")
        wait_for(
            lambda: pod_uid(cluster, namespace, "f1-proxy-0") not in (None, uid) and ready(1),
            timeout_s=120,
            what="the deleted proxy to come back under its name",
            interval_s=1,
        )

        cluster.kubectl("delete", "rf", "f1", "-n", namespace)
        wait_for(
            lambda: (
                not get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=f1")["items"]
                and not get(cluster, namespace, "deployments", "-l", "app.kubernetes.io/instance=f1")["items"]
            ),
            timeout_s=120,
            what="garbage collection of the fleet's children",
            interval_s=1,
        )
    assert operator_restarts(cluster, operator) == 0


RESYNC_S = 10  # the operator's periodic pass (main.RESYNC_SECONDS)


def operator_requests(cluster, operator: Operator, since: datetime.datetime, until: datetime.datetime):
    """What the operator's ServiceAccount asked of the API server in [since, until), from its audit
    log, leader election left out."""
    user = f"system:serviceaccount:{operator.namespace}:{operator.deployment}"
    return [r for r in audit.requests_of(cluster.audit_log, user, since, until) if audit.LEASES not in r.uri]


def summary(requests) -> str:
    return ", ".join(
        f"{n} {what}" for what, n in Counter(f"{r.verb} {r.uri.split('?')[0]}" for r in requests).items()
    )


@pytest.mark.local_cluster(reason="counts requests in the local API server's audit log")
def test_a_fleet_at_rest_costs_at_most_two_requests_per_resync_and_no_write(
    cluster, operator, test_tokenizer_dir
):
    """Counted at the API server (its audit log): once a fleet is Ready and its status settled,
    a minute of resyncs and memory checks reads from the watch caches and writes nothing. Then a
    roll of its two proxies, counted the same way."""
    namespace = operator.namespace
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=0), host=cluster.host_ip) as engine_url:
        fleet = fleet_setup.external_fleet("quiet", namespace, test_tokenizer_dir, engine_url, replicas=2)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(
            lambda: fleet_ready(cluster, namespace, "quiet", 2),
            timeout_s=120,
            what="the fleet Ready with 2 proxies",
            interval_s=1,
        )
        time.sleep(2 * RESYNC_S)  # the passes and memory checks that follow readiness settle the status
        window_s = 60
        since = now()
        time.sleep(window_s)
        at_rest = operator_requests(cluster, operator, since, now())
        per_resync = len(at_rest) / (window_s / RESYNC_S)
        print(f"[api-load] at rest, 1 fleet: {len(at_rest)} requests in {window_s} s ({summary(at_rest)})")
        assert not [r for r in at_rest if r.write], summary(at_rest)
        assert per_resync <= 2, summary(at_rest)

        since = now()
        cluster.kubectl(
            "patch", "rf", "quiet", "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"proxy": {"staleSessionTimeoutSeconds": 901}}}),
        )  # fmt: skip
        wait_for(
            lambda: (
                (status := get(cluster, namespace, "rf", "quiet").get("status", {})).get("updatedReplicas")
                == 2
                and fleet_setup.fleet_ready(status, 2)
            ),
            timeout_s=180,
            what="the roll of both proxies",
            interval_s=1,
        )
        rolled = now()
        during_roll = operator_requests(cluster, operator, since, rolled)
        seconds = (rolled - since).total_seconds()
        print(
            f"[api-load] roll of 2 proxies, 1 fleet: {len(during_roll)} requests in {seconds:.0f} s,"
            f" {sum(r.write for r in during_roll)} writes ({summary(during_roll)})"
        )
        cluster.kubectl("delete", "rf", "quiet", "-n", namespace)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def operator_pods(cluster, operator: Operator) -> list[dict]:
    pods = get(cluster, operator.namespace, "pods", "-l", "app.kubernetes.io/name=rolloutfleet-operator")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def operator_restarts(cluster, operator: Operator) -> int:
    return sum(
        c.get("restartCount", 0)
        for pod in operator_pods(cluster, operator)
        for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def fleet_ready(cluster, namespace: str, name: str, replicas: int) -> dict | bool:
    status = get(cluster, namespace, "rf", name).get("status", {})
    return fleet_setup.fleet_ready(status, replicas) and status


def proxy_urls(cluster, namespace: str, fleet: str) -> dict[str, str]:
    pods = get(cluster, namespace, "pods", "-l", fleet_setup.component_selector(fleet, "proxy"))
    return fleet_setup.pod_urls(pods, fleet_setup.PROXY_PORT)


def proxy_states(cluster, namespace: str, fleet: str) -> list[tuple[str, bool, bool, str]]:
    """(name, ready, terminating, template hash) of each proxy pod."""
    pods = get(cluster, namespace, "pods", "-l", fleet_setup.component_selector(fleet, "proxy"))
    states = []
    for pod in pods["items"]:
        ready = is_ready(pod)
        annotations = pod["metadata"].get("annotations") or {}
        states.append(
            (
                pod["metadata"]["name"],
                ready,
                bool(pod["metadata"].get("deletionTimestamp")),
                annotations.get("rolloutfleet.dev/template-hash", ""),
            )
        )
    return sorted(states)


def test_sample_fleet_serves_restores_and_rolls_one_at_a_time(
    cluster, operator, test_tokenizer_dir, tmp_path
):
    namespace = operator.namespace
    weights = fleet_setup.pod_writable(tmp_path / "weights")
    fleet = fleet_setup.local_fleet(
        "gpu", namespace, test_tokenizer_dir, fleet_setup.pod_writable(tmp_path / "dumps"), proxies=2,
        engines=1, engine_token_delay_s=0.02,  # generations stay in flight while the trainer updates weights
        weights_dir=weights,
    )  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
    status = wait_for(
        lambda: fleet_ready(cluster, namespace, "gpu", 2),
        timeout_s=300,
        what="the GPU sample fleet Ready",
        interval_s=1,
    )
    assert condition(status, "EnginesReady") == "True" and condition(status, "GatewayReady") == "True"
    assert status["gatewayUrl"] == f"http://gpu-gateway.{namespace}.svc:30080"

    # Engines on the GPU node with their GPUs; the router found them through the Kubernetes API.
    engines = get(cluster, namespace, "pods", "-l", fleet_setup.component_selector("gpu", "engine"))
    (engine,) = engines["items"]
    assert engine["spec"]["nodeName"] in cluster.node_names(gpu=True)
    assert engine["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    gateway = get(cluster, namespace, "pods", "-l", fleet_setup.component_selector("gpu", "gateway"))
    wait_until_routed(fleet_setup.pod_urls(gateway, fleet_setup.GATEWAY_PORT).popitem()[1])

    # A session through a proxy reaches the engine (by the gateway's Service name) and is recorded.
    key = fleet_setup.admin_key(get(cluster, namespace, "secret", "gpu-admin-key"))
    urls = proxy_urls(cluster, namespace, "gpu")
    summary = asyncio.run(run_session(urls["gpu-proxy-0"], QUESTIONS[0], 0, admin_key=key))
    trajectory = summary["trajectory"]
    assert summary["num_turns"] == len(QUESTIONS[0]) and sum(trajectory["loss_mask"]) > 0
    assert len(trajectory["logprobs"]) == len(trajectory["input_ids"]) == summary["num_tokens"]

    # The trainer updates the engine's weights in the middle of a rollout, through the endpoints the
    # fleet publishes: once in abort mode (cut generations are continued, tokens kept), once in place.
    update_weights_mid_rollout(cluster, namespace, status, urls, key, engine, weights)

    # The settings the operator injected are the ones the proxy runs with.
    pod = get(cluster, namespace, "pod", "gpu-proxy-1")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["ROLLOUTFLEET_PROXY_DUMP_DIR"] == "/var/lib/rolloutfleet/dumps/gpu-proxy-1"
    assert env["ROLLOUTFLEET_PROXY_UPSTREAM_URL"] == status["gatewayUrl"]
    reported = httpx.get(
        f"{urls['gpu-proxy-1']}/v1/settings", headers={"Authorization": f"Bearer {key}"}
    ).json()
    field_of = {name: field for field, name in ENV.items()}
    injected = {n: v for n, v in env.items() if n in field_of and v is not None}
    assert {"ROLLOUTFLEET_PROXY_MAX_STALENESS", "ROLLOUTFLEET_PROXY_STALENESS_BATCH_SHARE"} <= set(injected)
    for name, value in injected.items():
        actual = reported[field_of[name]]
        if isinstance(actual, dict | list):  # JSON settings (chat_template_kwargs): JSON in, JSON out
            same = json.loads(value) == actual
        elif isinstance(actual, int | float):
            same = float(actual) == float(value)
        else:
            same = str(actual) == value
        assert same, f"{name}={value!r} injected, the proxy runs with {actual!r}"

    # A live session on proxy-1 survives the pod's deletion: the replacement restores it.
    sid, session_key = create_session(urls["gpu-proxy-1"], key)
    messages = [{"role": "user", "content": "hello there"}]
    messages.append(
        {"role": "assistant", "content": one_turn(urls["gpu-proxy-1"], sid, session_key, messages)}
    )
    before = session_tokens(urls["gpu-proxy-1"], sid, session_key)
    uid = pod["metadata"]["uid"]
    cluster.kubectl("delete", "pod", "gpu-proxy-1", "-n", namespace, "--wait=false")
    wait_for(
        lambda: (
            pod_uid(cluster, namespace, "gpu-proxy-1") not in (None, uid)
            and fleet_ready(cluster, namespace, "gpu", 2)
        ),
        timeout_s=180,
        what="gpu-proxy-1 to come back under its name",
        interval_s=1,
    )
    url = proxy_urls(cluster, namespace, "gpu")["gpu-proxy-1"]
    assert session_tokens(url, sid, session_key)["trajectory"] == before["trajectory"]
    messages.append({"role": "user", "content": "and again"})
    one_turn(url, sid, session_key, messages)
    assert session_tokens(url, sid, session_key)["num_turns"] == before["num_turns"] + 1

    # A spec change rolls the proxies one at a time; the session survives the roll as well.
    old_hash = {state[3] for state in proxy_states(cluster, namespace, "gpu")}
    samples: list[list[tuple[str, bool, bool, str]]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            samples.append(proxy_states(cluster, namespace, "gpu"))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cluster.kubectl(
        "patch", "rf", "gpu", "-n", namespace, "--type=merge", "-p",
        json.dumps({"spec": {"proxy": {"staleSessionTimeoutSeconds": 900}}}),
    )  # fmt: skip
    try:
        wait_for(
            lambda: (
                (states := proxy_states(cluster, namespace, "gpu"))
                and len(states) == 2
                and all(s[1] and not s[2] and s[3] not in old_hash for s in states)
                and fleet_ready(cluster, namespace, "gpu", 2)
            ),
            timeout_s=240,
            what="both proxies rolled to the new template",
            interval_s=1,
        )
    finally:
        stop.set()
        watcher.join()
    unavailable = [
        sum(
            1
            for ordinal in (0, 1)
            if not any(s[0] == f"gpu-proxy-{ordinal}" and s[1] and not s[2] for s in sample)
        )
        for sample in samples
    ]
    assert max(unavailable) == 1, "the roll should replace one proxy at a time"
    assert unavailable.count(0) < len(unavailable)
    url = proxy_urls(cluster, namespace, "gpu")["gpu-proxy-1"]
    assert session_tokens(url, sid, session_key)["num_turns"] == before["num_turns"] + 1

    cluster.kubectl("delete", "rf", "gpu", "-n", namespace)
    wait_for(
        lambda: not get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=gpu")["items"],
        timeout_s=120,
        what="the GPU fleet's pods to be garbage-collected",
        interval_s=1,
    )


def test_operator_killed_mid_reconcile_converges_without_duplicates(cluster, operator, test_tokenizer_dir):
    namespace = operator.namespace
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=0), host=cluster.host_ip) as engine_url:
        fleet = fleet_setup.external_fleet("k1", namespace, test_tokenizer_dir, engine_url, replicas=3)
        (old,) = operator_pods(cluster, operator)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(
            lambda: get(cluster, namespace, "all", "-l", "app.kubernetes.io/instance=k1")["items"],
            timeout_s=60,
            what="the operator to start creating k1's children",
            interval_s=0.1,
        )
        cluster.kubectl(
            "delete", "pod", old["metadata"]["name"], "-n", namespace, "--force", "--grace-period=0"
        )
        wait_for(
            lambda: fleet_ready(cluster, namespace, "k1", 3),
            timeout_s=180,
            what="k1 Ready after the kill",
            interval_s=1,
        )
        (new,) = operator_pods(cluster, operator)
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        names = [s[0] for s in proxy_states(cluster, namespace, "k1")]
        assert names == ["k1-proxy-0", "k1-proxy-1", "k1-proxy-2"]
        for kind, expected in (("deployments", 1), ("services", 3), ("secrets", 1), ("serviceaccounts", 1)):
            items = get(cluster, namespace, kind, "-l", "app.kubernetes.io/instance=k1")["items"]
            assert len(items) == expected, (kind, [i["metadata"]["name"] for i in items])
        # Converged means quiet: another pass changes nothing (the fleet's resourceVersion holds).
        version = get(cluster, namespace, "rf", "k1")["metadata"]["resourceVersion"]
        time.sleep(12)  # longer than the operator's periodic pass
        assert get(cluster, namespace, "rf", "k1")["metadata"]["resourceVersion"] == version

        # No finalizer: a fleet goes even while the operator is down; its children follow it.
        assert not get(cluster, namespace, "rf", "k1")["metadata"].get("finalizers")
        cluster.kubectl("scale", "deployment", operator.deployment, "-n", namespace, "--replicas=0")
        wait_for(lambda: not operator_pods(cluster, operator), timeout_s=60, what="the operator to stop")
        cluster.kubectl("delete", "rf", "k1", "-n", namespace, "--timeout=30s")
        wait_for(
            lambda: not get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=k1")["items"],
            timeout_s=120,
            what="k1's pods garbage-collected without the operator",
            interval_s=1,
        )
        cluster.kubectl("scale", "deployment", operator.deployment, "-n", namespace, "--replicas=1")


def update_weights_mid_rollout(cluster, namespace, status, urls, key, engine, weights: Path) -> None:
    """Weights are written on this machine into `weights`, which the engine mounts (WEIGHTS_MOUNT)."""
    from rolloutfleet_client.trainer import TrainerClient
    from rolloutfleet_testkit.sglang_emulator.server import write_weights

    engine_url = f"http://{engine['status']['podIP']}:30000"
    assert status["engineEndpoints"] == [engine_url]
    env = {e["name"]: e.get("value") for e in engine["spec"]["containers"][0]["env"]}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # probes hold through updates
    errors: list[str] = []
    sessions = [(url, *create_session(url, key)) for url in urls.values() for _ in range(3)]

    def play(url: str, sid: str, session_key: str) -> None:
        messages: list[dict] = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn}: tell me more"})
            try:
                messages.append({"role": "assistant", "content": one_turn(url, sid, session_key, messages)})
            except Exception as exc:  # recorded, asserted below
                errors.append(f"{sid}: {exc}")
                return

    threads = [threading.Thread(target=play, args=session) for session in sessions]
    for thread in threads:
        thread.start()
    with TrainerClient(list(urls.values()), key, engine_urls=status["engineEndpoints"]) as trainer:
        for version, mode in ((1, "abort"), (2, "in_place")):
            write_weights(weights / f"v{version}", seed=100 + version)
            wait_for(
                lambda: sum(httpx.get(f"{u}/stats").json()["inflight_turns"] for u in urls.values()) >= 2,
                timeout_s=30,
                what="turns generating",
                interval_s=0.05,
            )
            trainer.update_weights(version, model_path=f"{fleet_setup.WEIGHTS_MOUNT}/v{version}", mode=mode)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    discarded = sum(
        httpx.get(f"{u}/stats").json()["totals"]["generated_tokens_discarded"] for u in urls.values()
    )
    assert discarded == 0
    for url, sid, session_key in sessions:
        trajectory = session_tokens(url, sid, session_key)["trajectory"]
        assert len(trajectory["turns"]) == 3, "every turn recorded once"
        for _, output_start, end in trajectory["turns"]:
            versions = trajectory["versions"][output_start:end]
            assert versions == sorted(versions) and set(versions) <= {0, 1, 2}, versions
    assert httpx.get(f"{engine_url}/get_weight_version").json() == {"weight_version": "2"}


def test_a_fleet_with_a_missing_claim_says_so_in_its_conditions_within_one_pass(
    cluster, operator, test_tokenizer_dir
):
    """The scheduler refuses a pod whose claim does not exist (PodScheduled False, Unschedulable:
    `persistentvolumeclaim "x" not found`); the pass that pod event runs at once (not the next 10 s
    resync) names the claim and the pod in ReplicaFailure and Ready, and Available is False."""
    namespace = operator.namespace
    claim = {"persistentVolumeClaim": {"claimName": "no-such-claim"}}
    fleet = fleet_setup.external_fleet(
        "claimless", namespace, test_tokenizer_dir, f"http://{cluster.host_ip}:9", replicas=1, dump=claim
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
    try:

        def failure():
            status = get(cluster, namespace, "rf", "claimless").get("status", {})
            found = {c["type"]: c for c in status.get("conditions", [])}
            return found if found.get("ReplicaFailure", {}).get("reason") == "ClaimNotFound" else None

        # The pod is refused within a second or two; the pass after that reports it.
        conditions = wait_for(
            failure, timeout_s=25, what="ReplicaFailure to name the missing claim", interval_s=1
        )
        message = conditions["ReplicaFailure"]["message"]
        assert "claimless-proxy-0" in message and 'persistentvolumeclaim "no-such-claim" not found' in message
        assert conditions["Ready"]["status"] == "False" and "no-such-claim" in conditions["Ready"]["message"]
        assert (conditions["Available"]["status"], conditions["Available"]["reason"]) == (
            "False",
            "ProxiesUnavailable",
        )
        listing = cluster.kubectl("get", "rf", "claimless", "-n", namespace).stdout
        assert "0/1" in listing.splitlines()[1]  # the Ready printer column
    finally:
        cluster.kubectl("delete", "rf", "claimless", "-n", namespace, "--wait=false", check=False)
