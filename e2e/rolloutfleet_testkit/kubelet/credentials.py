"""Service-account credentials for pod processes, standing in for the mounted token.

A kubelet mounts a bound token at /var/run/secrets/kubernetes.io/serviceaccount and in-cluster
clients reach the API through the `kubernetes` Service. Neither works for host processes (no
kube-proxy, no cluster DNS), so each pod instead gets KUBECONFIG pointing at a kubeconfig with the
API server's real URL, its CA and a TokenRequest token for the pod's service account, bound to the
pod. Programs in pods therefore act with exactly their own RBAC, as in a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from .kube import Kube

TOKEN_SECONDS = 3600
REFRESH_FRACTION = 0.8  # a kubelet refreshes projected tokens at 80% of their lifetime


@dataclass(frozen=True)
class ApiServer:
    url: str
    ca_file: str | None  # None: the harness's own kubeconfig skips TLS verification, so do pods


def api_server(configuration: client.Configuration, state_dir: Path) -> ApiServer:
    """The API server the harness talks to; its CA copied into the state dir (the client may hold
    the CA in a temporary file)."""
    if not configuration.verify_ssl or not configuration.ssl_ca_cert:
        return ApiServer(configuration.host, None)
    ca_file = state_dir / "apiserver-ca.crt"
    shutil.copyfile(configuration.ssl_ca_cert, ca_file)
    return ApiServer(configuration.host, str(ca_file))


def pod_kubeconfig(server: ApiServer, token: str, namespace: str) -> str:
    """A kubeconfig (JSON, which every YAML loader reads) for one pod's service account."""
    cluster: dict = {"server": server.url}
    if server.ca_file:
        cluster["certificate-authority"] = server.ca_file
    else:
        cluster["insecure-skip-tls-verify"] = True
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": "service-account", "user": {"token": token}}],
        "contexts": [
            {
                "name": "pod",
                "context": {"cluster": "cluster", "user": "service-account", "namespace": namespace},
            }
        ],
        "current-context": "pod",
    }
    return json.dumps(document, indent=2) + "\n"


@dataclass(frozen=True)
class Token:
    token: str
    issued_at: float
    seconds: int

    def due_for_refresh(self, now: float | None = None) -> bool:
        return (now or time.time()) >= self.issued_at + REFRESH_FRACTION * self.seconds


def request_token(
    kube: Kube, pod: dict, audiences: list[str] | None = None, seconds: int = TOKEN_SECONDS
) -> Token:
    """A token for the pod's service account, bound to the pod (invalid once the pod is gone)."""
    meta = pod["metadata"]
    body = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=audiences or [],
            expiration_seconds=seconds,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
            ),
        )
    )
    response = kube.core.create_namespaced_service_account_token(
        name=pod["spec"].get("serviceAccountName") or "default",
        namespace=meta["namespace"],
        body=body,
        _preload_content=False,
    )
    return Token(json.loads(response.data)["status"]["token"], time.time(), seconds)


def write_private(path: Path, text: str | bytes, mode: int = 0o600) -> None:
    """Write atomically (readers never see a half-written credential)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(text.encode() if isinstance(text, str) else text)
    os.chmod(temporary, mode)
    os.replace(temporary, path)
