"""Events: one per cause, counted, patched at most once a minute; a new one after a quiet hour."""

from __future__ import annotations

from rolloutfleet_operator.events import SERIES_WINDOW_S, UPDATE_INTERVAL_S, EventRecorder, Series, next_step

FLEET = {
    "apiVersion": "rolloutfleet.dev/v1alpha1",
    "kind": "RolloutFleet",
    "metadata": {"name": "f", "namespace": "rl", "uid": "u1"},
}


class EventsApi:
    """The Event requests the recorder makes, answered as the API server does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.gone: set[str] = set()

    def create(self, path: str, body: dict) -> dict:
        name = f"{body['metadata']['generateName']}{len(self.calls)}"
        self.calls.append(("create", body))
        return {**body, "metadata": {**body["metadata"], "name": name}}

    def patch(self, path: str, body: dict) -> dict | None:
        self.calls.append(("patch", {"name": path.rsplit("/", 1)[-1], **body}))
        return None if path.rsplit("/", 1)[-1] in self.gone else body


def test_next_step():
    assert next_step(None, 0.0) == "create"
    series = Series("e", 3, 0.0, 10.0, 0.0)
    assert next_step(series, 20.0) == "count"
    assert next_step(series, UPDATE_INTERVAL_S) == "update"
    assert next_step(series, 10.0 + SERIES_WINDOW_S + 1) == "create"


async def test_a_cause_recurring_every_pass_is_one_event_counted():
    now = [0.0]
    api = EventsApi()
    recorder = EventRecorder(api, clock=lambda: now[0])  # type: ignore[arg-type]
    for second in range(0, 100, 10):  # a refused create every 10 s pass
        now[0] = float(second)
        await recorder.post_event(FLEET, "Warning", "FailedCreate", "Pod/f-proxy-0: exceeded quota")
    assert [c[0] for c in api.calls] == ["create", "patch"]
    created = api.calls[0][1]
    assert created["count"] == 1 and created["involvedObject"]["uid"] == "u1"
    assert created["reason"] == "FailedCreate" and created["type"] == "Warning"
    assert api.calls[1][1]["count"] == 7  # the occurrences at 0, 10, ..., 60 s
    # Another cause is another Event.
    await recorder.post_event(FLEET, "Warning", "FailedCreate", "Pod/f-proxy-1: exceeded quota")
    assert [c[0] for c in api.calls] == ["create", "patch", "create"]


async def test_after_a_quiet_hour_or_an_expired_event_a_new_one_starts():
    now = [0.0]
    api = EventsApi()
    recorder = EventRecorder(api, clock=lambda: now[0])  # type: ignore[arg-type]
    await recorder.post_event(FLEET, "Normal", "Created", "created proxy pod f-proxy-0")
    now[0] = SERIES_WINDOW_S + 1
    await recorder.post_event(FLEET, "Normal", "Created", "created proxy pod f-proxy-0")
    assert [c[0] for c in api.calls] == ["create", "create"]
    api.gone.add(api.calls[-1][1]["metadata"]["generateName"] + "1")  # the API server dropped it (TTL)
    now[0] += UPDATE_INTERVAL_S
    await recorder.post_event(FLEET, "Normal", "Created", "created proxy pod f-proxy-0")
    assert [c[0] for c in api.calls] == ["create", "create", "patch", "create"]
