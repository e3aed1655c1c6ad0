"""The Events a pass posts on its fleet (pure): one per kind of action, not one per object.

A pass that creates a fleet's 16 proxy pods posts one `Created` Event naming them, as the Deployment
controller posts one `ScalingReplicaSet` per decision; one Event per pod (the ReplicaSet controller's
way) made 2,296 Events for an apply of 100 fleets, posted for minutes after every fleet was Ready
behind the client-side rate limit (docs/benchmarks.md, scale). The names stay in the message, so
`kubectl get events | grep POD` still finds a pod's creation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .events import MAX_MESSAGE_CHARS
from .lost_proxies import force_delete_message, lost_message
from .reconcile import PassResult

EventType = Literal["Normal", "Warning"]
FleetEvent = tuple[EventType, str, str]  # (type, reason, message)


def names_message(verb: str, noun: str, names: Sequence[str], suffix: str = "") -> str:
    """`created proxy pod a` / `created 3 proxy pods: a, b, c`, the names cut to fit an Event (pure)."""
    if len(names) == 1:
        return f"{verb} {noun} {names[0]}{suffix}"
    head = f"{verb} {len(names)} {noun}s: "
    listed: list[str] = []
    for index, name in enumerate(names):
        rest = len(names) - index - 1
        more = f" and {rest} more" if rest else ""
        if len(head) + len(", ".join([*listed, name])) + len(more) + len(suffix) > MAX_MESSAGE_CHARS:
            return f"{head}{', '.join(listed)} and {len(names) - index} more{suffix}"
        listed.append(name)
    return f"{head}{', '.join(listed)}{suffix}"


def pass_events(result: PassResult) -> list[FleetEvent]:
    """What a pass's result posts on its fleet, in the order the actions were taken (pure).
    Failures stay one Event per cause (each is counted while it recurs: events.py)."""
    events: list[FleetEvent] = []
    children = result.created_children
    if len(children) == 1:
        events.append(("Normal", "Created", f"created {children[0]}"))
    elif children:
        events.append(("Normal", "Created", names_message("created", "child object", children)))
    for child in result.deleted_children:
        events.append(("Normal", "Deleted", f"deleted {child}: the spec no longer wants it"))
    if result.created:
        events.append(("Normal", "Created", names_message("created", "proxy pod", result.created)))
    reasons = dict.fromkeys(reason for _, reason in result.deleted)  # first-seen order
    for reason in reasons:
        pods = [pod for pod, why in result.deleted if why == reason]
        events.append(("Normal", reason, names_message("deleted", "proxy pod", pods, f" ({reason})")))
    events.extend(("Warning", "FailedCreate", failure) for failure in result.failures)
    if result.adopted:
        message = names_message("adopted the orphaned", "proxy pod", result.adopted)
        events.append(("Normal", "Adopted", message))
    events.extend(("Warning", "ProxyLost", lost_message(lost)) for lost in result.lost)
    events.extend(("Warning", "ForceDeleted", force_delete_message(lost)) for lost in result.force_deleted)
    return events
