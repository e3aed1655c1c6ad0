"""The proxies' Services: a headless one for each pod's stable DNS name, and a client one in front
of all of them."""

from __future__ import annotations

from ..fleet import Fleet, client_service_name, headless_service_name, labels
from .metadata import Manifest, object_metadata


def headless_service(fleet: Fleet) -> Manifest:
    """Per-pod DNS for the proxies; not-ready pods get records too, so a starting proxy's public URL
    resolves as soon as the pod has an address."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(fleet, headless_service_name(fleet), "proxy"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(fleet, "proxy"),
            "ports": [{"name": "http", "port": fleet.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def client_service(fleet: Fleet) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(fleet, client_service_name(fleet), "proxy"),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(fleet, "proxy"),
            "ports": [{"name": "http", "port": fleet.proxy.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
