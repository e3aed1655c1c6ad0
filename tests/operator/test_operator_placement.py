"""Placement, identity, security and disruption budgets of the fleet's children (#15): what the spec
says reaches the right pod templates, the defaults are the documented ones, and the operator's own
labels and settings cannot be overridden by them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from rolloutfleet_operator import main as operator_main
from rolloutfleet_operator import manifests
from rolloutfleet_operator.fleet import (
    CLIENT_LABEL,
    GATEWAY_IMAGE_ENV,
    NETWORK_POLICY_ENV,
    PROXY_IMAGE_ENV,
    NetworkPolicySpec,
    OperatorDefaults,
    labels,
    parse_fleet,
)
from rolloutfleet_operator.watch_cache import CACHED_KINDS

SAMPLES = Path(__file__).resolve().parents[2] / "operator" / "samples"
PLACEMENT = {
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
    "priorityClassName": "rollouts-high",
    "imagePullSecrets": [{"name": "registry"}],
    "podLabels": {"kueue.x-k8s.io/queue-name": "rl", "cost-center": "42"},
    "podAnnotations": {"example.com/owner": "rl-team"},
}
IMAGES = OperatorDefaults(
    proxy_image="reg.example/rolloutfleet-proxy:1.2.3", gateway_image="reg.example/router:0.3.2"
)


def gpu_sample() -> dict[str, Any]:
    obj = yaml.safe_load((SAMPLES / "gpu.yaml").read_text())
    obj["metadata"].update({"namespace": "rl", "uid": "uid-1", "generation": 1})
    return obj


def fleet_with(component: str, **fields: Any):
    obj = gpu_sample()
    obj["spec"].setdefault(component, {}).update(copy.deepcopy(fields))
    return parse_fleet(obj, IMAGES)


def pod_template(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, spec) of a Pod or of a Deployment's pod template."""
    if manifest["kind"] == "Pod":
        return manifest["metadata"], manifest["spec"]
    template = manifest["spec"]["template"]
    return template["metadata"], template["spec"]


BUILDERS = {
    "proxy": lambda fleet: manifests.proxy_pod(fleet, 0),
    "gateway": manifests.gateway_deployment,
    "engines": manifests.engine_deployment,
}
COMPONENT = {"proxy": "proxy", "gateway": "gateway", "engines": "engine"}


@pytest.mark.parametrize("component", BUILDERS)
def test_placement_reaches_the_pods_of_every_component(component):
    fleet = fleet_with(component, **PLACEMENT)
    metadata, spec = pod_template(BUILDERS[component](fleet))
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == PLACEMENT["tolerations"]
    assert spec["affinity"] == PLACEMENT["affinity"]
    assert spec["priorityClassName"] == "rollouts-high"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    # Extra labels reach the pods beside the operator's own, which the selectors need intact.
    own = labels(fleet, COMPONENT[component])
    assert {**PLACEMENT["podLabels"], **own}.items() <= metadata["labels"].items()
    assert metadata["annotations"]["example.com/owner"] == "rl-team"


@pytest.mark.parametrize("component", BUILDERS)
def test_the_operators_labels_win_over_pod_labels(component):
    # The CRD refuses these keys (CEL); a stored object from before that rule still cannot break selectors.
    fleet = fleet_with(
        component, podLabels={"app.kubernetes.io/component": "x", "rolloutfleet.dev/fleet": "y"}
    )
    metadata, _ = pod_template(BUILDERS[component](fleet))
    assert {k: metadata["labels"][k] for k in labels(fleet, COMPONENT[component])} == labels(
        fleet, COMPONENT[component]
    )


def test_proxies_spread_softly_over_nodes_unless_the_spec_says_how():
    fleet = parse_fleet(gpu_sample(), IMAGES)
    _, spec = pod_template(manifests.proxy_pod(fleet, 0))
    assert spec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": labels(fleet, "proxy")},
        }
    ]
    zones = [
        {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    _, spec = pod_template(manifests.proxy_pod(fleet_with("proxy", topologySpreadConstraints=zones), 0))
    assert spec["topologySpreadConstraints"] == zones
    # Engines pack GPUs: no default spread.
    _, spec = pod_template(manifests.engine_deployment(fleet))
    assert "topologySpreadConstraints" not in spec


def test_placement_and_pod_annotations_roll_the_proxies_and_replicas_do_not():
    base = parse_fleet(gpu_sample(), IMAGES)
    rolled = [
        fleet_with("proxy", podAnnotations={"a": "b"}),
        fleet_with("proxy", priorityClassName="p"),
        fleet_with("proxy", affinity=PLACEMENT["affinity"]),
        fleet_with("proxy", serviceAccountName="dumps-writer"),
    ]
    for fleet in rolled:
        assert manifests.template_hash(fleet) != manifests.template_hash(base)
    assert manifests.template_hash(fleet_with("proxy", replicas=9)) == manifests.template_hash(base)
    annotations = manifests.proxy_pod(rolled[0], 0)["metadata"]["annotations"]
    assert annotations["a"] == "b" and annotations[manifests.TEMPLATE_HASH_ANNOTATION]


def test_proxy_identity_and_env_from():
    env_from = [{"secretRef": {"name": "s3-credentials"}}]
    pod = manifests.proxy_pod(fleet_with("proxy", serviceAccountName="dumps-writer", envFrom=env_from), 0)
    assert pod["spec"]["serviceAccountName"] == "dumps-writer"
    assert pod["spec"]["automountServiceAccountToken"] is False  # the proxy never calls the API
    assert pod["spec"]["containers"][0]["envFrom"] == env_from


def test_the_gateway_is_restricted_unless_the_spec_overrides_it():
    obj = gpu_sample()
    obj["spec"]["gateway"].pop("image", None)
    fleet = parse_fleet(obj, IMAGES)
    _, spec = pod_template(manifests.gateway_deployment(fleet))
    assert spec["securityContext"] == manifests.RESTRICTED_POD
    assert spec["containers"][0]["securityContext"] == manifests.RESTRICTED_CONTAINER
    assert spec["containers"][0]["image"] == "reg.example/router:0.3.2"
    own = {"runAsUser": 0}
    _, spec = pod_template(manifests.gateway_deployment(fleet_with("gateway", securityContext=own)))
    assert spec["containers"][0]["securityContext"] == own and "securityContext" not in spec


def test_engines_take_env_runtime_class_shm_size_and_security_context():
    secret_env = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    override = {"name": manifests.HEALTH_GENERATION_ENV, "value": "1"}
    fleet = fleet_with(
        "engines",
        env=[secret_env, override],
        envFrom=[{"configMapRef": {"name": "nccl"}}],
        runtimeClassName="nvidia",
        serviceAccountName="weights-reader",
        shmSize="16Gi",
        podSecurityContext={"fsGroup": 1000},
    )
    _, spec = pod_template(manifests.engine_deployment(fleet))
    (container,) = spec["containers"]
    assert [e for e in container["env"] if e["name"] == manifests.HEALTH_GENERATION_ENV] == [override]
    assert secret_env in container["env"] and container["envFrom"] == [{"configMapRef": {"name": "nccl"}}]
    assert spec["runtimeClassName"] == "nvidia" and spec["serviceAccountName"] == "weights-reader"
    assert spec["securityContext"] == {"fsGroup": 1000}
    shm = next(v for v in spec["volumes"] if v["name"] == manifests.SHM_VOLUME)
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert container["securityContext"] == manifests.ENGINE_CONTAINER_DEFAULT
    _, spec = pod_template(
        manifests.engine_deployment(fleet_with("engines", securityContext={"privileged": True}))
    )
    assert spec["containers"][0]["securityContext"] == {"privileged": True}


def test_disruption_budgets_for_proxies_and_engines():
    fleet = fleet_with("engines", maxUnavailable=0)
    budgets = {
        c["metadata"]["name"]: c
        for c in manifests.desired_children(fleet)
        if c["kind"] == "PodDisruptionBudget"
    }
    assert budgets["gpu-fleet-proxy"]["spec"] == {
        "maxUnavailable": fleet.proxy.memory.max_unavailable,
        "selector": {"matchLabels": labels(fleet, "proxy")},
    }
    assert budgets["gpu-fleet-engine"]["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": labels(fleet, "engine")},
    }


def test_default_images_come_from_the_operators_environment():
    env = {PROXY_IMAGE_ENV: "r.example/rolloutfleet-proxy:2.0.0", GATEWAY_IMAGE_ENV: "r.example/router:9"}
    assert OperatorDefaults.from_environment(env, "2.0.0") == OperatorDefaults(
        "r.example/rolloutfleet-proxy:2.0.0", "r.example/router:9"
    )
    assert OperatorDefaults.from_environment({}, "2.0.0") == OperatorDefaults(
        "rolloutfleet-proxy:2.0.0", "rolloutfleet-sglang-router:0.3.2"
    )
    obj = gpu_sample()
    obj["spec"]["proxy"]["image"] = "mine:1"
    assert parse_fleet(obj, IMAGES).proxy.image == "mine:1"


@pytest.mark.parametrize("length", [53, 54])
def test_fleet_names_too_long_for_their_children_are_refused(length):
    obj = gpu_sample()
    obj["metadata"]["name"] = "f" * length
    if length > 53:
        with pytest.raises(ValueError, match="at most 53"):
            parse_fleet(obj, IMAGES)
        return
    fleet = parse_fleet(obj, IMAGES)
    names = [c["metadata"]["name"] for c in manifests.desired_children(fleet)]
    names.append(manifests.proxy_pod(fleet, 999)["metadata"]["name"])
    assert max(len(n) for n in names) == 63


async def test_the_operator_watches_only_the_objects_it_manages():
    """Every cached kind's watch carries a label selector, so the API server sends only the
    operator's own pods and children (kopf's handler filter alone would still stream every pod and
    Service of the cluster to the operator); fleets are watched whole."""
    settings = kopf.OperatorSettings()
    operator_main.select_owned_objects(settings)
    fleets = kopf.Resource(
        group="rolloutfleet.dev", version="v1alpha1", plural="rolloutfleets", namespaced=True
    )
    for kind in CACHED_KINDS:
        group, version, plural = operator_main._resource(kind)
        resource = kopf.Resource(group=group, version=version, plural=plural, kind=kind[1], namespaced=True)
        selector = ",".join(settings.watching.label_selectors.collect(resource))
        assert selector == "app.kubernetes.io/managed-by=rolloutfleet-operator", kind
    assert list(settings.watching.label_selectors.collect(fleets)) == []


POLICY_JSON = json.dumps(
    {
        "operatorNamespace": "rolloutfleet-system",
        "clientNamespaces": {"matchLabels": {"team": "rl"}},
        "scrapeNamespaces": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    }
)


def test_network_policy_settings_come_from_the_operators_environment():
    defaults = OperatorDefaults.from_environment({NETWORK_POLICY_ENV: POLICY_JSON}, "1.0.0")
    policy = defaults.network_policy
    assert policy == NetworkPolicySpec(
        clients={"matchLabels": {CLIENT_LABEL: "true"}},  # the default client label
        client_namespaces={"matchLabels": {"team": "rl"}},
        operator_namespace="rolloutfleet-system",
        scrapers={"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    )
    assert OperatorDefaults.from_environment({}, "1.0.0").network_policy is None
    with pytest.raises(ValueError, match="operatorNamespace"):
        NetworkPolicySpec.parse("{}")


def test_network_policies_let_in_only_who_needs_each_component():
    defaults = OperatorDefaults.from_environment({NETWORK_POLICY_ENV: POLICY_JSON}, "1.0.0")
    fleet = parse_fleet(gpu_sample(), defaults)
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in manifests.desired_children(fleet)
        if p["kind"] == "NetworkPolicy"
    }
    assert set(policies) == {"gpu-fleet-proxy", "gpu-fleet-gateway", "gpu-fleet-engine"}
    assert manifests.unwanted_children(fleet) == []
    for name, component in (("proxy", "proxy"), ("gateway", "gateway"), ("engine", "engine")):
        spec = policies[f"gpu-fleet-{name}"]
        assert spec["podSelector"] == {"matchLabels": labels(fleet, component)} and spec["policyTypes"] == [
            "Ingress"
        ]
    clients = {
        "podSelector": {"matchLabels": {CLIENT_LABEL: "true"}},
        "namespaceSelector": {"matchLabels": {"team": "rl"}},
    }
    scrapers = {
        "podSelector": {},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    }
    operator = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rolloutfleet-operator"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rolloutfleet-system"}},
    }
    assert policies["gpu-fleet-proxy"]["ingress"] == [
        {"from": [clients, operator, scrapers], "ports": [{"protocol": "TCP", "port": 8000}]}
    ]
    assert policies["gpu-fleet-gateway"]["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": labels(fleet, "proxy")}}],
            "ports": [{"protocol": "TCP", "port": 30080}],
        },
        {"from": [scrapers], "ports": [{"protocol": "TCP", "port": 29000}]},
    ]
    engine_rules = policies["gpu-fleet-engine"]["ingress"]
    assert engine_rules[0] == {
        "from": [{"podSelector": {"matchLabels": labels(fleet, "gateway")}}],
        "ports": [{"protocol": "TCP", "port": 30000}],
    }
    assert engine_rules[1] == {"from": [clients]}  # trainers: pause, weight updates, NCCL on any port
    # External engines: no engine policy, and an earlier one is unwanted.
    obj = gpu_sample()
    del obj["spec"]["engines"]
    obj["spec"]["externalEngineUrls"] = ["http://e:1"]
    external = parse_fleet(obj, defaults)
    assert ("networking.k8s.io/v1", "NetworkPolicy", "gpu-fleet-engine") in manifests.unwanted_children(
        external
    )


def test_the_default_router_image_carries_the_router_release_the_tests_run():
    """One release of sglang-router: the one pyproject.toml pins (the tests run it), the one
    images/sglang-router installs, and the tag of the operator's default gateway image."""
    from rolloutfleet_operator.fleet import SGLANG_ROUTER_VERSION
    from rolloutfleet_testkit.images.catalog import dockerfile_images, pinned_version

    assert pinned_version("sglang-router") == SGLANG_ROUTER_VERSION
    dockerfile, names = dockerfile_images()["sglang-router"]
    assert f"sglang-router=={SGLANG_ROUTER_VERSION}" in dockerfile.read_text()
    assert names == [OperatorDefaults.from_environment({}, "1.0.0").gateway_image]
