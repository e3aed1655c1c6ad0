"""The SGLang gateway (manifests/gateway.py): the router's Deployment discovers exactly the fleet's
engines (or takes the external URLs), its RBAC reads pods only, its Service, its security context."""

from __future__ import annotations

import pytest
from fleet_samples import (
    ENGINE,
    GATEWAY,
    GPU,
    IMAGES,
    container,
    env_map,
    flag,
    fleet_with,
    gpu_sample,
    mutated,
    pod_spec,
    pod_template,
    sample,
)
from rolloutfleet_operator.fleet import labels, operator_defaults, parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.gateway import (
    gateway_deployment,
    gateway_role,
    gateway_role_binding,
    gateway_service,
    gateway_service_account,
)
from rolloutfleet_operator.manifests.pods import RESTRICTED_CONTAINER, RESTRICTED_POD
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_proxy.settings import ENV

GPU_ROWS = [
    (
        "gateway image (the operator's default)",
        container(GATEWAY)["image"],
        operator_defaults().gateway_image,
    ),
    ("gateway replicas", GATEWAY["spec"]["replicas"], 1),
    ("gateway policy", flag(container(GATEWAY)["args"], "--policy"), "manual"),
    ("gateway port", flag(container(GATEWAY)["args"], "--port"), "30080"),
    ("gateway metrics", flag(container(GATEWAY)["args"], "--prometheus-port"), "29000"),
    ("gateway resources", container(GATEWAY)["resources"], {"requests": {"cpu": "1", "memory": "1Gi"}}),
    ("gateway account", pod_spec(GATEWAY)["serviceAccountName"], "gpu-fleet-gateway"),
    (
        "gateway readiness",
        container(GATEWAY)["readinessProbe"]["httpGet"],
        {"path": "/readiness", "port": 30080},  # 503 while no worker is healthy
    ),
    ("gateway liveness", container(GATEWAY)["livenessProbe"]["httpGet"], {"path": "/health", "port": 30080}),
    ("gateway discovery port", flag(container(GATEWAY)["args"], "--service-discovery-port"), "30000"),
    ("gateway discovery ns", flag(container(GATEWAY)["args"], "--service-discovery-namespace"), "rl"),
    ("gateway binds the wildcard", flag(container(GATEWAY)["args"], "--host"), "0.0.0.0"),
]


@pytest.mark.parametrize(("what", "actual", "expected"), GPU_ROWS, ids=[row[0] for row in GPU_ROWS])
def test_gpu_sample_reaches_the_gateway(what, actual, expected):
    assert actual == expected, what


def test_gateway_discovers_exactly_the_engine_pods():
    args = container(GATEWAY)["args"]
    assert "--service-discovery" in args and "--worker-urls" not in args
    start = args.index("--selector") + 1
    selector = []
    while not args[start].startswith("--"):
        selector.append(args[start])
        start += 1
    engine_pod_labels = ENGINE["spec"]["template"]["metadata"]["labels"]
    assert dict(s.split("=", 1) for s in selector) == engine_pod_labels
    # And not the proxies or the gateway itself.
    assert not set(selector) & {f"{k}={v}" for k, v in labels(GPU, "proxy").items() if "component" in k}


def test_gateway_options_reach_the_deployment():
    obj = sample("gpu")
    obj["spec"]["gateway"].update(
        {
            "replicas": 3,
            "policy": "round_robin",
            "port": 31000,
            "extraArgs": ["--log-level", "warn"],
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "image": "router:1",
        }
    )
    fleet = parse_fleet(obj)
    deployment = gateway_deployment(fleet)
    args = container(deployment)["args"]
    assert deployment["spec"]["replicas"] == 3
    assert container(deployment)["image"] == "router:1"
    assert flag(args, "--policy") == "round_robin" and flag(args, "--port") == "31000"
    assert args[-2:] == ["--log-level", "warn"]
    assert pod_spec(deployment)["nodeSelector"] == {"pool": "cpu"}
    assert pod_spec(deployment)["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    service = gateway_service(fleet)
    assert service["spec"]["ports"][0]["port"] == 31000
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert env_map(proxy_pod(fleet, 0))[ENV["upstream_url"]] == "http://gpu-fleet-gateway.rl.svc:31000"


def test_external_engines_use_worker_urls_and_no_engine_deployment():
    obj = sample("minimal")
    obj["spec"]["externalEngineUrls"] = ["http://a:30000", "http://b:30000"]
    fleet = parse_fleet(obj)
    args = container(gateway_deployment(fleet))["args"]
    index = args.index("--worker-urls")
    assert args[index + 1 : index + 3] == ["http://a:30000", "http://b:30000"]
    assert "--service-discovery" not in args and "--selector" not in args
    kinds = [(c["kind"], c["metadata"]["name"]) for c in desired_children(fleet)]
    assert ("Deployment", "minimal-engine") not in kinds
    assert ("Deployment", "minimal-gateway") in kinds
    with pytest.raises(ValueError):
        engine_deployment(fleet)


def test_gateway_rbac_reads_pods_only():
    role = gateway_role(GPU)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = gateway_role_binding(GPU)
    account = gateway_service_account(GPU)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "rl"}
    ]
    assert pod_spec(GATEWAY)["serviceAccountName"] == account["metadata"]["name"]


def test_the_gateway_service_exposes_its_metrics_port():
    ports = {p["name"]: p["port"] for p in gateway_service(GPU)["spec"]["ports"]}
    assert ports == {"http": 30080, "metrics": 29000}
    moved = parse_fleet(mutated("gateway.metricsPort", 29100))
    assert flag(container(gateway_deployment(moved))["args"], "--prometheus-port") == "29100"


def test_the_gateway_is_restricted_unless_the_spec_overrides_it():
    obj = gpu_sample()
    obj["spec"]["gateway"].pop("image", None)
    fleet = parse_fleet(obj, IMAGES)
    _, spec = pod_template(gateway_deployment(fleet))
    assert spec["securityContext"] == RESTRICTED_POD
    assert spec["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
    assert spec["containers"][0]["image"] == "reg.example/router:0.3.2"
    own = {"runAsUser": 0}
    _, spec = pod_template(gateway_deployment(fleet_with("gateway", securityContext=own)))
    assert spec["containers"][0]["securityContext"] == own and "securityContext" not in spec
