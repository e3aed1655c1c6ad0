"""Why a pod does not serve, in the words of the component that knows: a pure reading of the pod.

The scheduler, the kubelet and the container runtime each say why a pod is stuck, in different
places of its status. Problem reasons, where they show, and the cause reported:

- `Unschedulable`: condition PodScheduled False (reason Unschedulable); the scheduler's message up
  to its preemption note, e.g. `0/2 nodes are available: 2 Insufficient nvidia.com/gpu.`
- `ClaimNotFound`: the same, naming a missing claim: `persistentvolumeclaim "dumps" not found`.
- `ImagePullFailed`: a container waiting with ErrImagePull, ImagePullBackOff or InvalidImageName;
  the runtime's message (ErrImagePull's has the registry's answer), else the image.
- `ContainerConfigError`: waiting with CreateContainerConfigError; the kubelet's message, e.g.
  `secret "admin" not found`.
- `ContainerCreateFailed`: waiting with CreateContainerError or RunContainerError.
- `CrashLoop`: waiting with CrashLoopBackOff, or not Ready after `CRASHLOOP_RESTARTS` restarts;
  the last exit (code, reason) and the restart count.
- `PodFailed`: phase Failed; the pod's reason and message (e.g. Evicted, the node was low on memory).
- `MountFailed`: still ContainerCreating `MOUNT_GRACE_S` after scheduling; the kubelet says why
  only in FailedMount Events (`mount_failures` reads the ones the caller listed).

Causes are cut to `MAX_CAUSE_CHARS` and grouped (`describe`), so a condition stays readable and
its size bounded.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

UNSCHEDULABLE = "Unschedulable"
CLAIM_NOT_FOUND = "ClaimNotFound"
IMAGE_PULL_FAILED = "ImagePullFailed"
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
CONTAINER_CREATE_FAILED = "ContainerCreateFailed"
CRASH_LOOP = "CrashLoop"
POD_FAILED = "PodFailed"
MOUNT_FAILED = "MountFailed"
PROBLEM_REASONS = (
    UNSCHEDULABLE,
    CLAIM_NOT_FOUND,
    IMAGE_PULL_FAILED,
    CONTAINER_CONFIG_ERROR,
    CONTAINER_CREATE_FAILED,
    CRASH_LOOP,
    POD_FAILED,
    MOUNT_FAILED,
)

# A pod not Ready after this many restarts of a container counts as crash-looping.
CRASHLOOP_RESTARTS = 3
MAX_CAUSE_CHARS = 200
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
CREATE_REASONS = frozenset({"CreateContainerError", "RunContainerError"})
# The kubelet's waiting reason while it mounts volumes and creates the sandbox: normal for seconds,
# a mount failure when it lasts (its FailedMount Events say why).
CONTAINER_CREATING = "ContainerCreating"
FAILED_MOUNT_EVENT = "FailedMount"
# How long a scheduled pod may wait for its volumes before its Events are looked at.
MOUNT_GRACE_S = 20.0


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str  # one of the names above
    cause: str  # short, for people


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 1] + "…"


def _scheduler_cause(message: str) -> str:
    """The scheduler's message without its preemption note (which repeats the node count)."""
    head = message.split(" preemption:", 1)[0].strip()
    return head or message


def _ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _container_problem(name: str, entry: Mapping[str, Any], ready: bool) -> PodProblem | None:
    waiting = (entry.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason") or ""
    message = waiting.get("message") or ""
    restarts = int(entry.get("restartCount") or 0)
    if reason in IMAGE_PULL_REASONS:
        # ImagePullBackOff's message only repeats the image; ErrImagePull's has the registry's answer.
        cause = (
            message
            if reason != "ImagePullBackOff" and message
            else f'cannot pull image "{entry.get("image")}"'
        )
        return PodProblem(name, IMAGE_PULL_FAILED, _cut(cause))
    if reason == "CreateContainerConfigError":
        return PodProblem(name, CONTAINER_CONFIG_ERROR, _cut(message or reason))
    if reason in CREATE_REASONS:
        return PodProblem(name, CONTAINER_CREATE_FAILED, _cut(message or reason))
    if not ready and (reason == "CrashLoopBackOff" or restarts >= CRASHLOOP_RESTARTS):
        last = (entry.get("lastState") or {}).get("terminated") or {}
        exit_ = f"last exit {last.get('exitCode')} ({last.get('reason') or 'Error'}), " if last else ""
        return PodProblem(name, CRASH_LOOP, _cut(f"{exit_}{restarts} restarts"))
    return None


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why `pod` (as the API returns it) does not serve and will not without a change, or None (it
    serves, or is on its way: scheduled and starting). A pod being deleted has no problem."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = metadata.get("name") or ""
    if metadata.get("deletionTimestamp"):
        return None
    if status.get("phase") == "Failed":
        cause = ": ".join(x for x in (status.get("reason"), status.get("message")) if x) or "Failed"
        return PodProblem(name, POD_FAILED, _cut(cause))
    for condition in status.get("conditions") or ():
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            cause = _scheduler_cause(condition.get("message") or "no node fits")
            reason = (
                CLAIM_NOT_FOUND
                if "persistentvolumeclaim" in cause and "not found" in cause
                else UNSCHEDULABLE
            )
            return PodProblem(name, reason, _cut(cause))
    ready = _ready(status)
    entries = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    for entry in entries:
        problem = _container_problem(name, entry, ready)
        if problem is not None:
            return problem
    return None


def waiting_to_mount(pod: Mapping[str, Any], now: datetime.datetime, grace_s: float = MOUNT_GRACE_S) -> bool:
    """The kubelet has not started the pod's containers `grace_s` after it was scheduled (still
    mounting volumes, or creating the sandbox): where its FailedMount Events say why."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if status.get("phase") != "Pending" or metadata.get("deletionTimestamp"):
        return False
    scheduled = next(
        (
            c.get("lastTransitionTime")
            for c in status.get("conditions") or ()
            if c.get("type") == "PodScheduled" and c.get("status") == "True"
        ),
        None,
    )
    if not scheduled:
        return False
    try:
        since = datetime.datetime.fromisoformat(scheduled.replace("Z", "+00:00"))
    except ValueError:
        return False
    entries = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    creating = not entries or any(
        ((e.get("state") or {}).get("waiting") or {}).get("reason") in (CONTAINER_CREATING, "PodInitializing")
        for e in entries
    )
    return creating and (now - since).total_seconds() >= grace_s


def mount_failures(events: Iterable[Mapping[str, Any]], pods: Iterable[str]) -> dict[str, PodProblem]:
    """Pod name -> its latest FailedMount Event as a problem, for the named pods (core/v1 Events)."""
    wanted = set(pods)
    latest: dict[str, tuple[str, str]] = {}
    for event in events:
        involved = event.get("involvedObject") or {}
        name = involved.get("name") or ""
        if event.get("reason") != FAILED_MOUNT_EVENT or involved.get("kind") != "Pod" or name not in wanted:
            continue
        stamp = event.get("lastTimestamp") or event.get("eventTime") or ""
        if name not in latest or stamp >= latest[name][0]:
            latest[name] = (stamp, event.get("message") or FAILED_MOUNT_EVENT)
    return {name: PodProblem(name, MOUNT_FAILED, _cut(message)) for name, (_, message) in latest.items()}


def describe(problems: Sequence[PodProblem], max_groups: int = 3, max_names: int = 5) -> str:
    """Problems grouped by cause: `pod-0, pod-1: <reason>: <cause>; ...`, at most `max_groups`
    causes with `max_names` pods each (then `and N more`), so the text stays bounded."""
    groups: dict[tuple[str, str], list[str]] = {}
    for problem in problems:
        groups.setdefault((problem.reason, problem.cause), []).append(problem.pod)
    parts = []
    for (reason, cause), pods in list(groups.items())[:max_groups]:
        shown = ", ".join(pods[:max_names]) + (
            f" and {len(pods) - max_names} more" if len(pods) > max_names else ""
        )
        parts.append(f"{shown}: {reason}: {cause}")
    if len(groups) > max_groups:
        parts.append(f"{len(groups) - max_groups} more causes")
    return "; ".join(parts)
