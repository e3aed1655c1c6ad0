"""A container's environment, resolved the way a kubelet does (pure; API reads come in as `Lookups`).

Order: `envFrom` sources first (in order, later ones win), then `env` entries in order. A literal
`value` is `$(VAR)`-expanded against the variables defined before it; `valueFrom` values are not
expanded. A missing ConfigMap/Secret or key fails the container with CreateContainerConfigError
unless the reference is `optional`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from .errors import config_error
from .expansion import expand

HOST_IP = "127.0.0.1"
_KEYED_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


class Lookups(Protocol):
    """Reads from the API; each returns the object's string data, or None when it does not exist."""

    def config_map(self, namespace: str, name: str) -> dict[str, str] | None: ...

    def secret(self, namespace: str, name: str) -> dict[str, str] | None: ...


@dataclass(frozen=True)
class PodFacts:
    """What the kubelet itself decides about a pod and which the downward API exposes."""

    pod_ip: str
    host_ip: str = HOST_IP
    allocatable: Mapping[str, str] | None = None  # node allocatable, the default for unset limits


def field_value(pod: Mapping, path: str, facts: PodFacts) -> str:
    """Value of a downward-API `fieldRef.fieldPath`."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": facts.pod_ip,
        "status.podIPs": facts.pod_ip,
        "status.hostIP": facts.host_ip,
        "status.hostIPs": facts.host_ip,
    }
    if path in simple:
        return simple[path]
    keyed = _KEYED_FIELD.fullmatch(path)
    if keyed:
        return (meta.get(keyed.group(1)) or {}).get(keyed.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):  # downward-API volumes only
        values = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{key}="{value}"' for key, value in sorted(values.items()))
    raise config_error(f"unsupported fieldRef fieldPath {path!r}")


def resource_value(container: Mapping, ref: Mapping, facts: PodFacts) -> str:
    """Value of a `resourceFieldRef`: a limit (node allocatable when unset) or request, in `divisor` units,
    rounded up as the kubelet does."""
    from kubernetes.utils.quantity import parse_quantity

    kind, _, resource = ref.get("resource", "").partition(".")
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if kind == "limits":
        raw = limits.get(resource) or (facts.allocatable or {}).get(resource)
    elif kind == "requests":
        raw = requests.get(resource) or limits.get(resource)
    else:
        raise config_error(f"unsupported resourceFieldRef {ref.get('resource')!r}")
    quantity = parse_quantity(raw) if raw is not None else Decimal(0)
    divisor = parse_quantity(str(ref.get("divisor") or "1")) or Decimal(1)
    return str(math.ceil(quantity / divisor))


def _from_source(kind: str, source: Mapping, namespace: str, lookups: Lookups) -> dict[str, str] | None:
    name = source.get("name", "")
    data = lookups.config_map(namespace, name) if kind == "configMap" else lookups.secret(namespace, name)
    if data is None and not source.get("optional"):
        what = "configmap" if kind == "configMap" else "secret"
        raise config_error(f'{what} "{name}" not found')
    return data


def _key_ref(kind: str, ref: Mapping, namespace: str, lookups: Lookups) -> str | None:
    data = _from_source(kind, ref, namespace, lookups)
    key = ref.get("key", "")
    if data is not None and key in data:
        return data[key]
    if ref.get("optional"):
        return None
    raise config_error(f"couldn't find key {key} in {kind} {namespace}/{ref.get('name', '')}")


def resolve_env(container: Mapping, pod: Mapping, facts: PodFacts, lookups: Lookups) -> dict[str, str]:
    """The container's variables, in definition order (raises ContainerStartError)."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind in ("configMap", "secret"):
            ref = source.get(f"{kind}Ref")
            if ref is None:
                continue
            for key, value in (_from_source(kind, ref, namespace, lookups) or {}).items():
                if "=" not in key:  # names with '=' cannot be environment variables
                    env[prefix + key] = value
    for var in container.get("env") or []:
        name, value_from = var["name"], var.get("valueFrom")
        if value_from is None:
            env[name] = expand(var.get("value") or "", env)
        elif "fieldRef" in value_from:
            env[name] = field_value(pod, value_from["fieldRef"]["fieldPath"], facts)
        elif "resourceFieldRef" in value_from:
            env[name] = resource_value(container, value_from["resourceFieldRef"], facts)
        elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
            kind = "configMap" if "configMapKeyRef" in value_from else "secret"
            value = _key_ref(kind, value_from[f"{kind}KeyRef"], namespace, lookups)
            if value is not None:
                env[name] = value
        else:
            raise config_error(f"unsupported valueFrom for {name}: {sorted(value_from)}")
    return env
