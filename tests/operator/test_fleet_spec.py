"""The fleet view: a RolloutFleet parsed with the CRD's defaults, its names and labels."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_samples import GPU, IMAGES, MINIMAL, POLICY_JSON, SCHEMA, gpu_sample, sample
from rolloutfleet_operator.fleet import (
    CLIENT_LABEL,
    DEFAULTS,
    GATEWAY_IMAGE_ENV,
    NETWORK_POLICY_ENV,
    PROXY_IMAGE_ENV,
    NetworkPolicySpec,
    OperatorDefaults,
    client_service_name,
    engine_name,
    gateway_name,
    headless_service_name,
    labels,
    parse_fleet,
    proxy_ordinal,
    proxy_pod_name,
    selector_string,
)


def _schema_defaults(schema: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    found = {}
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{key}"
        if "default" in sub and sub["default"] != {}:
            found[path] = sub["default"]
        found.update(_schema_defaults(sub, path + "."))
    return found


def test_defaults_are_the_crds():
    assert _schema_defaults(SCHEMA["properties"]["spec"]) == DEFAULTS


def test_a_sparse_object_parses_with_the_crd_defaults():
    fleet = parse_fleet(
        {
            "metadata": {"name": "f"},
            "spec": {"proxy": {"tokenizer": {"path": "/tok"}}, "engines": {"modelPath": "/m", "image": "e"}},
        },
        OperatorDefaults(
            proxy_image="r.example/rolloutfleet-proxy:9.9.9", gateway_image="r.example/router:1"
        ),
    )
    assert fleet.namespace == "default"
    assert fleet.proxy.replicas == 1 and fleet.proxy.port == 8000
    assert fleet.proxy.image == "r.example/rolloutfleet-proxy:9.9.9"  # the operator's default
    assert fleet.gateway.image == "r.example/router:1"
    assert fleet.proxy.dump.path == "/var/lib/rolloutfleet/dumps" and fleet.proxy.dump.empty_dir == {}
    assert fleet.proxy.memory.consecutive_samples == 3 and not fleet.proxy.memory.enabled
    assert fleet.gateway.port == 30080 and fleet.gateway.policy == "manual"  # routes by session
    assert fleet.gateway.assignment_mode == "min_load" and fleet.gateway.replicas == 1
    assert fleet.gateway.retries.max_retries == 5 and fleet.gateway.circuit_breaker.enabled
    assert fleet.gateway.otlp_traces_endpoint is None and fleet.gateway.max_unavailable == 1
    assert fleet.engines is not None and fleet.engines.gpus_per_engine == 1
    assert fleet.engines.tensor_parallel_size == 1 and fleet.engines.port == 30000


def test_parse_reads_metadata_and_the_gpu_sample():
    assert (GPU.name, GPU.namespace, GPU.uid, GPU.generation) == ("gpu-fleet", "rl", "uid-1", 3)
    assert GPU.proxy.memory.rss_budget_bytes == 6442450944 and GPU.proxy.memory.enabled
    assert GPU.proxy.dump.persistent_volume_claim == {"claimName": "rollout-dumps"}
    assert GPU.proxy.dump.empty_dir is None
    assert GPU.external_engine_urls == ()
    assert MINIMAL.engines is None
    assert MINIMAL.external_engine_urls == ("http://sglang-engine-0.sglang:30000",)


@pytest.mark.parametrize(
    "spec",
    [
        {"proxy": {"tokenizer": {"path": "/t"}}},
        {
            "proxy": {"tokenizer": {"path": "/t"}},
            "engines": {"modelPath": "/m"},
            "externalEngineUrls": ["http://e:1"],
        },
        {"proxy": {"tokenizer": {}}, "externalEngineUrls": ["http://e:1"]},
        {"externalEngineUrls": ["http://e:1"]},
        {
            "proxy": {"tokenizer": {"path": "/t"}, "admission": {"consumerBatchSize": 8}},
            "externalEngineUrls": ["http://e:1"],
        },
        {
            "proxy": {"tokenizer": {"path": "/t"}},
            "gateway": {"replicas": 2},
            "externalEngineUrls": ["http://e:1"],
        },
    ],
)
def test_parse_rejects_what_the_crd_rejects(spec):
    with pytest.raises(ValueError):
        parse_fleet({"metadata": {"name": "f"}, "spec": spec})


def test_names_and_labels():
    assert proxy_pod_name(GPU, 3) == "gpu-fleet-proxy-3"
    assert proxy_ordinal(GPU, "gpu-fleet-proxy-12") == 12
    for other in ["gpu-fleet-proxy-", "gpu-fleet-proxy-01", "gpu-fleet-proxy-x", "other-proxy-1"]:
        assert proxy_ordinal(GPU, other) is None
    assert labels(GPU, "engine") == {
        "app.kubernetes.io/name": "rolloutfleet",
        "app.kubernetes.io/instance": "gpu-fleet",
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "rolloutfleet-operator",
        "rolloutfleet.dev/fleet": "gpu-fleet",
    }
    selector = selector_string(GPU, "proxy")
    assert dict(part.split("=") for part in selector.split(",")) == labels(GPU, "proxy")
    names = {headless_service_name(GPU), client_service_name(GPU), gateway_name(GPU), engine_name(GPU)}
    assert len(names) == 4


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


def test_the_default_router_image_carries_the_router_release_the_tests_run():
    """One release of sglang-router: the one pyproject.toml pins (the tests run it), the one
    images/sglang-router installs, and the tag of the operator's default gateway image."""
    from rolloutfleet_operator.fleet import SGLANG_ROUTER_VERSION
    from rolloutfleet_testkit.images.catalog import dockerfile_images, pinned_version

    assert pinned_version("sglang-router") == SGLANG_ROUTER_VERSION
    dockerfile, names = dockerfile_images()["sglang-router"]
    assert f"sglang-router=={SGLANG_ROUTER_VERSION}" in dockerfile.read_text()
    assert names == [OperatorDefaults.from_environment({}, "1.0.0").gateway_image]


def test_spec_values_by_path_take_the_crds_defaults():
    """What the settings table reads by path: the object's value, else the CRD's default, else None."""
    assert GPU.spec_value("proxy.admission.maxStaleness") == 2
    assert GPU.spec_value("proxy.tokenizer.path") == "/models"
    assert MINIMAL.spec_value("proxy.dump.durability") == DEFAULTS["proxy.dump.durability"] == "sync"
    assert MINIMAL.spec_value("proxy.admission.maxStaleness") is None  # no default: not injected
    assert MINIMAL.spec_value("proxy.no.such.field") is None
    null = sample("minimal")
    null["spec"]["proxy"]["exportTtlSeconds"] = None
    assert parse_fleet(null).spec_value("proxy.exportTtlSeconds") == DEFAULTS["proxy.exportTtlSeconds"]
