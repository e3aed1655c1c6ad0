"""`python -m rolloutfleet_operator`: the kopf operator that keeps RolloutFleets true."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from typing import cast

import aiohttp
import kopf

from . import metrics
from .events import EventRecorder
from .fleet import COMPONENT_LABEL, FLEET_LABEL, MANAGED_BY_LABEL, MANAGER
from .fleet_loop import FleetLoops
from .kubeapi import RESOURCES, KubeApi, load_configuration
from .leadership import Election, Leadership, LeaseClient, StandbyHealth, wait_for_leadership
from .lost_proxies import lost_message
from .memory_watchdog import FleetWatchdog
from .pacing import TokenBucket
from .pass_events import pass_events
from .plan import PodSignal, pod_event_needs_pass, pod_signal
from .reconcile import Reconciler
from .watch_cache import CACHED_KINDS, OWNED_LABELS, FleetStore, KindKey, OwnedObjects, by_fleet, index_id

GROUP, VERSION, PLURAL = "rolloutfleet.dev", "v1alpha1", "rolloutfleets"
RESYNC_SECONDS = 10.0
# The client-side rate limit of the operator's own requests (kopf's watches and Events aside), as
# controller-runtime's defaults: enough for a roll of many fleets at once, never a flood.
API_QPS = 20.0
API_BURST = 30
log = logging.getLogger("rolloutfleet.operator")

_reconciler: Reconciler | None = None
_events: EventRecorder | None = None
_loops: FleetLoops | None = None
_pod_signals: dict[str, PodSignal] = {}  # proxy pod uid -> its signal as last seen
# Watching listed namespaces only: kopf need not (and, least-privileged, cannot) list namespaces.
_static_namespaces = False
_api_rate = (API_QPS, API_BURST)

# The proxy pods whose events run their fleet's pass (a client-side filter: the watch itself
# selects every pod the operator manages, engine pods included, for the pod cache).
WATCHED_POD_LABELS = {MANAGED_BY_LABEL: MANAGER, COMPONENT_LABEL: "proxy"}


def _resource(kind: KindKey) -> tuple[str, str, str]:
    """(group, version, plural) of a kind, as kopf names resources."""
    api_version, _ = kind
    group, _, version = api_version.rpartition("/")
    return group, version, RESOURCES[kind]


def select_owned_objects(settings: kopf.OperatorSettings) -> None:
    """The API server filters the cached kinds' watches by the managed-by label, so the operator is
    not sent every pod or Service of the cluster (kopf's `labels=` filters only client-side)."""
    selector = ",".join(f"{key}={value}" for key, value in sorted(OWNED_LABELS.items()))
    for kind in CACHED_KINDS:
        settings.watching.label_selectors[_resource(kind)] = selector


def _index_owned(body: kopf.Body, **_) -> dict:
    return by_fleet(body)


for _kind in CACHED_KINDS:  # one kopf index per cached kind, handed to the reconciler at startup
    kopf.index(*_resource(_kind), id=index_id(_kind), labels=OWNED_LABELS)(_index_owned)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **kwargs) -> None:
    """kwargs: the indexes (kopf hands them to every handler, created empty before startup and
    filled before any other handler runs)."""
    global _reconciler, _loops, _events
    select_owned_objects(settings)
    # Handler progress and diff bases go to annotations: the CRD's status schema would prune
    # kopf's default status fields, and a pruned write reads back different, so kopf would loop.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rolloutfleet.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="rolloutfleet.dev")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    # Without this, kopf spends ~1 minute of retries on a namespace list it is not allowed.
    settings.scanning.disabled = _static_namespaces
    configuration = await asyncio.to_thread(load_configuration, None)
    api = KubeApi(configuration, TokenBucket(*_api_rate))
    fleets = FleetStore()
    owned = OwnedObjects({kind: kwargs[index_id(kind)] for kind in CACHED_KINDS})
    _reconciler = Reconciler(api, fleets, owned)
    _events = EventRecorder(api)
    _loops = FleetLoops(_background_pass, _make_watchdog, RESYNC_SECONDS, fleets)


async def _pass(body: kopf.Body) -> bool:
    """One pass and its Events; whether it did all it meant to (no child refused)."""
    assert _reconciler is not None
    fleet = (body["metadata"]["namespace"], body["metadata"]["name"])
    started = time.perf_counter()
    try:
        result = await _reconciler.reconcile(dict(body))
    except Exception:
        metrics.RECONCILE_ERRORS.labels(*fleet).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.labels(*fleet).observe(time.perf_counter() - started)
    assert _events is not None
    for event_type, reason, message in pass_events(result):
        await _events.post_event(body, event_type, reason, message)
    for lost in result.lost:  # also on the pod, where `kubectl describe pod` shows it
        await _events.post_event(
            _pod_ref(body, lost.pod, lost.uid), "Warning", "ProxyLost", lost_message(lost)
        )
    return not result.failures


def _pod_ref(fleet: kopf.Body, name: str, uid: str) -> dict:
    """An Event's involvedObject for a pod of the fleet known by name and uid."""
    meta = {"name": name, "namespace": fleet["metadata"]["namespace"], "uid": uid}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(body: kopf.Body, **_) -> None:
    await _pass(body)


@kopf.on.event("", "v1", "pods", labels=WATCHED_POD_LABELS)
async def on_proxy_pod_event(event: kopf.RawEvent, body: kopf.Body, **_) -> None:
    """A proxy pod that is gone or failed is replaced now, and a change of its readiness or of why it
    is stuck is reflected now (status, rolls), not at the next periodic pass: the fleet's loop runs
    a pass at once, one for a burst of such events (fleet_loop.py)."""
    uid = body["metadata"]["uid"]
    seen = _pod_signals.get(uid)
    if event.get("type") == "DELETED":
        _pod_signals.pop(uid, None)
    else:
        _pod_signals[uid] = pod_signal(body)
    if not pod_event_needs_pass(event.get("type"), body, seen):
        return
    assert _loops is not None
    fleet_name = (body["metadata"].get("labels") or {}).get(FLEET_LABEL)
    if fleet_name:
        _loops.wake(body["metadata"]["namespace"], fleet_name)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track_fleet(event: kopf.RawEvent, body: kopf.Body, **_) -> None:
    """Every fleet event feeds its background loop (periodic pass and memory watchdog; see
    fleet_loop.py for why these are not kopf timers and daemons: no finalizer)."""
    assert _loops is not None and _reconciler is not None
    _loops.observe(event.get("type"), body)
    if event.get("type") == "DELETED":
        _reconciler.forget(body["metadata"]["namespace"], body["metadata"]["name"])


async def _make_watchdog(key: tuple[str, str]):
    assert _reconciler is not None and _events is not None
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    watchdog = FleetWatchdog(
        _reconciler.api,
        _reconciler.fleets,
        _reconciler.owned,
        http,
        _events.post_event,
        _reconciler.lock_for(*key),
    )
    return watchdog, http.close


async def _background_pass(body: dict) -> bool:
    return await _pass(kopf.Body(cast(kopf.RawBody, body)))


@kopf.on.cleanup()
async def stop_background(**_) -> None:
    if _loops is not None:
        await _loops.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rolloutfleet-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--metrics-port", type=int, default=8080, help="port of Prometheus /metrics")
    parser.add_argument("--health-port", type=int, default=8081, help="port of the liveness probe /healthz")
    parser.add_argument(
        "--bind-address", default="0.0.0.0", help="address the metrics and health servers listen on"
    )
    parser.add_argument(
        "--leader-election",
        action="store_true",
        help="run only while holding a Lease (for more than one replica); standbys wait for it",
    )
    parser.add_argument(
        "--leader-election-namespace", default=None, help="the Lease's namespace (default: POD_NAMESPACE)"
    )
    parser.add_argument("--leader-election-id", default="rolloutfleet-operator", help="the Lease's name")
    parser.add_argument(
        "--api-qps", type=float, default=API_QPS, help="the operator's API requests per second, sustained"
    )
    parser.add_argument("--api-burst", type=int, default=API_BURST, help="... and in a burst")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    global _static_namespaces, _api_rate
    _static_namespaces = not args.all_namespaces
    _api_rate = (args.api_qps, args.api_burst)
    port = metrics.serve(args.metrics_port, args.bind_address)
    log.info("serving /metrics on %s:%d", args.bind_address, port)
    leadership = lead(args) if args.leader_election else None
    try:
        kopf.run(
            standalone=True,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or (),  # kopf reads only its truth: () as None
            liveness_endpoint=f"http://{args.bind_address}:{args.health_port}/healthz",
        )
    finally:
        if leadership is not None:  # stopped (SIGTERM): hand the Lease over instead of letting it expire
            leadership.release()
    return 0


def lead(args: argparse.Namespace) -> Leadership:
    """Block until this replica holds the Lease (answering health probes meanwhile), then keep it."""
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace:
        raise SystemExit("--leader-election needs --leader-election-namespace or POD_NAMESPACE")
    identity = os.environ.get("POD_NAME") or socket.gethostname()
    election = Election(namespace=namespace, name=args.leader_election_id, identity=identity)
    lease = LeaseClient(KubeApi(load_configuration(None)), election)
    standby = StandbyHealth(args.bind_address, args.health_port)
    try:
        wait_for_leadership(lease)
    finally:
        standby.close()
    return Leadership(lease).start()
