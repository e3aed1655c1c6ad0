"""The fleet's conditions and status, the children no longer wanted, and which pod events need a pass."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_samples import GPU, LATER, NOW, POD, SCHEMA, SVC, H, container, env_map, mutated, pod, pod_spec
from rolloutfleet_operator.conditions import (
    Condition,
    ObservedState,
    deployment_available,
    fleet_conditions,
    fleet_status,
    set_condition,
)
from rolloutfleet_operator.fleet import parse_fleet, selector_string
from rolloutfleet_operator.manifests.children import unwanted_children
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.plan import ProxyPodView, proxy_pod_view
from rolloutfleet_operator.pod_problems import CRASHLOOP_RESTARTS
from rolloutfleet_proxy.settings import ENV


def test_set_condition_keeps_the_transition_time_while_the_status_holds():
    first = set_condition([], Condition("Ready", "False", "Starting", "a"), NOW)
    assert first[0]["lastTransitionTime"] == NOW
    same = set_condition(
        first, Condition("Ready", "False", "StillStarting", "b", observed_generation=2), LATER
    )
    assert same[0]["lastTransitionTime"] == NOW
    assert (same[0]["reason"], same[0]["message"], same[0]["observedGeneration"]) == ("StillStarting", "b", 2)
    flipped = set_condition(same, Condition("Ready", "True", "Up"), LATER)
    assert flipped[0]["lastTransitionTime"] == LATER and flipped[0]["status"] == "True"
    assert first[0]["reason"] == "Starting", "the input list is not modified"


def test_set_condition_keeps_other_types_and_their_order():
    existing = [
        {"type": "A", "status": "True", "reason": "X", "lastTransitionTime": NOW},
        {"type": "B", "status": "True", "reason": "Y", "lastTransitionTime": NOW},
    ]
    result = set_condition(existing, Condition("A", "False", "Z"), LATER)
    assert [c["type"] for c in result] == ["A", "B"]
    assert result[1] == existing[1]
    assert [c["type"] for c in set_condition(existing, Condition("C", "True", "W"), LATER)] == ["A", "B", "C"]


def observed(pods, desired=2, gateway=(1, 1), engines=(2, 2), **kw):
    return ObservedState(
        desired_proxies=desired,
        proxies=tuple(pods),
        current_hash=H,
        gateway_ready=gateway[0],
        gateway_desired=gateway[1],
        engines_ready=engines[0] if engines else None,
        engines_desired=engines[1] if engines else None,
        **kw,
    )


def pod_from_api(ordinal: int, status: dict[str, Any]) -> ProxyPodView:
    """The view the reconciler makes of a pod as the API returns it."""
    body = {
        "metadata": {"name": f"f-proxy-{ordinal}", "annotations": {"rolloutfleet.dev/template-hash": H}},
        "status": status,
    }
    return proxy_pod_view(body, ordinal)


def crash_looping(ordinal: int, restarts: int, waiting: str | None = None) -> ProxyPodView:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    entry = {"name": "proxy", "restartCount": restarts, "state": state}
    entry["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error"}}
    return pod_from_api(ordinal, {"phase": "Running", "containerStatuses": [entry]})


def by_type(conditions):
    return {c["type"]: c for c in conditions}


def statuses(conditions):
    return {c["type"]: c["status"] for c in conditions}


@pytest.mark.parametrize(
    ("case", "state", "expected"),
    [
        (
            "all ready",
            observed([pod(0), pod(1)]),
            {
                "Ready": "True",
                "ProxiesReady": "True",
                "GatewayReady": "True",
                "EnginesReady": "True",
                "Progressing": "False",
                "ReplicaFailure": "False",
            },
        ),
        (
            "creating",
            observed([]),
            {"Ready": "False", "ProxiesReady": "False", "Progressing": "True", "ReplicaFailure": "False"},
        ),
        (
            "rolling",
            observed([pod(0, hash_="old"), pod(1)]),
            {"Ready": "True", "ProxiesReady": "True", "Progressing": "True"},
        ),
        (
            "gateway down",
            observed([pod(0), pod(1)], gateway=(0, 1)),
            {"Ready": "False", "GatewayReady": "False"},
        ),
        (
            "engines down",
            observed([pod(0), pod(1)], engines=(1, 2)),
            {"Ready": "False", "EnginesReady": "False"},
        ),
        (
            "external engines",
            observed([pod(0), pod(1)], engines=None),
            {"Ready": "True", "EnginesReady": "True"},
        ),
        (
            "crash loop",
            observed([pod(0), crash_looping(1, CRASHLOOP_RESTARTS)]),
            {"Ready": "False", "ReplicaFailure": "True", "Progressing": "True", "Available": "True"},
        ),
        (
            "failed pod",
            observed(
                [
                    pod(0),
                    pod_from_api(1, {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}),
                ]
            ),
            {"Ready": "False", "ReplicaFailure": "True"},
        ),
        (
            "restarted but ready again is no failure",
            observed(
                [
                    pod(0),
                    pod_from_api(
                        1,
                        {
                            "phase": "Running",
                            "conditions": [{"type": "Ready", "status": "True"}],
                            "containerStatuses": [
                                {"name": "proxy", "restartCount": 9, "state": {"running": {}}}
                            ],
                        },
                    ),
                ]
            ),
            {"Ready": "True", "ReplicaFailure": "False"},
        ),
        (
            "failed create",
            observed([pod(0), pod(1)], create_failures=("f-proxy-2: exceeded quota",), desired=3),
            {"Ready": "False", "ReplicaFailure": "True"},
        ),
        (
            "scaled to zero",
            observed([], desired=0),
            {"Ready": "True", "ProxiesReady": "True", "Progressing": "False"},
        ),
        ("scaling down", observed([pod(0), pod(1), pod(2)]), {"Ready": "True", "Progressing": "True"}),
    ],
)
def test_fleet_conditions(case, state, expected):
    conditions = fleet_conditions(state, 5, NOW, [])
    found = statuses(conditions)
    assert {k: found[k] for k in expected} == expected, case
    assert set(found) == {
        "Ready",
        "Available",
        "ProxiesReady",
        "GatewayReady",
        "EnginesReady",
        "Progressing",
        "ReplicaFailure",
    }
    for condition in conditions:
        assert condition["observedGeneration"] == 5 and condition["lastTransitionTime"] == NOW
        assert condition["reason"][:1].isupper() and condition["reason"].isalnum()


def test_condition_reasons_and_messages():
    crashing = crash_looping(1, 2, waiting="CrashLoopBackOff")
    conditions = by_type(fleet_conditions(observed([pod(0), crashing]), 1, NOW, []))
    assert conditions["ReplicaFailure"]["reason"] == "CrashLoop"
    assert "f-proxy-1: CrashLoop: last exit 1 (Error), 2 restarts" in conditions["ReplicaFailure"]["message"]
    assert conditions["Ready"]["reason"] == "ProxiesNotReady"
    assert "f-proxy-1" in conditions["ProxiesReady"]["message"]
    external = by_type(fleet_conditions(observed([pod(0), pod(1)], engines=None), 1, NOW, []))
    assert external["EnginesReady"]["reason"] == "NotManaged"
    evicted = pod_from_api(1, {"phase": "Failed", "reason": "Evicted", "message": "low on memory"})
    failed = by_type(fleet_conditions(observed([pod(0), evicted]), 1, NOW, []))
    assert failed["ReplicaFailure"]["reason"] == "PodFailed"
    assert "f-proxy-1: PodFailed: Evicted: low on memory" in failed["ReplicaFailure"]["message"]


def test_fleet_conditions_keep_transition_times_and_return_only_their_types():
    watchdog = {
        "type": "MemoryPressure",
        "status": "False",
        "reason": "WithinBudget",
        "lastTransitionTime": NOW,
    }
    starting = fleet_conditions(observed([pod(0), pod(1, ready=False)]), 1, NOW, [watchdog])
    assert "MemoryPressure" not in by_type(starting)  # the watchdog's, applied by the watchdog
    # Same state later: nothing moves.
    assert fleet_conditions(observed([pod(0), pod(1, ready=False)]), 1, LATER, starting) == starting
    ready = by_type(fleet_conditions(observed([pod(0), pod(1)]), 2, LATER, starting))
    assert ready["Ready"]["status"] == "True" and ready["Ready"]["lastTransitionTime"] == LATER
    assert ready["GatewayReady"]["lastTransitionTime"] == NOW  # was True already
    assert ready["GatewayReady"]["observedGeneration"] == 2


UNSCHEDULABLE_CLAIM = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    # The scheduler's words (volumebinding's PreFilter, kube-scheduler 1.35).
    "message": '0/2 nodes are available: persistentvolumeclaim "dumps" not found. preemption: 0/2 nodes are'
    " available: 2 Preemption is not helpful for scheduling.",
}


def test_a_pod_pending_for_a_missing_claim_is_a_replica_failure_naming_the_claim():
    pending = [pod_from_api(i, {"phase": "Pending", "conditions": [UNSCHEDULABLE_CLAIM]}) for i in (0, 1)]
    conditions = by_type(fleet_conditions(observed(pending), 1, NOW, []))
    failure = conditions["ReplicaFailure"]
    assert (failure["status"], failure["reason"]) == ("True", "ClaimNotFound")
    # Grouped by cause, the preemption note left out.
    assert failure["message"] == (
        "f-proxy-0, f-proxy-1: ClaimNotFound: "
        '0/2 nodes are available: persistentvolumeclaim "dumps" not found.'
    )
    assert conditions["Ready"]["status"] == "False" and "ClaimNotFound" in conditions["Ready"]["message"]
    assert conditions["Available"]["reason"] == "ProxiesUnavailable"


@pytest.mark.parametrize(
    ("status", "reason", "cause"),
    [
        (
            {
                "phase": "Pending",
                "conditions": [
                    {**UNSCHEDULABLE_CLAIM, "message": "0/2 nodes are available: 2 Insufficient cpu."}
                ],
            },
            "Unschedulable",
            "0/2 nodes are available: 2 Insufficient cpu.",
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "proxy",
                        "image": "proxy:nope",
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "proxy:nope"',
                            }
                        },
                    }
                ],
            },
            "ImagePullFailed",
            'cannot pull image "proxy:nope"',
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "proxy",
                        "state": {"waiting": {"reason": "ErrImagePull", "message": "rpc error: not found"}},
                    }
                ],
            },
            "ImagePullFailed",
            "rpc error: not found",
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "proxy",
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "admin" not found',
                            }
                        },
                    }
                ],
            },
            "ContainerConfigError",
            'secret "admin" not found',
        ),
    ],
)
def test_why_a_proxy_pod_does_not_start_is_in_replica_failure(status, reason, cause):
    conditions = by_type(fleet_conditions(observed([pod(0), pod_from_api(1, status)]), 1, NOW, []))
    assert conditions["ReplicaFailure"]["reason"] == reason
    assert conditions["ReplicaFailure"]["message"] == f"f-proxy-1: {reason}: {cause}"


def test_long_causes_and_many_pods_stay_bounded():
    long = {**UNSCHEDULABLE_CLAIM, "message": "0/900 nodes are available: " + "x " * 500}
    pods = [pod_from_api(i, {"phase": "Pending", "conditions": [long]}) for i in range(40)]
    message = by_type(fleet_conditions(observed(pods, desired=40), 1, NOW, []))["ReplicaFailure"]["message"]
    assert len(message) < 400 and message.count("f-proxy-") == 5 and "and 35 more" in message


def test_gateway_and_engine_pods_say_why_they_do_not_serve():
    from rolloutfleet_operator.pod_problems import PodProblem

    state = observed(
        [pod(0), pod(1)],
        gateway=(0, 1),
        engines=(0, 1),
        gateway_problems=(PodProblem("f-gateway-x", "ImagePullFailed", 'cannot pull image "router:nope"'),),
        engine_problems=(
            PodProblem(
                "f-engine-y", "Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
            ),
        ),
    )
    conditions = by_type(fleet_conditions(state, 1, NOW, []))
    assert conditions["GatewayReady"]["reason"] == "ImagePullFailed"
    assert (
        'f-gateway-x: ImagePullFailed: cannot pull image "router:nope"'
        in conditions["GatewayReady"]["message"]
    )
    assert conditions["EnginesReady"]["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in conditions["Ready"]["message"]


@pytest.mark.parametrize(
    ("case", "state", "available", "reason"),
    [
        ("all ready", observed([pod(0), pod(1), pod(2)], desired=3), "True", "MinimumProxiesAvailable"),
        (
            "a roll step",
            observed([pod(0), pod(1, deleting=True), pod(2, hash_="old")], desired=3),
            "True",
            "MinimumProxiesAvailable",
        ),
        ("a memory restart", observed([pod(0), pod(2)], desired=3), "True", "MinimumProxiesAvailable"),
        (
            "two down of three",
            observed([pod(0), pod(1, ready=False)], desired=3),
            "False",
            "ProxiesUnavailable",
        ),
        (
            "two down of three, maxUnavailable 2",
            observed([pod(0)], desired=3, max_unavailable=2),
            "True",
            "MinimumProxiesAvailable",
        ),
        (
            "one proxy, down: maxUnavailable never means none",
            observed([pod(0, ready=False)], desired=1),
            "False",
            "ProxiesUnavailable",
        ),
        (
            "gateway unavailable",
            observed([pod(0), pod(1)], gateway_available=False),
            "False",
            "GatewayUnavailable",
        ),
        (
            "gateway rolling but available",
            observed([pod(0), pod(1)], gateway=(0, 1), gateway_available=True),
            "True",
            "MinimumProxiesAvailable",
        ),
        ("scaled to zero", observed([], desired=0), "True", "MinimumProxiesAvailable"),
    ],
)
def test_available_holds_while_enough_proxies_serve(case, state, available, reason):
    condition = by_type(fleet_conditions(state, 1, NOW, []))["Available"]
    assert (condition["status"], condition["reason"]) == (available, reason), case


def test_the_gateway_is_available_by_its_deployment_s_own_condition():
    assert deployment_available({"status": {"conditions": [{"type": "Available", "status": "True"}]}})
    assert not deployment_available(
        {"status": {"readyReplicas": 1, "conditions": [{"type": "Available", "status": "False"}]}}
    )
    assert deployment_available({"status": {"readyReplicas": 1}})  # before the controller's first word
    assert not deployment_available(None)


@pytest.mark.parametrize(
    ("case", "state", "reason"),
    [
        ("a memory restart: terminating", observed([pod(0), pod(1, deleting=True)]), "Terminating"),
        ("a memory restart: replacement not created yet", observed([pod(0)]), "CreatingProxies"),
        (
            "a memory restart: replacement starting",
            observed([pod(0), pod(1, ready=False)]),
            "WaitingForReady",
        ),
        ("a roll step", observed([pod(0, hash_="old"), pod(1, deleting=True)]), "RollingUpdate"),
        ("the last roll step", observed([pod(0), pod(1, deleting=True, hash_="old")]), "RollingUpdate"),
        ("scaling down", observed([pod(0), pod(1), pod(2)]), "ScalingDown"),
        ("settled", observed([pod(0), pod(1)]), "Complete"),
    ],
)
def test_progressing_says_what_really_happens(case, state, reason):
    assert by_type(fleet_conditions(state, 1, NOW, []))["Progressing"]["reason"] == reason, case


def test_fleet_status_counts_and_endpoints():
    pods = [
        pod(1),
        pod(0, hash_="old"),
        pod(2, ready=False),
        pod(3, deleting=True),
        pod(4, ready=False, phase="Failed"),
    ]
    state = observed(pods, desired=3)
    status = fleet_status(GPU, state, NOW)
    assert status["observedGeneration"] == 3
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 2, 2)
    assert status["readyOfDesired"] == "2/3"
    assert status["selector"] == selector_string(GPU, "proxy")
    assert status["gatewayUrl"] == "http://gpu-fleet-gateway.rl.svc:30080"
    assert status["proxyEndpoints"] == [
        f"http://gpu-fleet-proxy-0.{SVC}.rl.svc:8000",
        f"http://gpu-fleet-proxy-1.{SVC}.rl.svc:8000",
    ]
    assert by_type(status["conditions"])["Ready"]["status"] == "False"
    # The endpoint of a ready proxy is the public URL the proxy itself was given.
    assert status["proxyEndpoints"][0] == env_map(proxy_pod(GPU, 0))[ENV["public_url"]]


def _unknown_keys(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        found = []
        for key, sub in value.items():
            if key not in props:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_keys(sub, props[key], f"{path}.{key}")
        return found
    if isinstance(value, list):
        return [k for item in value for k in _unknown_keys(item, schema.get("items") or {}, f"{path}[]")]
    return []


def test_status_uses_only_fields_of_the_crd_status_schema():
    status_schema = SCHEMA["properties"]["status"]
    status = fleet_status(GPU, observed([pod(0), pod(1, hash_="old")], desired=2), NOW)
    assert _unknown_keys(status, status_schema, "status") == []
    # The check itself notices an extra field.
    assert _unknown_keys({**status, "extra": 1}, status_schema, "status") == ["status.extra"]
    enum = status_schema["properties"]["conditions"]["items"]["properties"]["status"]["enum"]
    assert {c["status"] for c in status["conditions"]} <= set(enum)
    # Integer fields really are integers, strings strings.
    types = {"integer": int, "string": str, "array": list}
    for key, value in status.items():
        assert isinstance(value, types[status_schema["properties"][key]["type"]]), key


def test_children_do_not_share_mutable_state_with_the_fleet():
    pod_a = proxy_pod(GPU, 0)
    container(pod_a)["resources"]["limits"]["memory"] = "1Gi"
    pod_spec(engine_deployment(GPU))["tolerations"].append({"key": "x"})
    assert GPU.proxy.resources["limits"]["memory"] == "8Gi"
    assert len(GPU.engines.placement.tolerations) == 1
    assert proxy_pod(GPU, 2) == POD


def test_switching_to_external_engines_makes_the_engine_deployment_unwanted():
    # Without NetworkPolicies in the operator's settings, any a fleet has are unwanted.
    policies = [
        ("networking.k8s.io/v1", "NetworkPolicy", f"gpu-fleet-{c}") for c in ("proxy", "gateway", "engine")
    ]
    assert unwanted_children(GPU) == policies
    external = mutated("externalEngineUrls", ["http://e:1"])
    del external["spec"]["engines"]
    assert unwanted_children(parse_fleet(external)) == [
        ("apps/v1", "Deployment", "gpu-fleet-engine"),
        ("v1", "Service", "gpu-fleet-engines"),
        ("policy/v1", "PodDisruptionBudget", "gpu-fleet-engine"),
        *policies,
    ]


def _pod_with(ready: bool, phase: str = "Running") -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "conditions": [condition]}}


def _unschedulable_pod(message: str) -> dict[str, Any]:
    pod = _pod_with(False, "Pending")
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    pod["status"]["conditions"].append(scheduled)
    return pod


NO_GPU = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
NO_CLAIM = 'persistentvolumeclaim "dumps" not found'


@pytest.mark.parametrize(
    ("event_type", "pod", "seen", "needed"),
    [
        ("DELETED", _pod_with(True), (True, None), True),
        ("MODIFIED", _pod_with(False, "Failed"), (False, None), True),
        ("MODIFIED", _pod_with(True), (False, None), True),  # became Ready: a roll may go on
        ("MODIFIED", _pod_with(False), (True, None), True),  # lost readiness: the status should say so
        ("MODIFIED", _pod_with(True), (True, None), False),  # nothing that matters changed
        (None, _pod_with(True), None, False),  # the first listing: the resume pass covers it
        ("ADDED", _pod_with(False, "Pending"), None, False),
        # The scheduler gave up on it: the conditions should say why within a pass.
        ("MODIFIED", _unschedulable_pod(NO_GPU), (False, None), True),
        ("MODIFIED", _unschedulable_pod(NO_CLAIM), (False, "Unschedulable"), True),  # another cause
        ("MODIFIED", _unschedulable_pod(NO_GPU), (False, "Unschedulable"), False),  # the same again
    ],
)
def test_pod_event_needs_pass(event_type, pod, seen, needed):
    from rolloutfleet_operator.plan import pod_event_needs_pass

    assert pod_event_needs_pass(event_type, pod, seen) is needed
