"""Proxies lost with their node (lost_proxies.py): terminating past their grace period on a node that
is not Ready or gone; reported at once, force-deleted after the timeout; never judged without the
node read, never lost on a Ready node."""

from __future__ import annotations

from rolloutfleet_operator.lost_proxies import (
    LostProxy,
    force_delete_message,
    lost_condition,
    lost_message,
    lost_proxies,
    node_ready,
    nodes_to_check,
)
from rolloutfleet_operator.plan import ProxyPodView

GRACE_END = 1_767_225_600.0  # 2026-01-01T00:00:00Z
READY_NODE = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
UNKNOWN_NODE = {
    "status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}
}


def view(ordinal: int, node: str | None = "n1", deadline: float | None = GRACE_END) -> ProxyPodView:
    return ProxyPodView(
        name=f"f-proxy-{ordinal}",
        ordinal=ordinal,
        ready=False,
        phase="Running",
        deleting=deadline is not None,
        uid=f"uid-{ordinal}",
        node=node,
        deletion_deadline=deadline,
    )


def test_node_readiness_is_its_ready_condition():
    assert node_ready(READY_NODE)
    assert not node_ready(UNKNOWN_NODE)
    assert not node_ready({"status": {}})
    assert not node_ready(None)  # gone


def test_nodes_are_read_only_for_proxies_terminating_past_their_grace_period():
    views = [
        view(0, deadline=None),  # serving
        view(1, node="n2", deadline=GRACE_END + 30),  # terminating, within its grace period
        view(2, node="n3"),  # past it
        view(3, node=None),  # never scheduled (the API server deletes those at once)
    ]
    assert nodes_to_check(views, now=GRACE_END + 1) == {"n3"}
    assert nodes_to_check(views, now=GRACE_END + 31) == {"n2", "n3"}
    assert nodes_to_check([view(0, deadline=None)], now=GRACE_END) == set()


def test_a_proxy_past_its_grace_period_on_a_lost_node_is_lost_and_due_after_the_timeout():
    views = [view(0, node="ready"), view(1, node="unknown"), view(2, node="gone"), view(3, node="unread")]
    nodes = {"ready": READY_NODE, "unknown": UNKNOWN_NODE, "gone": None}
    lost = lost_proxies(views, nodes, now=GRACE_END + 10, timeout_s=300)
    assert [(p.pod, p.node, p.node_gone) for p in lost] == [
        ("f-proxy-1", "unknown", False),
        ("f-proxy-2", "gone", True),
    ]
    first = lost[0]
    assert first.uid == "uid-1" and first.force_delete_at == GRACE_END + 300
    assert not first.due(GRACE_END + 299.9) and first.due(GRACE_END + 300)
    # Not past its grace period yet: not lost, whatever its node.
    assert lost_proxies([view(1, node="unknown")], nodes, now=GRACE_END - 1, timeout_s=300) == ()


def test_the_condition_names_each_lost_proxy_with_fixed_times():
    lost = [
        LostProxy("f-proxy-1", "u1", "n1", False, GRACE_END, GRACE_END + 300),
        LostProxy("f-proxy-2", "u2", "n2", True, GRACE_END, GRACE_END + 300),
    ]
    condition = lost_condition(lost, generation=4)
    assert (condition.type, condition.status, condition.reason) == ("ProxiesLost", "True", "NodeLost")
    assert condition.observed_generation == 4
    assert "f-proxy-1 on n1 (NotReady, force-deleted at 2026-01-01T00:05:00Z)" in condition.message
    assert "f-proxy-2 on n2 (gone" in condition.message
    calm = lost_condition([])
    assert (calm.status, calm.reason) == ("False", "NoneLost")
    many = lost_condition([LostProxy(f"f-proxy-{i}", "", "n", False, GRACE_END, GRACE_END) for i in range(7)])
    assert many.message.endswith("and 2 more")


def test_event_messages_say_what_happens_and_when():
    lost = LostProxy("f-proxy-1", "u1", "n1", False, GRACE_END, GRACE_END + 300)
    assert "node n1 is not Ready" in lost_message(lost)
    assert "force-deleting it at 2026-01-01T00:05:00Z" in lost_message(lost)
    gone = LostProxy("f-proxy-1", "u1", "n1", True, GRACE_END, GRACE_END + 300)
    assert "force-deleted f-proxy-1 (grace period 0)" in force_delete_message(gone)
    assert "node n1 is gone" in force_delete_message(gone)
