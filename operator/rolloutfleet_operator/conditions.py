"""The fleet's status, following the Kubernetes API conventions: pure functions of what was observed.

Condition types (each carries `observedGeneration`; `lastTransitionTime` moves only when the
status does):
- `ProxiesReady`: every proxy ordinal below spec.proxy.replicas has a Ready pod.
- `GatewayReady`: the gateway Deployment has all its replicas ready.
- `EnginesReady`: the engine Deployment has all its replicas ready; True with reason NotManaged
  when the engines run elsewhere (spec.externalEngineUrls).
- `Progressing`: True while proxies are being created, scaled, rolled or are coming up.
- `ReplicaFailure`: True while a proxy pod is Failed, crash-looping or cannot start (image pull,
  bad config), or a child (a proxy pod, or a Service, Deployment or RBAC object the API server
  refused) could not be created or applied; the message names them.
- `Ready`: the summary: ProxiesReady, GatewayReady and EnginesReady are True and ReplicaFailure is not.

Conditions of other types in the previous list (e.g. the memory watchdog's) are kept as they are:
a status patch replaces the whole list, so dropping them here would erase them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .fleet import Fleet, gateway_url, proxy_public_url, selector_string
from .plan import ProxyPodView

Status = Literal["True", "False", "Unknown"]

READY = "Ready"
PROXIES_READY = "ProxiesReady"
GATEWAY_READY = "GatewayReady"
ENGINES_READY = "EnginesReady"
PROGRESSING = "Progressing"
REPLICA_FAILURE = "ReplicaFailure"
FLEET_CONDITION_TYPES = (READY, PROXIES_READY, GATEWAY_READY, ENGINES_READY, PROGRESSING, REPLICA_FAILURE)

# A pod not Ready after this many restarts of its proxy container counts as crash-looping.
CRASHLOOP_RESTARTS = 3
# Waiting reasons of a container that will not start without a change.
FAILING_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
MAX_NAMES_IN_MESSAGE = 5


@dataclass(frozen=True)
class Condition:
    type: str
    status: Status
    reason: str  # CamelCase
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
            "observedGeneration": self.observed_generation,
        }


def set_condition(existing: Sequence[dict[str, Any]], new: Condition, now: str) -> list[dict[str, Any]]:
    """`existing` with `new` in place of the condition of its type (appended if absent).

    lastTransitionTime stays the existing one when the status did not change (reason, message and
    observedGeneration are updated regardless), and is `now` when it did or the type is new.
    """
    result = [dict(c) for c in existing]
    for index, old in enumerate(result):
        if old.get("type") == new.type:
            kept = old.get("lastTransitionTime") if old.get("status") == new.status else None
            entry = new.to_dict()
            entry["lastTransitionTime"] = kept or now
            result[index] = entry
            return result
    entry = new.to_dict()
    entry["lastTransitionTime"] = now
    result.append(entry)
    return result


@dataclass(frozen=True)
class ObservedState:
    """What the reconciler saw on one pass (filled from listed pods and Deployments)."""

    desired_proxies: int
    proxies: tuple[ProxyPodView, ...]  # pods whose name is `<fleet>-proxy-<i>`, any ordinal
    current_hash: str  # manifests.proxy_pod.template_hash(fleet)
    gateway_ready: int = 0  # the gateway Deployment's status.readyReplicas (0 when not found)
    gateway_desired: int = 1  # spec.gateway.replicas
    engines_ready: int | None = None  # None when the engines are external
    engines_desired: int | None = None
    create_failures: tuple[str, ...] = ()  # "<pod>: <error>" for proxy pods the API refused to create
    engine_endpoints: tuple[str, ...] = ()  # URLs of Ready engine pods, or the external engine URLs

    @property
    def live(self) -> list[ProxyPodView]:
        return [p for p in self.proxies if p.live]

    @property
    def replicas(self) -> int:
        """Proxy pods that exist and are neither terminating nor down."""
        return len(self.live)

    @property
    def ready_replicas(self) -> int:
        return sum(1 for p in self.live if p.ready)

    @property
    def updated_replicas(self) -> int:
        """Live proxy pods built from the current template."""
        return sum(1 for p in self.live if p.template_hash == self.current_hash)


def failing_pods(pods: Sequence[ProxyPodView]) -> list[tuple[ProxyPodView, str]]:
    """Proxy pods that are down or will not come up without help, with a short description."""
    failing = []
    for pod in sorted(pods, key=lambda p: p.ordinal):
        if pod.deleting:
            continue
        if pod.phase == "Failed":
            failing.append((pod, "Failed"))
        elif not pod.ready and pod.waiting_reason in FAILING_WAITING_REASONS:
            failing.append((pod, f"{pod.waiting_reason}, {pod.restart_count} restarts"))
        elif not pod.ready and pod.restart_count >= CRASHLOOP_RESTARTS:
            failing.append((pod, f"not ready after {pod.restart_count} restarts"))
    return failing


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_NAMES_IN_MESSAGE])
    more = len(items) - MAX_NAMES_IN_MESSAGE
    return f"{shown} and {more} more" if more > 0 else shown


def _proxies_ready(observed: ObservedState) -> Condition:
    desired = observed.desired_proxies
    ready = {p.ordinal for p in observed.live if p.ready and p.ordinal < desired}
    if desired == 0:
        return Condition(PROXIES_READY, "True", "ScaledToZero", "no proxies wanted")
    if len(ready) == desired:
        return Condition(PROXIES_READY, "True", "AllReady", f"{desired}/{desired} proxies ready")
    wanted = {p.ordinal: p for p in observed.proxies if p.ordinal < desired}
    not_ready = [pod.name for ordinal, pod in sorted(wanted.items()) if ordinal not in ready]
    message = f"{len(ready)}/{desired} proxies ready"
    if not_ready:
        message += f"; not ready: {_names(not_ready)}"
    if len(wanted) < desired:
        message += f"; {desired - len(wanted)} not created yet"
    return Condition(PROXIES_READY, "False", "NotAllReady", message)


def _replicas_ready(type_: str, what: str, ready: int, desired: int) -> Condition:
    message = f"{ready}/{desired} {what} replicas ready"
    if desired == 0:
        return Condition(type_, "True", "ScaledToZero", f"no {what} replicas wanted")
    if ready >= desired:
        return Condition(type_, "True", "AllReady", message)
    return Condition(type_, "False", "NotAllReady", message)


def _engines_ready(observed: ObservedState) -> Condition:
    if observed.engines_desired is None:
        return Condition(ENGINES_READY, "True", "NotManaged", "the engines run outside the fleet")
    return _replicas_ready(ENGINES_READY, "engine", observed.engines_ready or 0, observed.engines_desired)


def _progressing(observed: ObservedState) -> Condition:
    desired = observed.desired_proxies
    present = {p.ordinal for p in observed.proxies}
    terminating = [p.name for p in observed.proxies if p.deleting]
    updated, ready = observed.updated_replicas, observed.ready_replicas
    if any(p.ordinal >= desired for p in observed.live):
        return Condition(PROGRESSING, "True", "ScalingDown", f"scaling down to {desired} proxies")
    if any(i not in present for i in range(desired)):
        return Condition(PROGRESSING, "True", "ScalingUp", f"{len(present)}/{desired} proxies created")
    if updated != desired:
        return Condition(PROGRESSING, "True", "RollingUpdate", f"{updated}/{desired} proxies updated")
    if ready != desired:
        return Condition(PROGRESSING, "True", "WaitingForReady", f"{ready}/{desired} proxies ready")
    if terminating:
        return Condition(PROGRESSING, "True", "Terminating", f"waiting for {_names(sorted(terminating))}")
    return Condition(PROGRESSING, "False", "Complete", f"all {desired} proxies updated and ready")


def _replica_failure(observed: ObservedState) -> Condition:
    failing = failing_pods(observed.proxies)
    parts = [f"{pod.name} ({what})" for pod, what in failing] + list(observed.create_failures)
    if not parts:
        return Condition(REPLICA_FAILURE, "False", "NoFailures", "")
    if observed.create_failures:
        reason = "FailedCreate"
    elif any(pod.phase == "Failed" for pod, _ in failing):
        reason = "PodFailed"
    else:
        reason = "CrashLoop"
    return Condition(REPLICA_FAILURE, "True", reason, f"failing proxy pods: {_names(parts)}")


def _ready(components: Sequence[Condition], failure: Condition) -> Condition:
    blocking = [c for c in components if c.status != "True"]
    if failure.status == "True":
        blocking.append(failure)
    if not blocking:
        return Condition(READY, "True", "AllComponentsReady", "proxies, gateway and engines are ready")
    first = blocking[0]
    reason = REPLICA_FAILURE if first.type == REPLICA_FAILURE else first.type.replace("Ready", "NotReady")
    return Condition(READY, "False", reason, "; ".join(f"{c.type}: {c.message}" for c in blocking))


def fleet_conditions(
    observed: ObservedState, generation: int, now: str, previous: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`previous` with the fleet's condition types set from `observed` (other types kept as they are)."""
    proxies = _proxies_ready(observed)
    gateway = _replicas_ready(GATEWAY_READY, "gateway", observed.gateway_ready, observed.gateway_desired)
    engines = _engines_ready(observed)
    failure = _replica_failure(observed)
    computed = [_ready((proxies, gateway, engines), failure), proxies, gateway, engines]
    computed += [_progressing(observed), failure]
    result = [dict(c) for c in previous]
    for condition in computed:
        stamped = Condition(
            condition.type, condition.status, condition.reason, condition.message, "", generation
        )
        result = set_condition(result, stamped, now)
    return result


def fleet_status(
    fleet: Fleet, observed: ObservedState, now: str, previous_conditions: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The whole status the reconciler writes (memoryRestarts is the watchdog's and is left out).

    Only fields of the CRD's status schema, so the API server prunes nothing and the written status
    reads back equal (no endless update loop).
    """
    endpoints = [
        proxy_public_url(fleet, p.ordinal)
        for p in sorted(observed.live, key=lambda p: p.ordinal)
        if p.ready and p.ordinal < observed.desired_proxies
    ]
    return {
        "observedGeneration": fleet.generation,
        "replicas": observed.replicas,
        "readyReplicas": observed.ready_replicas,
        "updatedReplicas": observed.updated_replicas,
        "selector": selector_string(fleet, "proxy"),
        "gatewayUrl": gateway_url(fleet),
        "proxyEndpoints": endpoints,
        "engineEndpoints": list(observed.engine_endpoints),
        "conditions": fleet_conditions(observed, fleet.generation, now, previous_conditions),
    }
