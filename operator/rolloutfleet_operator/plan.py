"""What the reconciler does next with the proxy pods: a pure decision from what it observed.

Proxy pods have stable names (`<fleet>-proxy-<i>`) and are managed one by one, not by a
StatefulSet, so that the reconciler and the memory watchdog share one view and one set of rules.
`plan_proxies` is called on every pass and returns what to do now; the next pass (triggered by
the resulting pod events, or a timer) sees the outcome and plans again. Level-triggered: it never
remembers anything between passes.

Rules, in order (a "terminating" pod has a deletionTimestamp; a "down" pod is Failed or Succeeded,
which with restartPolicy Always means it was evicted or its node lost it, and it will not come back):

1. Create every missing ordinal below `desired` at once. A name is missing when no pod holds it;
   a terminating pod still holds its name, so its replacement is created on a later pass, once it
   is gone (the replacement then restores its predecessor's dumps from the same subdirectory).
2. Delete every down pod (any ordinal): it holds its name but serves nothing; the pass after its
   deletion recreates it under the same name (rule 1).
3. Scale down: delete every live pod with ordinal >= `desired`, listed highest ordinal first.
   Removing pods that are leaving anyway never lowers the availability of the ones that stay, so
   they go together rather than one drain at a time.
4. Replace outdated pods (template hash differs from the current one) that are not Ready: they
   serve nothing, so replacing them (all at once) costs no availability, and it is how a rollout
   that broke every pod (a bad image) is repaired by fixing the spec.
5. Roll: only when rules 1-4 have nothing left to do, every ordinal below `desired` exists, is
   Ready and not terminating, and no other pod is terminating, delete exactly one outdated Ready
   pod, the lowest ordinal first. The next one follows when its replacement is Ready.

Rules 1-4 may act in the same pass (none of them takes a serving pod of the wanted set down);
rule 5 is the only disruptive action and happens at most once per pass, never while another pod
is not Ready or terminating.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .fleet import TEMPLATE_HASH_ANNOTATION
from .pod_problems import PodProblem, pod_problem

DOWN_PHASES = frozenset({"Failed", "Succeeded"})


@dataclass(frozen=True)
class ProxyPodView:
    """What the reconciler needs to know about one proxy pod."""

    name: str
    ordinal: int
    ready: bool
    phase: str = "Pending"
    restart_count: int = 0
    template_hash: str | None = None
    deleting: bool = False
    waiting_reason: str | None = None  # the proxy container's state.waiting.reason, if waiting
    problem: PodProblem | None = None  # why it does not serve and will not without help (pod_problems.py)
    uid: str = ""
    node: str | None = None  # spec.nodeName: the node it is bound to, None before scheduling
    # metadata.deletionTimestamp as epoch seconds: when its grace period ends (None: not deleted)
    deletion_deadline: float | None = None

    @property
    def down(self) -> bool:
        return self.phase in DOWN_PHASES

    @property
    def live(self) -> bool:
        """Holds a running (or starting) pod that is not on its way out."""
        return not self.deleting and not self.down


# What of a proxy pod its fleet's status and rolls depend on: whether it is Ready, and the reason it
# is stuck (pod_problems: Unschedulable, ClaimNotFound, ImagePullFailed...), or None.
PodSignal = tuple[bool, str | None]


def pod_signal(pod: Mapping[str, Any]) -> PodSignal:
    problem = pod_problem(pod)
    return is_ready(pod), problem.reason if problem else None


def pod_event_needs_pass(event_type: str | None, pod: Mapping[str, Any], seen: PodSignal | None) -> bool:
    """Whether a proxy pod's watch event should run its fleet's pass at once rather than at the next
    periodic one: the pod is gone or Failed (replace it now), or its readiness or the reason it is
    stuck changed (a roll waits for it; the status should say so within a pass, not a resync later).
    `seen` is the pod's signal when last seen (None: never seen, e.g. the operator's first listing,
    which the resume pass covers)."""
    if event_type == "DELETED" or (pod.get("status") or {}).get("phase") == "Failed":
        return True
    return seen is not None and pod_signal(pod) != seen


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def ready_pod_urls(pods: Iterable[Mapping[str, Any]], port: int) -> list[str]:
    """`http://<podIP>:<port>` of the Ready pods that are not being deleted, sorted by pod name (the
    engines a trainer pauses and updates directly)."""
    urls = []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        ip = (pod.get("status") or {}).get("podIP")
        if ip and is_ready(pod) and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            urls.append(f"http://{ip}:{port}")
    return urls


def proxy_pod_view(pod: Mapping[str, Any], ordinal: int, container: str = "proxy") -> ProxyPodView:
    """The view of a pod as the API returns it (camelCase dict); the caller gives the ordinal
    (parsed from the name with `fleet.proxy_ordinal`)."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ready = is_ready(pod)
    restarts = 0
    waiting = None
    for entry in status.get("containerStatuses") or ():
        if entry.get("name") == container:
            restarts = int(entry.get("restartCount") or 0)
            waiting = ((entry.get("state") or {}).get("waiting") or {}).get("reason")
    return ProxyPodView(
        name=metadata.get("name") or "",
        ordinal=ordinal,
        ready=ready,
        phase=status.get("phase") or "Pending",
        restart_count=restarts,
        template_hash=(metadata.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION),
        deleting=metadata.get("deletionTimestamp") is not None,
        waiting_reason=waiting,
        problem=pod_problem(pod),
        uid=metadata.get("uid") or "",
        node=(pod.get("spec") or {}).get("nodeName") or None,
        deletion_deadline=epoch_seconds(metadata.get("deletionTimestamp")),
    )


def epoch_seconds(timestamp: str | None) -> float | None:
    """An API timestamp (RFC 3339, e.g. `2025-01-02T03:04:05Z`) as epoch seconds; None for None
    or an unreadable one."""
    if not timestamp:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


@dataclass(frozen=True)
class Deletion:
    name: str
    ordinal: int
    reason: str  # "Down" | "ScaleDown" | "ReplaceOutdated" | "RollingUpdate" (usable as an Event reason)


# Deletions of Ready proxies by choice (not failures, not a scale-down the user asked for): these go
# through the Eviction API and so honour the fleet's PodDisruptionBudget.
VOLUNTARY_DISRUPTIONS = frozenset({"RollingUpdate"})


@dataclass(frozen=True)
class Plan:
    create: tuple[int, ...] = ()  # ordinals to create, ascending
    delete: tuple[Deletion, ...] = ()  # graceful deletions, in this order
    waiting: str | None = None  # why a pending roll does not proceed yet (for logs), if it does not

    @property
    def idle(self) -> bool:
        return not self.create and not self.delete


def plan_proxies(desired: int, pods: Sequence[ProxyPodView], current_hash: str) -> Plan:
    """The next actions on the proxy pods (see the module docstring for the rules)."""
    by_ordinal = {pod.ordinal: pod for pod in pods}
    create = tuple(i for i in range(desired) if i not in by_ordinal)
    delete: list[Deletion] = []
    delete += [
        Deletion(p.name, p.ordinal, "Down") for p in sorted(pods, key=_ordinal) if p.down and not p.deleting
    ]
    excess = [p for p in pods if p.ordinal >= desired and p.live]
    delete += [Deletion(p.name, p.ordinal, "ScaleDown") for p in sorted(excess, key=_ordinal, reverse=True)]
    wanted = [p for p in sorted(pods, key=_ordinal) if p.ordinal < desired]
    outdated = [p for p in wanted if p.live and p.template_hash != current_hash]
    delete += [Deletion(p.name, p.ordinal, "ReplaceOutdated") for p in outdated if not p.ready]
    if create or delete:
        return Plan(create=create, delete=tuple(delete))
    if not outdated:
        return Plan()
    if blocker := _roll_blocker(pods, desired):
        return Plan(waiting=blocker)
    first = outdated[0]
    return Plan(delete=(Deletion(first.name, first.ordinal, "RollingUpdate"),))


def _ordinal(pod: ProxyPodView) -> int:
    return pod.ordinal


def _roll_blocker(pods: Sequence[ProxyPodView], desired: int) -> str | None:
    terminating = sorted(p.name for p in pods if p.deleting)
    if terminating:
        return f"waiting for {', '.join(terminating)} to terminate"
    unready = sorted((p for p in pods if p.ordinal < desired and not p.ready), key=_ordinal)
    if unready:
        return f"waiting for {', '.join(p.name for p in unready)} to become Ready"
    return None
