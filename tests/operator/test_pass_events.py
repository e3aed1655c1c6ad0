"""The Events a pass posts on its fleet (pass_events.py): one per kind of action naming every object,
cut to an Event's size; failures and lost proxies one per cause."""

from __future__ import annotations

from rolloutfleet_operator.events import MAX_MESSAGE_CHARS
from rolloutfleet_operator.lost_proxies import LostProxy, lost_message
from rolloutfleet_operator.pass_events import names_message, pass_events
from rolloutfleet_operator.reconcile import PassResult


def pods(count: int, fleet: str = "f") -> list[str]:
    return [f"{fleet}-proxy-{ordinal}" for ordinal in range(count)]


def test_a_new_fleets_pass_posts_one_event_for_its_children_and_one_for_its_pods():
    result = PassResult(created=pods(16), created_children=["Service/f-gateway", "Deployment/f-gateway"])
    events = pass_events(result)
    assert events == [
        ("Normal", "Created", "created 2 child objects: Service/f-gateway, Deployment/f-gateway"),
        ("Normal", "Created", "created 16 proxy pods: " + ", ".join(pods(16))),
    ]


def test_one_object_reads_as_before():
    assert pass_events(PassResult(created=["f-proxy-0"], created_children=["Secret/f-admin"])) == [
        ("Normal", "Created", "created Secret/f-admin"),
        ("Normal", "Created", "created proxy pod f-proxy-0"),
    ]


def test_deletions_are_grouped_by_reason_in_the_order_they_were_taken():
    deleted = [("f-proxy-3", "ScaleDown"), ("f-proxy-0", "Down"), ("f-proxy-2", "ScaleDown")]
    assert pass_events(PassResult(deleted=deleted)) == [
        ("Normal", "ScaleDown", "deleted 2 proxy pods: f-proxy-3, f-proxy-2 (ScaleDown)"),
        ("Normal", "Down", "deleted proxy pod f-proxy-0 (Down)"),
    ]


def test_a_long_list_is_cut_to_an_events_size_and_says_how_many_it_left_out():
    names = pods(500, fleet="a-fleet-with-a-long-name")
    message = names_message("created", "proxy pod", names)
    assert len(message) <= MAX_MESSAGE_CHARS
    assert message.startswith("created 500 proxy pods: a-fleet-with-a-long-name-proxy-0, ")
    listed = message.split(": ", 1)[1].split(" and ")[0].split(", ")
    assert listed == names[: len(listed)]
    assert message.endswith(f" and {500 - len(listed)} more")
    suffixed = names_message("deleted", "proxy pod", names, " (RollingUpdate)")
    assert len(suffixed) <= MAX_MESSAGE_CHARS and suffixed.endswith(" more (RollingUpdate)")


def test_failures_and_lost_proxies_stay_one_event_per_cause():
    lost = LostProxy("f-proxy-1", "uid-1", "n1", False, 1_767_225_600.0, 1_767_225_900.0)
    result = PassResult(
        failures=["quota exceeded: a", "webhook refused: b"], lost=[lost], adopted=["f-proxy-4"]
    )
    events = pass_events(result)
    assert [reason for _, reason, _ in events] == ["FailedCreate", "FailedCreate", "Adopted", "ProxyLost"]
    assert events[-1] == ("Warning", "ProxyLost", lost_message(lost))
    assert events[2] == ("Normal", "Adopted", "adopted the orphaned proxy pod f-proxy-4")
