"""Leader election for operator replicas on a coordination.k8s.io Lease, as Kubernetes' own
controllers do: one replica holds the Lease and runs the operator; the others wait as standbys
(answering their liveness probe) and take the Lease over when its holder stops renewing it.

Why not kopf's peering: a paused kopf stops its watches but not this operator's own background
loops (periodic passes, the memory watchdog), and a standby replica would restart proxies too. So
the election happens before kopf starts at all, and a holder that can no longer renew exits (its
container restarts as a standby) instead of acting without the Lease.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from .kubeapi import KubeApi

log = logging.getLogger("rolloutfleet.operator.leadership")

Action = Literal["create", "take", "renew", "wait"]


@dataclass(frozen=True)
class Election:
    namespace: str
    name: str  # the Lease
    identity: str  # this replica (its pod name)
    lease_duration_s: int = 15
    renew_every_s: float = 5.0
    retry_every_s: float = 2.0

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    @property
    def collection(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"


def _parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _format_time(moment: datetime.datetime) -> str:
    # MicroTime: RFC 3339 with microseconds.
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_action(lease: Mapping[str, Any] | None, identity: str, now: datetime.datetime) -> Action:
    """What a replica does with the Lease as read: create it, take it over (expired or released),
    renew its own, or wait for another holder's to expire. Pure."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return "renew"
    renewed = _parse_time(spec.get("renewTime"))
    duration = spec.get("leaseDurationSeconds") or 0
    if not holder or renewed is None or now >= renewed + datetime.timedelta(seconds=duration):
        return "take"
    return "wait"


def lease_spec(
    election: Election, now: datetime.datetime, previous: Mapping[str, Any] | None, action: Action
) -> dict[str, Any]:
    """The Lease's spec after `action` by this replica. Pure."""
    spec = dict((previous or {}).get("spec") or {})
    stamp = _format_time(now)
    if action in ("create", "take"):
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if action == "take" else 0)
    spec.update(
        holderIdentity=election.identity,
        leaseDurationSeconds=election.lease_duration_s,
        renewTime=stamp,
    )
    return spec


def try_to_lead(api: KubeApi, election: Election, now: datetime.datetime) -> bool:
    """One attempt: True when this replica holds the Lease afterwards. Writes carry the read
    resourceVersion, so of two replicas taking an expired Lease at once only one succeeds."""
    lease = api.get(election.path)
    action = lease_action(lease, election.identity, now)
    if action == "wait":
        return False
    spec = lease_spec(election, now, lease, action)
    try:
        if action == "create":
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": election.name, "namespace": election.namespace},
                "spec": spec,
            }
            return api.create(election.collection, body) is not None
        assert lease is not None
        body = {**lease, "spec": spec}  # metadata.resourceVersion makes the update conditional
        api.request("PUT", election.path, body=body)
        return True
    except ApiException as exc:
        if exc.status == 409:  # another replica wrote first
            return False
        raise


class _ReusingServer(ThreadingHTTPServer):
    # kopf binds the same port right after the standby closes it.
    allow_reuse_address = True


class StandbyHealth:
    """Answers the liveness and readiness probes (200 on any path) while this replica waits: a
    standby is healthy. Closed before kopf binds the same port for its own probe endpoint."""

    def __init__(self, address: str, port: int):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"standby\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = _ReusingServer((address, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="standby-health", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for_leadership(
    api: KubeApi, election: Election, clock: Callable[[], datetime.datetime] | None = None
) -> None:
    """Block until this replica holds the Lease."""
    clock = clock or (lambda: datetime.datetime.now(datetime.UTC))
    announced = False
    while True:
        try:
            if try_to_lead(api, election, clock()):
                log.info("%s leads (Lease %s/%s)", election.identity, election.namespace, election.name)
                return
        except Exception as exc:  # the API server may be briefly unreachable: keep trying
            log.warning("leader election: %s", exc)
        if not announced:
            log.info("%s is a standby: another replica holds the Lease %s", election.identity, election.name)
            announced = True
        time.sleep(election.retry_every_s)


def keep_leadership(
    api: KubeApi, election: Election, on_lost: Callable[[], None] | None = None
) -> threading.Thread:
    """Renew the Lease in the background. If it cannot be renewed before another replica could take
    it (two thirds of its duration), `on_lost` runs: by default the process exits, so the replica
    never acts without the Lease; its container restarts as a standby."""
    on_lost = on_lost or (lambda: os._exit(1))
    deadline_s = election.lease_duration_s * 2 / 3

    def renew() -> None:
        last = time.monotonic()
        while True:
            time.sleep(election.renew_every_s)
            try:
                if try_to_lead(api, election, datetime.datetime.now(datetime.UTC)):
                    last = time.monotonic()
                    continue
                log.error("the Lease %s was taken by another replica", election.name)
            except Exception as exc:
                log.warning("renewing the Lease failed: %s", exc)
                if time.monotonic() - last < deadline_s:
                    continue
            log.error("leadership lost: exiting so that only the Lease's holder acts")
            on_lost()
            return

    thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
    thread.start()
    return thread
