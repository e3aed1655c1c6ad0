"""A recording stand-in for the operator's API client (kubeapi.KubeApi's methods the reconciler and
the watchdog call), with the fleet's status kept as the API server keeps it (resourceVersion checks),
and the watch caches filled as the API server would fill them for a fleet at rest."""

from __future__ import annotations

import copy

from kubernetes.client.exceptions import ApiException
from rolloutfleet_operator.desired_state import with_desired_hash
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.watch_cache import CACHED_KINDS, by_fleet

READY = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "podIP": "10.0.0.9"}


class RecordingApi:
    """The calls the reconciler and the watchdog make; the fleet's status lives here as on the API server."""

    def __init__(self, fleet: dict):
        self.fleet = copy.deepcopy(fleet)
        self.fleet["metadata"]["resourceVersion"] = "1"
        self.calls: list[tuple] = []
        self.nodes: dict[str, dict] = {}  # name -> Node (absent: 404)
        self.pods: list[dict] | None = None  # what a LIST of pods answers (None: not expected)
        self.eviction_outcome = "evicted"  # what every eviction answers ("refused": HTTP 429)
        self.refuse_pods = False

    def apply_reporting(self, obj: dict):
        self.calls.append(("apply", f"{obj['kind']}/{obj['metadata']['name']}"))
        return obj, False

    def get(self, path: str):
        self.calls.append(("get", path))
        if path.startswith("/api/v1/nodes/"):
            return copy.deepcopy(self.nodes.get(path.rsplit("/", 1)[-1]))
        return copy.deepcopy(self.fleet) if "rolloutfleets" in path else {"kind": "Secret"}

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ):
        self.calls.append(("list", kind))
        assert self.pods is not None, "a list nobody expected"
        return copy.deepcopy(self.pods)

    def create(self, path: str, body: dict):
        self.calls.append(("create", body["metadata"]["name"]))
        if body["kind"] == "Pod" and self.refuse_pods:
            raise ApiException(status=403, reason="Forbidden")
        return body

    def delete(self, path: str, body=None):
        call = ("delete", path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1])
        self.calls.append(call if body is None else (*call, body))
        return True

    def evict(self, namespace: str, name: str, uid: str | None = None):
        self.calls.append(("evict", name, uid))
        return self.eviction_outcome

    def patch(self, path: str, body: dict, content_type: str = ""):
        assert "/pods/" in path, "status goes out by server-side apply"  # the only patch: adoption
        self.calls.append(("adopt", path.rsplit("/", 1)[-1], body, content_type))
        return {"metadata": {"name": path.rsplit("/", 1)[-1], **body["metadata"]}, "status": READY}

    def apply_status(self, obj: dict, field_manager: str):
        """Server-side apply as the API server does it for these fields: scalars replaced, conditions
        merged by type (the list-map key), the resourceVersion moved."""
        self.calls.append(("apply-status", field_manager))
        status = self.fleet.setdefault("status", {})
        for key, value in obj["status"].items():
            if key == "conditions":
                applied = {c["type"]: c for c in value}
                kept = [c for c in status.get("conditions") or [] if c["type"] not in applied]
                status["conditions"] = kept + list(applied.values())
            else:
                status[key] = value
        self.fleet["metadata"]["resourceVersion"] = str(int(self.fleet["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.fleet)


def cluster_at_rest(body: dict) -> dict:
    """kind -> {(namespace, fleet): objects}: every child as applied, the gateway ready, the
    proxies created from the current template and Ready."""
    fleet = parse_fleet(body)
    indexes: dict = {kind: {} for kind in CACHED_KINDS}

    def add(obj: dict) -> None:
        for key, value in by_fleet(obj).items():
            indexes[(obj["apiVersion"], obj["kind"])].setdefault(key, []).append(value)

    for manifest in desired_children(fleet):
        stored = with_desired_hash(manifest)
        if stored["kind"] == "Deployment":
            stored["status"] = {"readyReplicas": stored["spec"]["replicas"]}
        add(stored)
    for ordinal in range(fleet.proxy.replicas):
        add({**proxy_pod(fleet, ordinal), "status": READY})
    return indexes
