"""The proxy plan: which pods to create and delete, a roll one pod at a time."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_samples import GPU, NOW, H, pod
from rolloutfleet_operator.conditions import ObservedState, fleet_status
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod, template_hash
from rolloutfleet_operator.plan import Deletion, ProxyPodView, plan_proxies, proxy_pod_view, ready_pod_urls


def dels(*items: tuple[int, str]) -> tuple[Deletion, ...]:
    return tuple(Deletion(f"f-proxy-{i}", i, reason) for i, reason in items)


@pytest.mark.parametrize(
    ("case", "desired", "pods", "create", "delete"),
    [
        ("fresh create", 3, [], (0, 1, 2), ()),
        ("steady", 2, [pod(0), pod(1)], (), ()),
        ("scale up", 4, [pod(0), pod(1)], (2, 3), ()),
        ("scale up with a gap", 3, [pod(0), pod(2)], (1,), ()),
        (
            "scale down highest first",
            1,
            [pod(0), pod(1), pod(2), pod(3)],
            (),
            dels((3, "ScaleDown"), (2, "ScaleDown"), (1, "ScaleDown")),
        ),
        ("scale to zero", 0, [pod(0), pod(1)], (), dels((1, "ScaleDown"), (0, "ScaleDown"))),
        (
            "scale down skips terminating",
            1,
            [pod(0), pod(1, deleting=True), pod(2)],
            (),
            dels((2, "ScaleDown")),
        ),
        (
            "roll lowest first, one at a time",
            3,
            [pod(0, hash_="old"), pod(1, hash_="old"), pod(2, hash_="old")],
            (),
            dels((0, "RollingUpdate")),
        ),
        (
            "roll continues with the next outdated",
            3,
            [pod(0), pod(1, hash_="old"), pod(2, hash_="old")],
            (),
            dels((1, "RollingUpdate")),
        ),
        ("no roll while one is unready", 3, [pod(0, hash_="old"), pod(1, ready=False), pod(2)], (), ()),
        ("no roll while one terminates", 3, [pod(0, hash_="old"), pod(1), pod(2, deleting=True)], (), ()),
        (
            "no roll while an excess pod terminates",
            2,
            [pod(0, hash_="old"), pod(1), pod(2, deleting=True)],
            (),
            (),
        ),
        ("no roll while one is missing", 3, [pod(0, hash_="old"), pod(1)], (2,), ()),
        ("missing hash counts as outdated", 1, [pod(0, hash_=None)], (), dels((0, "RollingUpdate"))),
        ("failed pod is deleted", 2, [pod(0), pod(1, ready=False, phase="Failed")], (), dels((1, "Down"))),
        ("gone pod is recreated under its name", 2, [pod(0)], (1,), ()),
        ("terminating pod is not recreated yet", 2, [pod(0), pod(1, ready=False, deleting=True)], (), ()),
        (
            "unready outdated pods are replaced at once",
            3,
            [pod(0, ready=False, hash_="old"), pod(1), pod(2, ready=False, hash_="old")],
            (),
            dels((0, "ReplaceOutdated"), (2, "ReplaceOutdated")),
        ),
        ("create and scale down together", 2, [pod(1), pod(2)], (0,), dels((2, "ScaleDown"))),
    ],
)
def test_plan_proxies(case, desired, pods, create, delete):
    plan = plan_proxies(desired, pods, H)
    assert (plan.create, plan.delete) == (create, delete), case


def test_plan_reports_why_a_roll_waits():
    plan = plan_proxies(2, [pod(0, hash_="old"), pod(1, ready=False)], H)
    assert plan.idle and "f-proxy-1" in (plan.waiting or "")


def test_a_roll_never_takes_two_pods_down():
    """Walk a whole roll of 4 pods: after every step, at most one wanted pod is unavailable."""
    pods = {i: pod(i, hash_="old") for i in range(4)}
    for _ in range(50):
        plan = plan_proxies(4, list(pods.values()), H)
        if plan.idle:
            break
        for deletion in plan.delete:
            pods[deletion.ordinal] = pod(deletion.ordinal, ready=False, deleting=True)
        unavailable = [p for p in pods.values() if not p.ready]
        assert len(unavailable) <= 1
        # The kubelet finishes the deletion; the next passes recreate it and it becomes ready.
        for p in unavailable:
            del pods[p.ordinal]
        plan = plan_proxies(4, list(pods.values()), H)
        for ordinal in plan.create:
            pods[ordinal] = pod(ordinal)
    assert all(p.template_hash == H and p.ready for p in pods.values()) and len(pods) == 4


def test_proxy_pod_view_reads_a_pod():
    obj = proxy_pod(GPU, 1)
    obj["metadata"]["deletionTimestamp"] = NOW
    obj["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": "proxy", "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
        ],
    }
    view = proxy_pod_view(obj, 1)
    assert view == ProxyPodView(
        name="gpu-fleet-proxy-1",
        ordinal=1,
        ready=True,
        phase="Running",
        restart_count=4,
        template_hash=template_hash(GPU),
        deleting=True,
        waiting_reason="CrashLoopBackOff",
    )
    obj["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "False"},
    ]
    assert proxy_pod_view(obj, 1).ready is False
    bare = proxy_pod_view({"metadata": {"name": "x"}}, 0)
    assert (bare.ready, bare.phase, bare.template_hash, bare.deleting) == (False, "Pending", None, False)


def test_engine_endpoints_are_ready_live_engine_pods_or_the_external_urls():
    def engine_pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name}
        if deleting:
            metadata["deletionTimestamp"] = "2026-11-22T00:00:00Z"
        status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": metadata, "status": status}

    pods = [
        engine_pod("e-b", "10.0.0.2", True),
        engine_pod("e-a", "10.0.0.1", True),
        engine_pod("e-c", "10.0.0.3", False),
    ]
    pods += [engine_pod("e-d", "10.0.0.4", True, deleting=True), engine_pod("e-e", None, True)]
    assert ready_pod_urls(pods, 30000) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    observed = ObservedState(1, (), "h", engine_endpoints=("http://10.0.0.1:30000",))
    assert fleet_status(GPU, observed, "now")["engineEndpoints"] == ["http://10.0.0.1:30000"]
