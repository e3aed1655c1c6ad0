"""Kubelet-style Events on pods (Started, Killing, BackOff, Unhealthy, Failed…), best effort."""

from __future__ import annotations

import logging
import secrets
import threading

from .kube import Kube
from .status import timestamp

log = logging.getLogger("rolloutfleet.kubelet")


def event_manifest(pod: dict, node: str, kind: str, reason: str, message: str, now: str) -> dict:
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": "kubelet", "host": node},
        "reportingComponent": "kubelet",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    """Events for one pod. A repeat of the same (type, reason, message) bumps `count` and
    `lastTimestamp` of the Event already written, as client-go's recorder does, instead of adding
    one object per failed probe."""

    def __init__(self, kube: Kube, pod: dict):
        self._kube = kube
        self._pod = pod
        self._written: dict[tuple[str, str, str], tuple[str, int]] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, reason: str, message: str) -> None:
        namespace = self._pod["metadata"]["namespace"]
        key = (kind, reason, message)
        now = timestamp()
        with self._lock:
            try:
                if key in self._written:
                    name, count = self._written[key]
                    patch = {"count": count + 1, "lastTimestamp": now}
                    if self._kube.patch(f"/api/v1/namespaces/{namespace}/events/{name}", patch) is not None:
                        self._written[key] = (name, count + 1)
                        return
                body = event_manifest(
                    self._pod, self._pod["spec"].get("nodeName", ""), kind, reason, message, now
                )
                self._kube.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body, timeout=5)
                self._written[key] = (body["metadata"]["name"], 1)
            except Exception as exc:  # events are diagnostics; never fail a pod over one
                log.debug("event %s for %s not recorded: %s", reason, self._pod["metadata"]["name"], exc)
