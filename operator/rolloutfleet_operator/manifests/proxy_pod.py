"""One proxy pod, `<fleet>-proxy-<ordinal>`, and the template hash that tells outdated pods apart.

Each pod gets its own dump subdirectory (`<dump path>/<pod>`) and public URL (its per-pod DNS name
through the headless Service), so a replacement under the same name finds and restores its
predecessor's sessions.
"""

from __future__ import annotations

import copy
import hashlib
import json

from ..fleet import ORDINAL_LABEL, TEMPLATE_HASH_ANNOTATION, Fleet, headless_service_name, proxy_pod_name
from .metadata import Manifest, object_metadata, pod_labels
from .pods import (
    BIND_ALL,
    NONROOT_ID,
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    http_probe,
    place,
    soft_spread_over_nodes,
)
from .proxy_env import HASH_EXEMPT_ENV, proxy_env

PROXY_CONTAINER = "proxy"
TOKENIZER_VOLUME = "tokenizer"
DUMP_VOLUME = "dumps"
TMP_VOLUME = "tmp"


def _dump_volume(fleet: Fleet) -> Manifest:
    dump = fleet.proxy.dump
    if dump.persistent_volume_claim is not None:
        return {
            "name": DUMP_VOLUME,
            "persistentVolumeClaim": {"claimName": dump.persistent_volume_claim["claimName"]},
        }
    if dump.host_path is not None:
        return {
            "name": DUMP_VOLUME,
            "hostPath": {"path": dump.host_path["path"], "type": "DirectoryOrCreate"},
        }
    return {"name": DUMP_VOLUME, "emptyDir": copy.deepcopy(dump.empty_dir or {})}


def _proxy_pod_body(fleet: Fleet, pod_name: str) -> Manifest:
    """The proxy pod for `pod_name`, without the ordinal label and the template hash."""
    proxy = fleet.proxy
    headless = headless_service_name(fleet)
    public_url = f"http://{pod_name}.{headless}.{fleet.namespace}.svc:{proxy.port}"
    mounts: list[Manifest] = []
    volumes: list[Manifest] = []
    if proxy.tokenizer.volume is not None:
        volumes.append({**copy.deepcopy(proxy.tokenizer.volume), "name": TOKENIZER_VOLUME})
        mounts.append({"name": TOKENIZER_VOLUME, "mountPath": proxy.tokenizer.path, "readOnly": True})
    volumes.append(_dump_volume(fleet))
    mounts.append({"name": DUMP_VOLUME, "mountPath": proxy.dump.path})
    # Last, so a process-kubelet bind mount over /tmp cannot hide the sources of the others.
    volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
    mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    container: Manifest = {
        "name": PROXY_CONTAINER,
        "image": proxy.image,
        "imagePullPolicy": proxy.image_pull_policy,
        "args": ["--host", BIND_ALL, "--port", str(proxy.port)],
        "env": proxy_env(fleet, pod_name, public_url),
        **({"envFrom": copy.deepcopy(list(proxy.env_from))} if proxy.env_from else {}),
        "ports": [{"name": "http", "containerPort": proxy.port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # Restoring a predecessor's sessions can take a while: the startup probe holds the
        # liveness probe off for up to 5 minutes; readiness gates traffic until the proxy has started.
        "startupProbe": http_probe("/healthz", proxy.port, period_s=1, failure_threshold=300),
        "readinessProbe": http_probe("/readyz", proxy.port, period_s=5, failure_threshold=2),
        "livenessProbe": http_probe("/healthz", proxy.port, period_s=10, failure_threshold=6, timeout_s=5),
        "securityContext": {**copy.deepcopy(RESTRICTED_CONTAINER), "readOnlyRootFilesystem": True},
    }
    if proxy.resources:
        container["resources"] = copy.deepcopy(proxy.resources)
    metadata = object_metadata(fleet, pod_name, "proxy")
    metadata["labels"] = pod_labels(fleet, "proxy", proxy.placement)
    if proxy.placement.pod_annotations:
        metadata["annotations"] = dict(proxy.placement.pod_annotations)
    spec: Manifest = {
        "hostname": pod_name,
        "subdomain": headless,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": proxy.termination_grace_period_s,
        # The proxy never calls the API; and service links could inject variables such as
        # ROLLOUTFLEET_PROXY_PORT=tcp://... for a Service named "rolloutfleet-proxy".
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {**copy.deepcopy(RESTRICTED_POD), "fsGroup": NONROOT_ID},
        "containers": [container],
        "volumes": volumes,
    }
    if proxy.service_account_name:
        spec["serviceAccountName"] = proxy.service_account_name
    place(spec, proxy.placement, soft_spread_over_nodes(fleet, "proxy"))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def template_hash(fleet: Fleet) -> str:
    """A short, stable hash of the proxy pod template: every part that comes from the spec.

    The pod is built for a placeholder name, so the name and the ordinal (and what is derived from
    them: hostname, dump subdirectory, public URL) do not enter; replicas and the memory watchdog's
    settings are not part of the pod, so changing them does not roll the proxies; nor do the
    settings derived from them (HASH_EXEMPT_ENV).
    """
    body = _proxy_pod_body(fleet, "$(POD_NAME)")
    for container in body["spec"]["containers"]:
        container["env"] = [e for e in container["env"] if e["name"] not in HASH_EXEMPT_ENV]
    identity = {key: body["metadata"].get(key) for key in ("labels", "annotations")}
    canonical = json.dumps({**identity, "spec": body["spec"]}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def proxy_pod(fleet: Fleet, ordinal: int) -> Manifest:
    """Proxy pod `<fleet>-proxy-<ordinal>`, annotated with the current template hash."""
    name = proxy_pod_name(fleet, ordinal)
    pod = _proxy_pod_body(fleet, name)
    pod["metadata"]["labels"][ORDINAL_LABEL] = str(ordinal)
    pod["metadata"]["annotations"] = {
        **pod["metadata"].get("annotations", {}),
        TEMPLATE_HASH_ANNOTATION: template_hash(fleet),
    }
    return pod
