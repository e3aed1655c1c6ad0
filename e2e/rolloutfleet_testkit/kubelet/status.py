"""Pod status as a kubelet reports it, built from what the harness knows (pure functions).

Phase follows the kubelet's rules: Pending until every container has started once, Running while
any runs or is being restarted, Succeeded/Failed when all have stopped for good (restartPolicy
decides), and never back out of a terminal phase. Conditions keep their lastTransitionTime until
their status changes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TERMINAL_PHASES = ("Succeeded", "Failed")
# The conditions the kubelet owns (PodScheduled belongs to the scheduler and is left alone).
KUBELET_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def timestamp(epoch: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if epoch is None else epoch))


def waiting(reason: str, message: str | None = None) -> dict:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def running(started_at: str) -> dict:
    return {"running": {"startedAt": started_at}}


def terminated(
    exit_code: int,
    started_at: str,
    finished_at: str,
    container_id: str | None = None,
    reason: str | None = None,
    message: str | None = None,
) -> dict:
    state = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started_at,
        "finishedAt": finished_at,
    }
    if container_id:
        state["containerID"] = container_id
    if message:
        state["message"] = message
    return {"terminated": state}


@dataclass(frozen=True)
class ContainerView:
    """One container as its runner sees it; `state`/`last_state` are Kubernetes ContainerState dicts."""

    name: str
    image: str
    state: Mapping
    last_state: Mapping = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str | None = None

    @property
    def exit_code(self) -> int | None:
        term = self.state.get("terminated")
        return None if term is None else term["exitCode"]


def container_status(view: ContainerView) -> dict:
    status = {
        "name": view.name,
        "image": view.image,
        "imageID": f"process-kubelet://{view.image}",
        "ready": view.ready,
        "started": view.started,
        "restartCount": view.restart_count,
        "state": dict(view.state),
        "lastState": dict(view.last_state),
    }
    if view.container_id:
        status["containerID"] = view.container_id
    return status


def init_complete(init: Sequence[ContainerView]) -> bool:
    return all(view.exit_code == 0 for view in init)


def init_failed(restart_policy: str, init: Sequence[ContainerView]) -> bool:
    """An init container failed and will not be retried: the pod fails."""
    return restart_policy == "Never" and any(view.exit_code not in (None, 0) for view in init)


def pod_phase(
    restart_policy: str,
    containers: Sequence[ContainerView],
    init: Sequence[ContainerView] = (),
    terminal: bool = False,
    previous: str | None = None,
) -> str:
    """`terminal`: the pod is being torn down for good (deleted), so nothing restarts any more."""
    if previous in TERMINAL_PHASES:
        return previous
    if init_failed(restart_policy, init):
        return "Failed"
    if not init_complete(init):
        return "Failed" if terminal else "Pending"
    running = stopped = succeeded = never_started = 0
    for view in containers:
        if "running" in view.state:
            running += 1
        elif "terminated" in view.state:
            stopped += 1
            succeeded += view.exit_code == 0
        elif view.last_state.get("terminated"):
            stopped += 1  # waiting to be restarted
        else:
            never_started += 1
    if terminal and running == 0:
        return "Succeeded" if containers and stopped == succeeded == len(containers) else "Failed"
    if never_started:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if restart_policy == "Never" else "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str | None, message: str | None) -> dict:
    # reason/message are set to None (not left out) when they do not apply, so that the
    # strategic-merge patch removes a stale "ContainersNotReady" from a condition that turned True.
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": None if ok else reason,
        "message": None if ok else message,
    }


def pod_conditions(
    phase: str,
    sandbox_ready: bool,
    containers: Sequence[ContainerView],
    init: Sequence[ContainerView] = (),
    readiness_gates: Mapping[str, str] | None = None,
) -> list[dict]:
    """The kubelet-owned conditions, without timestamps. `readiness_gates`: gate type → its status."""
    unready = [view.name for view in containers if not view.ready]
    waiting_init = [view.name for view in init if view.exit_code != 0]
    gates_blocking = [kind for kind, status in (readiness_gates or {}).items() if status != "True"]
    if phase in TERMINAL_PHASES:
        containers_ready = _condition("ContainersReady", False, "PodCompleted", None)
        ready = _condition("Ready", False, "PodCompleted", None)
    else:
        message = f"containers with unready status: [{' '.join(unready)}]"
        containers_ready = _condition("ContainersReady", not unready, "ContainersNotReady", message)
        if unready:
            ready = _condition("Ready", False, "ContainersNotReady", message)
        else:
            gates = (
                f"corresponding condition of pod readiness gate {gates_blocking} does not exist or is False"
            )
            ready = _condition("Ready", not gates_blocking, "ReadinessGatesNotReady", gates)
    return [
        _condition("PodReadyToStartContainers", sandbox_ready, None, None),
        _condition(
            "Initialized",
            not waiting_init,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(waiting_init)}]",
        ),
        containers_ready,
        ready,
    ]


def with_transition_times(conditions: Sequence[dict], previous: Sequence[Mapping], now: str) -> list[dict]:
    """Stamp lastTransitionTime: kept from `previous` while a condition's status is unchanged."""
    before = {c.get("type"): c for c in previous}
    stamped = []
    for condition in conditions:
        old = before.get(condition["type"])
        same = old is not None and old.get("status") == condition["status"] and old.get("lastTransitionTime")
        stamped.append(
            {
                **condition,
                "lastProbeTime": None,
                "lastTransitionTime": old["lastTransitionTime"] if same else now,
            }
        )
    return stamped


@dataclass(frozen=True)
class PodView:
    """Everything the status of one pod is built from."""

    restart_policy: str
    host_ip: str
    pod_ip: str | None
    start_time: str
    sandbox_ready: bool
    containers: tuple[ContainerView, ...]
    init: tuple[ContainerView, ...] = ()
    readiness_gates: Mapping[str, str] = field(default_factory=dict)
    terminal: bool = False


def pod_status(view: PodView, previous: Mapping, now: str) -> dict:
    """The pod's status; `previous` is the status last reported (or read from the API)."""
    phase = pod_phase(view.restart_policy, view.containers, view.init, view.terminal, previous.get("phase"))
    conditions = pod_conditions(phase, view.sandbox_ready, view.containers, view.init, view.readiness_gates)
    status: dict = {
        "phase": phase,
        "conditions": with_transition_times(conditions, previous.get("conditions") or [], now),
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "startTime": view.start_time,
        "containerStatuses": [container_status(c) for c in view.containers],
    }
    if view.pod_ip:
        status["podIP"] = view.pod_ip
        status["podIPs"] = [{"ip": view.pod_ip}]
    if view.init:
        status["initContainerStatuses"] = [container_status(c) for c in view.init]
    return status


def status_patch(uid: str, status: Mapping) -> dict:
    """A strategic-merge patch setting `status`. Container states are maps merged key by key, so the
    keys a state no longer has are deleted explicitly (else running and terminated would coexist).
    The uid makes the patch fail on a newer pod with the same name."""

    def exclusive(state: Mapping) -> dict:
        return {key: state.get(key) for key in ("waiting", "running", "terminated")}

    patched = dict(status)
    for key in ("containerStatuses", "initContainerStatuses"):
        if key in patched:
            patched[key] = [
                {**entry, "state": exclusive(entry["state"]), "lastState": exclusive(entry["lastState"])}
                for entry in patched[key]
            ]
    return {"metadata": {"uid": uid}, "status": patched}
