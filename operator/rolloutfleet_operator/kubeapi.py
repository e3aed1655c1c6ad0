"""The Kubernetes API with plain JSON dicts in and out, on the official (synchronous) client.

The client's typed models are bypassed on purpose: manifests are built as dicts by pure functions,
and a round trip through models would reshape them. Every method blocks: async callers run them in
a thread (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .pacing import TokenBucket

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"  # server-side apply (JSON is valid YAML)
FIELD_MANAGER = "rolloutfleet-operator"

# The kinds the operator manages: (apiVersion, kind) -> plural resource name.
RESOURCES = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Secret"): "secrets",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("rolloutfleet.dev/v1alpha1", "RolloutFleet"): "rolloutfleets",
}


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced object (or of its collection when name is None)."""
    plural = RESOURCES[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def fleet_path(namespace: str, name: str) -> str:
    """REST path of a RolloutFleet (append /status for its status subresource)."""
    return resource_path("rolloutfleet.dev/v1alpha1", "RolloutFleet", namespace, name)


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """From a kubeconfig file, else the in-cluster service account, else the default kubeconfig."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return configuration
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


class KubeApi:
    """One connection pool to the API server; thread-safe (urllib3's pool is). With a `limiter`,
    every request first takes a token from it (blocking the worker thread it runs in)."""

    def __init__(self, configuration: client.Configuration, limiter: TokenBucket | None = None):
        self.configuration = configuration
        self.api = client.ApiClient(configuration)
        self.limiter = limiter

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> dict:
        return self.exchange(method, path, body, query, content_type, timeout)[1]

    def exchange(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> tuple[int, dict]:
        """One request: (HTTP status, decoded JSON body); raises ApiException on a non-2xx answer."""
        if self.limiter is not None:
            self.limiter.acquire()
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, post = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, headers, body, post, _request_timeout=timeout)
        data = response.read()  # its bytes (the client's class declares the data attribute as None)
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(
                http_resp=response, body=data.decode(errors="replace"), data=None
            )
        return response.status, (json.loads(data) if data else {})

    def get(self, path: str, **query: Any) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path, query=query)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: Mapping) -> dict | None:
        """Create; None when it already exists."""
        try:
            return self.request("POST", path, body=body)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    def patch(self, path: str, body: Mapping, content_type: str = MERGE) -> dict | None:
        """Patch; None when the object is gone."""
        try:
            return self.request("PATCH", path, body=body, content_type=content_type)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, path: str, body: Mapping | None = None) -> bool:
        """Delete; False when it was already gone."""
        try:
            self.request("DELETE", path, body=body)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def evict(self, namespace: str, name: str, uid: str | None = None) -> str:
        """Evict a pod through the Eviction API, which honours its PodDisruptionBudgets (and then
        deletes it gracefully): "evicted", "gone" (404; or 409 with `uid`: the name now holds
        another pod, which is never the one evicted), or "refused" (429: a budget allows no
        disruption now; try again later). The API server checks the budget before the uid: a pod
        under a budget evicted with a stale uid spends the budget's disruption without deleting
        anything, until the disruption controller gives it back (2 minutes), so callers pass the
        uid of a pod they just read."""
        path = resource_path("v1", "Pod", namespace, name) + "/eviction"
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            self.request("POST", path, body=body)
            return "evicted"
        except ApiException as exc:
            if exc.status == 404 or (exc.status == 409 and uid):
                return "gone"
            if exc.status == 429:
                return "refused"
            raise

    def apply(self, obj: Mapping[str, Any]) -> dict:
        """Server-side apply: the object becomes what this manifest says for the fields it owns.

        Idempotent, so the reconciler can apply its whole desired state on every pass.
        """
        return self.apply_reporting(obj)[0]

    def apply_reporting(self, obj: Mapping[str, Any]) -> tuple[dict, bool]:
        """Server-side apply; also whether this call created the object (201), for Events."""
        status, applied = self.exchange(
            "PATCH",
            object_path(obj),
            body=obj,
            content_type=APPLY,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
        )
        return applied, status == 201

    def apply_status(self, obj: Mapping[str, Any], field_manager: str) -> dict | None:
        """Server-side apply of `obj`'s status on the status subresource as `field_manager`: the
        fields in it become that manager's, the fields other managers own stay as they are (list
        entries keyed by their map keys, e.g. conditions by type). None when the object is gone."""
        try:
            return self.request(
                "PATCH",
                object_path(obj) + "/status",
                body=obj,
                query={"fieldManager": field_manager, "force": "true"},
                content_type=APPLY,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict]:
        query = {"labelSelector": label_selector, "fieldSelector": field_selector}
        return self.request("GET", resource_path(api_version, kind, namespace), query=query).get("items", [])
