"""What the pods of every component share: placement from the spec, probes, security contexts,
environment overrides; and the Deployments and PodDisruptionBudgets that run and guard them."""

from __future__ import annotations

import copy

from ..fleet import Component, Fleet, Placement, labels
from .metadata import Manifest, object_metadata, pod_labels

NONROOT_ID = 65532
BIND_ALL = "0.0.0.0"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"

# Pod Security "restricted" for a container (the proxy's and, unless the spec says otherwise, the
# router's): non-root, no privilege escalation, no capabilities, the runtime's seccomp profile.
RESTRICTED_CONTAINER: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": NONROOT_ID,
    "runAsGroup": NONROOT_ID,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": NONROOT_ID,
    "runAsGroup": NONROOT_ID,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def place(pod_spec: Manifest, placement: Placement, default_spread: list[Manifest] | None = None) -> None:
    """Placement from the spec into a pod spec (copied: manifests never alias the parsed fleet)."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = copy.deepcopy(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(list(placement.tolerations))
    if placement.affinity:
        pod_spec["affinity"] = copy.deepcopy(placement.affinity)
    spread = copy.deepcopy(list(placement.topology_spread_constraints)) or default_spread
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if placement.image_pull_secrets:
        pod_spec["imagePullSecrets"] = copy.deepcopy(list(placement.image_pull_secrets))


def soft_spread_over_nodes(fleet: Fleet, component: Component) -> list[Manifest]:
    """Prefer different nodes for the component's pods, but schedule them anyway (a small cluster
    may have one node): one node's loss then takes as few proxies as the cluster allows."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME_TOPOLOGY,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": labels(fleet, component)},
        }
    ]


def http_probe(path: str, port: int, period_s: int, failure_threshold: int, timeout_s: int = 2) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failure_threshold,
    }


def with_overrides(base: list[Manifest], extra: tuple[Manifest, ...]) -> list[Manifest]:
    """`base` followed by `extra`; an `extra` entry replaces a `base` entry of the same name."""
    overridden = {entry["name"] for entry in extra}
    return [entry for entry in base if entry["name"] not in overridden] + [copy.deepcopy(e) for e in extra]


def deployment(
    fleet: Fleet,
    name: str,
    component: Component,
    replicas: int,
    pod_spec: Manifest,
    strategy: Manifest | None = None,
    *,
    placement: Placement,
) -> Manifest:
    template_metadata: Manifest = {"labels": pod_labels(fleet, component, placement)}
    if placement.pod_annotations:
        template_metadata["annotations"] = dict(placement.pod_annotations)
    spec: Manifest = {
        "replicas": replicas,
        "selector": {"matchLabels": labels(fleet, component)},
        "template": {"metadata": template_metadata, "spec": pod_spec},
    }
    if strategy:
        spec["strategy"] = strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(fleet, name, component),
        "spec": spec,
    }


def pod_disruption_budget(fleet: Fleet, component: Component, name: str, max_unavailable: int) -> Manifest:
    """Voluntary disruptions (node drains, evictions) take at most `max_unavailable` of the
    component's pods at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_metadata(fleet, name, component),
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": labels(fleet, component)}},
    }
