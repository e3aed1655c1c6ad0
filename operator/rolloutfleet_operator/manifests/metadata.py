"""The metadata every child carries: the fleet's labels for its component and a controller
ownerReference to the fleet (garbage collection removes the child with the fleet)."""

from __future__ import annotations

from typing import Any

from ..fleet import API_VERSION, KIND, Component, Fleet, Placement, labels

# A Kubernetes object, or a part of one, as the API takes it.
Manifest = dict[str, Any]


def owner_reference(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": fleet.name,
        "uid": fleet.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_metadata(fleet: Fleet, name: str, component: Component) -> Manifest:
    return {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels(fleet, component),
        "ownerReferences": [owner_reference(fleet)],
    }


def pod_labels(fleet: Fleet, component: Component, placement: Placement) -> dict[str, str]:
    """The spec's podLabels under the component's own (which the selectors use, so they win)."""
    return {**placement.pod_labels, **labels(fleet, component)}
