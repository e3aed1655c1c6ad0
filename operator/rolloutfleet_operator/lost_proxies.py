"""Proxies lost with their node: which they are and when each is force-deleted. Pure.

A proxy pod is *lost* when it is terminating, its grace period is over (its deletionTimestamp, the
end of the grace period, has passed) and its node is not Ready (the node's Ready condition is not
True) or no longer exists. Its kubelet cannot confirm the deletion, so the pod object and its name
would stay: the replacement (same name) would never be created, a roll would wait for it forever,
and it would count as down against maxUnavailable, holding every memory restart. Kubernetes leaves
such pods of a StatefulSet to the user; the operator handles them as its controllers handle a lost
node's pods:

- At once: the condition `ProxiesLost` (True, reason `NodeLost`) names each lost proxy, its node and
  when it will be force-deleted, and an Event `ProxyLost` is posted when a proxy becomes lost.
- `lost_timeout_s` (spec.proxy.lostProxyTimeoutSeconds; default 300 s, the node lifecycle
  controller's former pod eviction timeout) after its grace period ended, a proxy still lost is
  force-deleted (grace period 0, its uid as precondition). That frees the name: the next pass
  creates the replacement, which restores from the dump volume.
- A proxy whose node is Ready again is not lost: its kubelet completes the deletion.

Times are epoch seconds on the operator's clock, compared with the API server's deletionTimestamp:
a clock skew of seconds shifts a timeout of minutes by as much, nothing more.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .conditions import MAX_NAMES_IN_MESSAGE, Condition
from .plan import ProxyPodView

PROXIES_LOST = "ProxiesLost"
NODE_LOST = "NodeLost"


def node_ready(node: Mapping[str, Any] | None) -> bool:
    """Whether a Node object (as the API returns it; None: it does not exist) is Ready."""
    conditions = ((node or {}).get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def past_grace(view: ProxyPodView, now: float) -> bool:
    """Terminating, bound to a node, and its grace period over."""
    return (
        view.deleting
        and view.node is not None
        and view.deletion_deadline is not None
        and now >= view.deletion_deadline
    )


def nodes_to_check(views: Iterable[ProxyPodView], now: float) -> set[str]:
    """The nodes to read this pass: those of proxies terminating past their grace period (none at
    rest, so a fleet at rest reads no Node)."""
    return {view.node for view in views if past_grace(view, now) and view.node is not None}


@dataclass(frozen=True)
class LostProxy:
    pod: str
    uid: str
    node: str
    node_gone: bool  # the Node object no longer exists (else: it exists and is not Ready)
    grace_ended_at: float
    force_delete_at: float

    def due(self, now: float) -> bool:
        return now >= self.force_delete_at


def lost_proxies(
    views: Iterable[ProxyPodView],
    nodes: Mapping[str, Mapping[str, Any] | None],
    now: float,
    timeout_s: float,
) -> tuple[LostProxy, ...]:
    """The lost proxies among `views`, by name; `nodes`: name -> Node object (None: gone) for
    every node `nodes_to_check` named (a node missing from it is not judged: not lost)."""
    lost = []
    for view in sorted(views, key=lambda v: v.ordinal):
        if not past_grace(view, now) or view.node is None or view.node not in nodes:
            continue
        node = nodes[view.node]
        if node_ready(node):
            continue
        ended = view.deletion_deadline or now
        lost.append(LostProxy(view.name, view.uid, view.node, node is None, ended, ended + timeout_s))
    return tuple(lost)


def _stamp(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _why(lost: LostProxy) -> str:
    return f"node {lost.node} {'is gone' if lost.node_gone else 'is not Ready'}"


def lost_message(lost: LostProxy) -> str:
    """The Event's message when a proxy becomes lost."""
    return (
        f"{lost.pod} is stuck terminating: its grace period ended at {_stamp(lost.grace_ended_at)} and "
        f"{_why(lost)}; force-deleting it at {_stamp(lost.force_delete_at)} unless the node returns, "
        "then its replacement is created"
    )


def force_delete_message(lost: LostProxy) -> str:
    """The Event's message when a lost proxy is force-deleted."""
    return (
        f"force-deleted {lost.pod} (grace period 0): stuck terminating since {_stamp(lost.grace_ended_at)}, "
        f"{_why(lost)}; its replacement is created next"
    )


def lost_condition(lost: Sequence[LostProxy], generation: int = 0) -> Condition:
    """The fleet's ProxiesLost condition. The message holds fixed times only (not countdowns), so
    it does not change from pass to pass."""
    if not lost:
        message = "no proxy is stuck on a lost node"
        return Condition(PROXIES_LOST, "False", "NoneLost", message, "", generation)
    items = [
        f"{p.pod} on {p.node} ({'gone' if p.node_gone else 'NotReady'}, "
        f"force-deleted at {_stamp(p.force_delete_at)})"
        for p in lost
    ]
    shown = ", ".join(items[:MAX_NAMES_IN_MESSAGE])
    if len(items) > MAX_NAMES_IN_MESSAGE:
        shown += f" and {len(items) - MAX_NAMES_IN_MESSAGE} more"
    message = f"stuck terminating on lost nodes: {shown}"
    return Condition(PROXIES_LOST, "True", NODE_LOST, message, "", generation)
