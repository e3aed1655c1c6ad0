"""Every child the fleet wants, but proxy pods and the admin-key Secret (which the reconciler
builds one at a time), and the children it may have created earlier but no longer wants."""

from __future__ import annotations

from ..fleet import Fleet, client_service_name, engine_name, engine_service_name, gateway_name
from .engines import engine_deployment, engine_service
from .gateway import (
    gateway_deployment,
    gateway_role,
    gateway_role_binding,
    gateway_service,
    gateway_service_account,
)
from .metadata import Manifest
from .network_policies import NETWORK_POLICY_NAMES, network_policies
from .pods import pod_disruption_budget
from .proxy_services import client_service, headless_service


def unwanted_children(fleet: Fleet) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of children this fleet may have created earlier but no longer wants:
    the engine Deployment once the spec switched to external engines (it would hold its GPUs)."""
    unwanted = []
    if fleet.engines is None:
        unwanted += [
            ("apps/v1", "Deployment", engine_name(fleet)),
            ("v1", "Service", engine_service_name(fleet)),
            ("policy/v1", "PodDisruptionBudget", engine_name(fleet)),
        ]
    # NetworkPolicies turned off in the operator, or the engine's once the engines are gone.
    wanted = (
        {c["metadata"]["name"] for c in network_policies(fleet, fleet.network_policy)}
        if fleet.network_policy
        else set()
    )
    unwanted += [
        ("networking.k8s.io/v1", "NetworkPolicy", name(fleet))
        for name in NETWORK_POLICY_NAMES
        if name(fleet) not in wanted
    ]
    return unwanted


def desired_children(fleet: Fleet) -> list[Manifest]:
    """Every child except proxy pods and the admin-key Secret, in a safe order of creation."""
    children = [
        headless_service(fleet),
        client_service(fleet),
        pod_disruption_budget(fleet, "proxy", client_service_name(fleet), fleet.proxy.memory.max_unavailable),
        gateway_service_account(fleet),
        gateway_role(fleet),
        gateway_role_binding(fleet),
        gateway_service(fleet),
        pod_disruption_budget(fleet, "gateway", gateway_name(fleet), fleet.gateway.max_unavailable),
        gateway_deployment(fleet),
    ]
    if fleet.engines is not None:
        engines = fleet.engines
        children += [
            engine_service(fleet),
            pod_disruption_budget(fleet, "engine", engine_name(fleet), engines.max_unavailable),
            engine_deployment(fleet),
        ]
    if fleet.network_policy is not None:
        children += network_policies(fleet, fleet.network_policy)
    return children
