"""The fleet's NetworkPolicies (when the operator is told to give fleets some): ingress to each
component's pods only from those that need it."""

from __future__ import annotations

import copy
from typing import Any

from ..fleet import (
    Component,
    Fleet,
    NetworkPolicySpec,
    client_service_name,
    engine_name,
    gateway_name,
    labels,
)
from .metadata import Manifest, object_metadata

OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "rolloutfleet-operator"}  # the chart's selector labels


def _peer(pods: dict[str, Any], namespaces: dict[str, Any] | None) -> Manifest:
    """A NetworkPolicy peer: pods matching `pods`, in the namespaces matching `namespaces` (None:
    the policy's own namespace)."""
    peer: Manifest = {"podSelector": copy.deepcopy(pods)}
    if namespaces is not None:
        peer["namespaceSelector"] = copy.deepcopy(namespaces)
    return peer


def _namespace_named(name: str) -> Manifest:
    return {"matchLabels": {"kubernetes.io/metadata.name": name}}


def _ingress(peers: list[Manifest], ports: list[int] | None) -> Manifest:
    rule: Manifest = {"from": peers}
    if ports is not None:
        rule["ports"] = [{"protocol": "TCP", "port": port} for port in ports]
    return rule


def _network_policy(fleet: Fleet, component: Component, name: str, rules: list[Manifest]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_metadata(fleet, name, component),
        "spec": {
            "podSelector": {"matchLabels": labels(fleet, component)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def network_policies(fleet: Fleet, policy: NetworkPolicySpec) -> list[Manifest]:
    """Ingress to the fleet's pods only from those that need it: proxies from the clients (rollout
    workers, trainers) and the operator (its /stats polls); the gateway from the fleet's proxies;
    engines from the gateway and the clients (trainers pause them and update their weights, NCCL
    on any port). Metrics ports also from the scrapers' namespaces, when named."""
    clients = _peer(policy.clients, policy.client_namespaces)
    operator = _peer({"matchLabels": OPERATOR_POD_LABELS}, _namespace_named(policy.operator_namespace))
    scrapers = [_peer({}, policy.scrapers)] if policy.scrapers is not None else []
    proxy_port, gateway = fleet.proxy.port, fleet.gateway
    proxy_rules = [_ingress([clients, operator, *scrapers], [proxy_port])]
    gateway_rules = [_ingress([_peer({"matchLabels": labels(fleet, "proxy")}, None)], [gateway.port])]
    if scrapers:
        gateway_rules.append(_ingress(scrapers, [gateway.metrics_port]))
    policies = [
        _network_policy(fleet, "proxy", client_service_name(fleet), proxy_rules),
        _network_policy(fleet, "gateway", gateway_name(fleet), gateway_rules),
    ]
    if fleet.engines is not None:
        from_gateway = _ingress(
            [_peer({"matchLabels": labels(fleet, "gateway")}, None)], [fleet.engines.port]
        )
        engine_rules = [from_gateway, _ingress([clients], None)]
        if scrapers:
            engine_rules.append(_ingress(scrapers, [fleet.engines.port]))
        policies.append(_network_policy(fleet, "engine", engine_name(fleet), engine_rules))
    return policies


# The names every NetworkPolicy a fleet may have had (one per component).
NETWORK_POLICY_NAMES = (client_service_name, gateway_name, engine_name)
