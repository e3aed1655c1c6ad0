"""The fleet's status, following the Kubernetes API conventions: pure functions of what was observed.

Condition types (each carries `observedGeneration`; `lastTransitionTime` moves only when the
status does):
- `Available`: True while enough proxies serve: at least desired - maxUnavailable of the wanted
  ones (the number the PodDisruptionBudget keeps, and never fewer than 1) are Ready, and the gateway
  Deployment is Available. It stays True through a roll step or a memory restart.
- `ProxiesReady`: every proxy ordinal below spec.proxy.replicas has a Ready pod.
- `GatewayReady`: the gateway Deployment has all its replicas ready; when not, the message says
  why its pods do not serve (pod_problems.py).
- `EnginesReady`: the same for the engine Deployment; True with reason NotManaged when the engines
  run elsewhere (spec.externalEngineUrls).
- `Progressing`: True while proxies are being created, scaled, rolled, replaced or are coming up.
- `ReplicaFailure`: True while a proxy pod cannot serve without a change (unschedulable, a missing
  claim, a failed mount, an image that cannot be pulled, a bad config, a crash loop, Failed), or a
  child (a proxy pod, or a Service, Deployment or RBAC object the API server refused) could not be
  created or applied; the message names them with the cause.
- `Ready`: the summary: ProxiesReady, GatewayReady and EnginesReady are True and ReplicaFailure is not.

The reconciler owns these types and writes them with server-side apply; the memory watchdog owns
its own (MemoryPressure, StorageWritable), so `fleet_conditions` returns the fleet's types only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .fleet import Fleet, gateway_url, proxy_public_url, selector_string
from .plan import ProxyPodView
from .pod_problems import PodProblem, describe

Status = Literal["True", "False", "Unknown"]

READY = "Ready"
AVAILABLE = "Available"
PROXIES_READY = "ProxiesReady"
GATEWAY_READY = "GatewayReady"
ENGINES_READY = "EnginesReady"
PROGRESSING = "Progressing"
REPLICA_FAILURE = "ReplicaFailure"
FLEET_CONDITION_TYPES = (
    READY,
    AVAILABLE,
    PROXIES_READY,
    GATEWAY_READY,
    ENGINES_READY,
    PROGRESSING,
    REPLICA_FAILURE,
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


def condition_entry(new: Condition, previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """`new` as a status entry: its lastTransitionTime is the one of the same type in `previous` when
    the status did not change (reason, message and observedGeneration are new regardless), else `now`."""
    entry = new.to_dict()
    old = next((c for c in previous if c.get("type") == new.type), None)
    kept = old.get("lastTransitionTime") if old is not None and old.get("status") == new.status else None
    entry["lastTransitionTime"] = kept or now
    return entry


def set_condition(existing: Sequence[dict[str, Any]], new: Condition, now: str) -> list[dict[str, Any]]:
    """`existing` with `new` in place of the condition of its type (appended if absent), stamped as
    `condition_entry` does."""
    entry = condition_entry(new, existing, now)
    result = [dict(c) for c in existing]
    for index, old in enumerate(result):
        if old.get("type") == new.type:
            result[index] = entry
            return result
    result.append(entry)
    return result


@dataclass(frozen=True)
class ObservedState:
    """What the reconciler saw on one pass (filled from the cached pods and Deployments)."""

    desired_proxies: int
    proxies: tuple[ProxyPodView, ...]  # pods whose name is `<fleet>-proxy-<i>`, any ordinal
    current_hash: str  # manifests.proxy_pod.template_hash(fleet)
    gateway_ready: int = 0  # the gateway Deployment's status.readyReplicas (0 when not found)
    gateway_desired: int = 1  # spec.gateway.replicas
    engines_ready: int | None = None  # None when the engines are external
    engines_desired: int | None = None
    create_failures: tuple[str, ...] = ()  # "<child>: <error>" for children the API refused
    engine_endpoints: tuple[str, ...] = ()  # URLs of Ready engine pods, or the external engine URLs
    max_unavailable: int = 1  # spec.proxy.memory.maxUnavailable (the proxies' PodDisruptionBudget)
    gateway_available: bool | None = None  # the gateway Deployment's Available condition; None: unknown
    gateway_problems: tuple[PodProblem, ...] = ()  # why gateway pods do not serve
    engine_problems: tuple[PodProblem, ...] = ()

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

    @property
    def ready_wanted(self) -> int:
        """Wanted ordinals (below desired) with a live Ready pod."""
        return len({p.ordinal for p in self.live if p.ready and p.ordinal < self.desired_proxies})

    @property
    def min_available(self) -> int:
        """The Ready proxies the fleet needs to count as Available."""
        if self.desired_proxies == 0:
            return 0
        return max(1, self.desired_proxies - self.max_unavailable)


def failing_pods(pods: Sequence[ProxyPodView]) -> list[PodProblem]:
    """Why proxy pods do not serve and will not without help, by ordinal (terminating pods aside)."""
    return [
        pod.problem
        for pod in sorted(pods, key=lambda p: p.ordinal)
        if pod.problem is not None and not pod.deleting
    ]


def deployment_available(deployment: Mapping[str, Any] | None) -> bool:
    """The Deployment controller's own verdict (its Available condition: enough replicas Ready for
    minReadySeconds, by its strategy's maxUnavailable); without conditions yet, one Ready replica."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Available":
            return bool(condition.get("status") == "True")
    return int(status.get("readyReplicas") or 0) >= 1


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


def _replicas_ready(
    type_: str, what: str, ready: int, desired: int, problems: Sequence[PodProblem] = ()
) -> Condition:
    """A Deployment's readiness; when short, the reason and message say why its pods do not serve."""
    message = f"{ready}/{desired} {what} replicas ready"
    if desired == 0:
        return Condition(type_, "True", "ScaledToZero", f"no {what} replicas wanted")
    if ready >= desired:
        return Condition(type_, "True", "AllReady", message)
    if problems:
        return Condition(type_, "False", problems[0].reason, f"{message}; {describe(problems)}")
    return Condition(type_, "False", "NotAllReady", message)


def _engines_ready(observed: ObservedState) -> Condition:
    if observed.engines_desired is None:
        return Condition(ENGINES_READY, "True", "NotManaged", "the engines run outside the fleet")
    return _replicas_ready(
        ENGINES_READY,
        "engine",
        observed.engines_ready or 0,
        observed.engines_desired,
        observed.engine_problems,
    )


def _available(observed: ObservedState, gateway: Condition) -> Condition:
    ready, needed = observed.ready_wanted, observed.min_available
    gateway_available = (
        observed.gateway_available if observed.gateway_available is not None else gateway.status == "True"
    )
    proxies = f"{ready}/{observed.desired_proxies} proxies ready (at least {needed} needed)"
    if ready < needed:
        return Condition(AVAILABLE, "False", "ProxiesUnavailable", proxies)
    if not gateway_available:
        return Condition(AVAILABLE, "False", "GatewayUnavailable", f"the gateway is not available; {proxies}")
    return Condition(AVAILABLE, "True", "MinimumProxiesAvailable", f"{proxies}; the gateway is available")


def _progressing(observed: ObservedState) -> Condition:
    """What the proxies are doing, the most telling first: a roll (a live wanted pod built from an
    older template), a scale-down, pods terminating (a roll step, a memory restart, a deletion by
    hand: their replacements follow), wanted ordinals without a pod (being created), pods coming up."""
    desired = observed.desired_proxies
    present = {p.ordinal for p in observed.proxies}
    # A roll step's pod is outdated while it terminates, too.
    outdated = [
        p
        for p in observed.proxies
        if p.ordinal < desired and not p.down and p.template_hash != observed.current_hash
    ]
    terminating = sorted(p.name for p in observed.proxies if p.deleting)
    missing = [i for i in range(desired) if i not in present]
    if outdated:
        updated = sum(
            1 for p in observed.live if p.ordinal < desired and p.template_hash == observed.current_hash
        )
        return Condition(PROGRESSING, "True", "RollingUpdate", f"{updated}/{desired} proxies updated")
    if any(p.ordinal >= desired for p in observed.live):
        return Condition(PROGRESSING, "True", "ScalingDown", f"scaling down to {desired} proxies")
    if terminating:
        message = f"waiting for {_names(terminating)} to terminate; replacements follow"
        return Condition(PROGRESSING, "True", "Terminating", message)
    if missing:
        message = f"creating {len(missing)} of {desired} proxies"
        return Condition(PROGRESSING, "True", "CreatingProxies", message)
    if observed.ready_wanted != desired:
        return Condition(
            PROGRESSING, "True", "WaitingForReady", f"{observed.ready_wanted}/{desired} proxies ready"
        )
    return Condition(PROGRESSING, "False", "Complete", f"all {desired} proxies updated and ready")


def _replica_failure(observed: ObservedState) -> Condition:
    problems = failing_pods(observed.proxies)
    if not problems and not observed.create_failures:
        return Condition(REPLICA_FAILURE, "False", "NoFailures", "")
    parts = []
    if observed.create_failures:
        parts.append(f"refused: {_names(list(observed.create_failures))}")
    if problems:
        parts.append(describe(problems))
    reason = "FailedCreate" if observed.create_failures else problems[0].reason
    return Condition(REPLICA_FAILURE, "True", reason, "; ".join(parts))


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
    observed: ObservedState, generation: int, now: str, previous: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The fleet's condition types, set from `observed` (lastTransitionTime kept from `previous`
    where the status holds). Other types in `previous` are not returned: their writer owns them."""
    proxies = _proxies_ready(observed)
    gateway = _replicas_ready(
        GATEWAY_READY, "gateway", observed.gateway_ready, observed.gateway_desired, observed.gateway_problems
    )
    engines = _engines_ready(observed)
    failure = _replica_failure(observed)
    computed = [
        _ready((proxies, gateway, engines), failure),
        _available(observed, gateway),
        proxies,
        gateway,
        engines,
        _progressing(observed),
        failure,
    ]
    return [
        condition_entry(Condition(c.type, c.status, c.reason, c.message, "", generation), previous, now)
        for c in computed
    ]


def fleet_status(
    fleet: Fleet, observed: ObservedState, now: str, previous_conditions: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The status fields the reconciler owns (memoryRestarts and the watchdog's conditions are the
    watchdog's): what it applies.

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
        "readyOfDesired": f"{observed.ready_wanted}/{observed.desired_proxies}",
        "selector": selector_string(fleet, "proxy"),
        "gatewayUrl": gateway_url(fleet),
        "proxyEndpoints": endpoints,
        "engineEndpoints": list(observed.engine_endpoints),
        "conditions": fleet_conditions(observed, fleet.generation, now, previous_conditions),
    }
