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
import socket
import struct
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


@dataclass(frozen=True)
class Observation:
    """The Lease record as this replica last read it, and when (its own monotonic clock) it first
    read that record. Expiry is timed from there, as client-go does: never by comparing this
    machine's clock with the holder's renewTime, so clock skew cannot steal a live Lease."""

    record: tuple[str | None, str | None, str | None]  # holder, renewTime, resourceVersion
    since: float


def observe(lease: Mapping[str, Any] | None, previous: Observation | None, now: float) -> Observation | None:
    """The observation after reading `lease` at `now`: the previous one while the record is unchanged.
    Pure."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    record = (
        spec.get("holderIdentity"),
        spec.get("renewTime"),
        (lease.get("metadata") or {}).get("resourceVersion"),
    )
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def lease_action(
    lease: Mapping[str, Any] | None, identity: str, observed: Observation | None, now: float
) -> Action:
    """What a replica does with the Lease as read (and observed since `observed.since`): create it,
    take it over (released, or unchanged for a whole lease duration of this replica's own clock),
    renew its own, or wait. Pure."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return "renew"
    if not holder:
        return "take"
    duration = spec.get("leaseDurationSeconds") or 0
    if observed is not None and now - observed.since >= duration:
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


def released_spec(previous: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """The Lease's spec given up by its holder (client-go's ReleaseOnCancel): no holder, so a standby
    takes it at its next try instead of waiting out the lease. Pure."""
    spec = dict(previous.get("spec") or {})
    spec.pop("holderIdentity", None)
    spec.update(leaseDurationSeconds=1, renewTime=_format_time(now))
    return spec


class LeaseClient:
    """One replica's I/O on the Lease: every call bounded by the time it is given."""

    def __init__(self, api: KubeApi, election: Election):
        self.api, self.election = api, election
        self.observed: Observation | None = None

    def read(self, timeout_s: float) -> dict | None:
        try:
            return self.api.request("GET", self.election.path, timeout=timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def try_to_lead(self, timeout_s: float) -> bool:
        """One attempt: True when this replica holds the Lease afterwards. Writes carry the read
        resourceVersion, so of two replicas taking an expired Lease at once only one succeeds."""
        election = self.election
        deadline = time.monotonic() + timeout_s  # for the read and the write together

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no time left to write the Lease {election.name}")
            return remaining

        lease = self.read(timeout_s)
        self.observed = observe(lease, self.observed, time.monotonic())
        action = lease_action(lease, election.identity, self.observed, time.monotonic())
        if action == "wait":
            return False
        spec = lease_spec(election, datetime.datetime.now(datetime.UTC), lease, action)
        try:
            if action == "create":
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": election.name, "namespace": election.namespace},
                    "spec": spec,
                }
                try:
                    self.api.request("POST", election.collection, body=body, timeout=left())
                    return True
                except ApiException as exc:
                    if exc.status == 409:  # created by another replica first
                        return False
                    raise
            assert lease is not None
            body = {**lease, "spec": spec}  # metadata.resourceVersion makes the update conditional
            self.api.request("PUT", election.path, body=body, timeout=left())
            return True
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise

    def release(self, timeout_s: float = 5.0) -> bool:
        """Give the Lease up if this replica holds it; True when it was released."""
        lease = self.read(timeout_s)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.election.identity:
            return False
        body = {**lease, "spec": released_spec(lease, datetime.datetime.now(datetime.UTC))}
        try:
            self.api.request("PUT", self.election.path, body=body, timeout=timeout_s)
        except ApiException as exc:
            if exc.status == 409:  # changed meanwhile: not ours to release any more
                return False
            raise
        log.info("%s released the Lease %s", self.election.identity, self.election.name)
        return True


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


def wait_for_leadership(lease: LeaseClient) -> None:
    """Block until this replica holds the Lease."""
    election = lease.election
    announced = False
    while True:
        try:
            if lease.try_to_lead(timeout_s=election.retry_every_s * 5):
                log.info("%s leads (Lease %s/%s)", election.identity, election.namespace, election.name)
                return
        except Exception as exc:  # the API server may be briefly unreachable: keep trying
            log.warning("leader election: %s", exc)
        if not announced:
            log.info("%s is a standby: another replica holds the Lease %s", election.identity, election.name)
            announced = True
        time.sleep(election.retry_every_s)


_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets, unsent data dropped


def reset_connections_on_close(fd_dir: str = "/proc/self/fd") -> int:
    """Make closing every TCP connection of this process reset it and drop what was not yet sent.

    A leader whose connection to the API server stalls may have requests (a pod create, a patch)
    still queued in its sockets when it exits; with an ordinary close the kernel keeps sending them,
    and they reach the API server whenever the connection flows again, after a standby has taken
    over. With SO_LINGER 0 they die with the process, whoever opened the socket (our client, kopf's
    aiohttp). Returns how many connections it set."""
    count = 0
    for name in os.listdir(fd_dir):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):  # not a socket, or closed meanwhile
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays its owner's
    return count


def exit_fenced() -> None:
    """Leave at once, taking every request still queued in a socket with us (see above)."""
    try:
        count = reset_connections_on_close()
        log.error("exiting: %d connections reset, nothing queued in them will reach the API server", count)
    finally:
        os._exit(1)


class Leadership:
    """The held Lease, renewed in the background. If it cannot be renewed before another replica
    could take it (two thirds of its duration, timed on this replica's monotonic clock), `on_lost`
    runs at once: by default the process exits, so every loop of this operator stops and the replica
    never acts without the Lease; its container restarts as a standby. Every renewal is bounded by
    the time left before that deadline, so a stalled API connection cannot hold it past it."""

    def __init__(self, lease: LeaseClient, on_lost: Callable[[], None] | None = None):
        self.lease = lease
        self.on_lost = on_lost or exit_fenced
        self.deadline_s = lease.election.lease_duration_s * 2 / 3
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)

    def start(self) -> Leadership:
        self.thread.start()
        return self

    def _renew(self) -> None:
        election = self.lease.election
        last = time.monotonic()
        while not self._stop.wait(election.renew_every_s):
            left = self.deadline_s - (time.monotonic() - last)
            try:
                if left > 0 and self.lease.try_to_lead(timeout_s=left):
                    last = time.monotonic()
                    continue
                if left > 0:
                    log.error("the Lease %s was taken by another replica", election.name)
            except Exception as exc:
                log.warning("renewing the Lease failed: %s", exc)
                if self.deadline_s - (time.monotonic() - last) > 0:
                    continue
            if self._stop.is_set():
                return
            log.error("leadership lost: exiting so that only the Lease's holder acts")
            self.on_lost()
            return

    def release(self) -> None:
        """Stop renewing and give the Lease up (shutdown): a standby takes over at once."""
        self._stop.set()
        self.thread.join(timeout=self.lease.election.renew_every_s + self.deadline_s)
        try:
            self.lease.release()
        except Exception as exc:  # shutting down anyway: the Lease then expires on its own
            log.warning("releasing the Lease failed: %s", exc)
