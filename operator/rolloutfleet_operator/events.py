"""Events the Kubernetes way: one Event object per cause, counted, instead of a new one every pass.

A cause is (involved object, type, reason, message). Its first occurrence creates a core/v1 Event
(count 1); a recurrence within `SERIES_WINDOW_S` of the last one is counted, and the Event's
`count` and `lastTimestamp` are patched at most once per `UPDATE_INTERVAL_S` (as client-go's
EventCorrelator aggregates and rate-limits), so `kubectl describe` shows `(x42 over 7m)` and a
failure that recurs every pass costs one patch a minute, not one Event per pass. After a quiet
window (the API server's default Event TTL) the next occurrence starts a new Event. The decision
is `next_step` (pure); `EventRecorder` does the I/O, in worker threads, and never fails its caller.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from .fleet import MANAGER
from .kubeapi import KubeApi, resource_path

log = logging.getLogger("rolloutfleet.operator")

SERIES_WINDOW_S = 3600.0
UPDATE_INTERVAL_S = 60.0
MAX_MESSAGE_CHARS = 1024

Step = Literal["create", "update", "count"]
CauseKey = tuple[str, str, str, str]  # (involved object uid or namespace/name, type, reason, message)


@dataclass(frozen=True)
class Series:
    """One cause's Event: its object's name and the occurrences counted so far."""

    name: str
    count: int
    first_seen: float
    last_seen: float
    written_at: float  # when the Event object last got the count


def next_step(series: Series | None, now: float) -> Step:
    """What an occurrence of a cause does: create its Event, patch its count, or only count."""
    if series is None or now - series.last_seen > SERIES_WINDOW_S:
        return "create"
    if now - series.written_at >= UPDATE_INTERVAL_S:
        return "update"
    return "count"


def _stamp(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
    }


class EventRecorder:
    def __init__(self, api: KubeApi, clock: Callable[[], float] = time.time):
        self.api = api
        self._clock = clock
        self._series: dict[CauseKey, Series] = {}
        self._instance = os.environ.get("POD_NAME") or socket.gethostname()

    async def post_event(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        """Record one occurrence of a cause on `obj` (a body with apiVersion, kind and metadata)."""
        message = message[:MAX_MESSAGE_CHARS]
        ref = _reference(obj)
        key = (ref["uid"] or f"{ref['namespace']}/{ref['name']}", type, reason, message)
        now = self._clock()
        self._forget_quiet(now)
        series = self._series.get(key)
        step = next_step(series, now)
        if series is not None and step != "create":
            series = replace(series, count=series.count + 1, last_seen=now)
            self._series[key] = series
        try:
            if step == "count":
                return
            if step == "update" and series is not None:
                patched = await asyncio.to_thread(self._patch, ref["namespace"], series, now)
                if patched:
                    self._series[key] = replace(series, written_at=now)
                    return
            name = await asyncio.to_thread(self._create, ref, type, reason, message, now)
            self._series[key] = Series(name, 1, now, now, now)
        except ApiException as exc:  # an Event lost is no reason to fail a pass
            log.warning("posting Event %s on %s/%s: %s", reason, ref["namespace"], ref["name"], exc.reason)

    def _forget_quiet(self, now: float) -> None:
        quiet = [k for k, s in self._series.items() if now - s.last_seen > SERIES_WINDOW_S]
        for key in quiet:
            del self._series[key]

    def _create(self, ref: dict[str, Any], type: str, reason: str, message: str, now: float) -> str:
        stamp = _stamp(now)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{ref['name']}.", "namespace": ref["namespace"]},
            "involvedObject": ref,
            "type": type,
            "reason": reason,
            "message": message,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": MANAGER},
            "reportingComponent": MANAGER,
            "reportingInstance": self._instance,
        }
        created = self.api.create(resource_path("v1", "Event", ref["namespace"]), body) or {}
        return str((created.get("metadata") or {}).get("name") or "")

    def _patch(self, namespace: str, series: Series, now: float) -> bool:
        """The series' count on its Event; False when the Event is gone (expired: create anew)."""
        if not series.name:
            return False
        path = resource_path("v1", "Event", namespace, series.name)
        return self.api.patch(path, {"count": series.count, "lastTimestamp": _stamp(now)}) is not None
