"""The fleet's NetworkPolicies (manifests/network_policies.py)."""

from __future__ import annotations

from fleet_samples import POLICY_JSON, gpu_sample
from rolloutfleet_operator.fleet import (
    CLIENT_LABEL,
    NETWORK_POLICY_ENV,
    OperatorDefaults,
    labels,
    parse_fleet,
)
from rolloutfleet_operator.manifests.children import desired_children, unwanted_children


def test_network_policies_let_in_only_who_needs_each_component():
    defaults = OperatorDefaults.from_environment({NETWORK_POLICY_ENV: POLICY_JSON}, "1.0.0")
    fleet = parse_fleet(gpu_sample(), defaults)
    policies = {
        p["metadata"]["name"]: p["spec"] for p in desired_children(fleet) if p["kind"] == "NetworkPolicy"
    }
    assert set(policies) == {"gpu-fleet-proxy", "gpu-fleet-gateway", "gpu-fleet-engine"}
    assert unwanted_children(fleet) == []
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
    assert ("networking.k8s.io/v1", "NetworkPolicy", "gpu-fleet-engine") in unwanted_children(external)
