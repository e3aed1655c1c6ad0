"""Leader election's pure rules (who creates, takes over, renews or waits) and the standby's health
endpoint; the Lease against a real API server and a killed leader are in e2e/tests/test_operator_ha.py."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time

import httpx
import pytest
from rolloutfleet_operator.leadership import (
    Election,
    Leadership,
    LeaseClient,
    StandbyHealth,
    lease_action,
    lease_spec,
    observe,
    released_spec,
    reset_connections_on_close,
)
from rolloutfleet_testkit.processes import free_port

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
ELECTION = Election(namespace="ops", name="rolloutfleet-operator", identity="op-a", lease_duration_s=15)


def lease(
    holder: str | None, renewed: str | None = "2026-01-01T11:00:00.000000Z", version: str = "7"
) -> dict:
    """A Lease as read. Its renewTime is the holder's clock, never compared with ours: far in the
    past here on purpose (a holder whose clock lags by an hour still holds a live Lease)."""
    spec: dict = {"leaseDurationSeconds": 15}
    if holder is not None:
        spec["holderIdentity"] = holder
    if renewed is not None:
        spec["renewTime"] = renewed
    return {"metadata": {"resourceVersion": version}, "spec": spec}


def seen(current: dict | None, seconds_ago: float, now: float = 1000.0):
    return observe(current, None, now - seconds_ago)


@pytest.mark.parametrize(
    ("current", "seen_s_ago", "action"),
    [
        (None, 0, "create"),
        (lease("op-a"), 3, "renew"),
        (lease("op-a"), 60, "renew"),  # our own, even late: renewing it is still ours to do
        (lease("op-b"), 0, "wait"),  # first read: however old its renewTime looks, it may be live
        (lease("op-b"), 14.9, "wait"),
        (lease("op-b"), 15, "take"),  # unchanged for a whole lease duration on our own clock
        (lease(None), 0, "take"),  # released
    ],
)
def test_lease_action_times_expiry_on_this_replicas_clock(current, seen_s_ago, action):
    assert lease_action(current, "op-a", seen(current, seen_s_ago), 1000.0) == action


def test_a_renewed_lease_restarts_the_wait():
    first = observe(lease("op-b", version="7"), None, 100.0)
    assert observe(lease("op-b", version="7"), first, 110.0) is first  # unchanged: the wait goes on
    renewed = observe(lease("op-b", "2026-01-01T11:00:05.000000Z", version="8"), first, 116.0)
    assert renewed is not None and renewed.since == 116.0
    assert lease_action(lease("op-b", version="8"), "op-a", renewed, 117.0) == "wait"
    assert lease_action(lease("op-b", version="7"), "op-a", first, 117.0) == "take"


def test_a_released_lease_has_no_holder_and_a_short_duration():
    released = released_spec(lease("op-a"), NOW)
    assert "holderIdentity" not in released and released["leaseDurationSeconds"] == 1
    assert released["renewTime"] == "2026-01-01T12:00:00.000000Z"


class StalledApi:
    """An API server connection that hangs: every call blocks as long as its timeout allows."""

    def __init__(self):
        self.timeouts: list[float] = []

    def request(self, method, path, body=None, query=None, content_type=None, timeout=30):
        self.timeouts.append(timeout)
        time.sleep(timeout)
        raise TimeoutError("stalled")


def test_a_stalled_renewal_gives_the_lease_up_before_a_standby_could_take_it():
    election = Election("ops", "lease", "op-a", lease_duration_s=3, renew_every_s=0.3)
    api = StalledApi()
    lost = threading.Event()
    started = time.monotonic()
    Leadership(LeaseClient(api, election), on_lost=lost.set).start()
    assert lost.wait(10)
    elapsed = time.monotonic() - started
    # Lost by two thirds of the lease (2 s) plus a renew interval, never after the lease (3 s), though
    # the client's default timeout is 30 s: each call was bounded by the time left.
    assert elapsed < 3.0, elapsed
    assert api.timeouts and max(api.timeouts) <= 2.0


class SlowReadApi:
    """Reads answer our own Lease after `read_s`; writes hang as long as their timeout allows."""

    def __init__(self, read_s: float):
        self.read_s = read_s
        self.write_timeouts: list[float] = []

    def request(self, method, path, body=None, query=None, content_type=None, timeout=30):
        if method == "GET":
            time.sleep(self.read_s)
            return lease("op-a")
        self.write_timeouts.append(timeout)
        time.sleep(timeout)
        raise TimeoutError("stalled")


def test_one_renewal_attempt_reads_and_writes_within_the_time_it_is_given():
    api = SlowReadApi(read_s=0.6)
    client = LeaseClient(api, Election("ops", "lease", "op-a"))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.try_to_lead(timeout_s=1.0)
    # The write had what the slow read left of the second, not a second of its own.
    assert api.write_timeouts and max(api.write_timeouts) <= 0.41
    assert time.monotonic() - started < 1.2


def test_lease_spec_records_the_holder_and_counts_transitions():
    created = lease_spec(ELECTION, NOW, None, "create")
    assert created == {
        "holderIdentity": "op-a",
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-01-01T12:00:00.000000Z",
        "renewTime": "2026-01-01T12:00:00.000000Z",
        "leaseTransitions": 0,
    }
    taken = lease_spec(
        ELECTION, NOW, {"spec": {**created, "holderIdentity": "op-b", "leaseTransitions": 2}}, "take"
    )
    assert taken["holderIdentity"] == "op-a" and taken["leaseTransitions"] == 3
    later = NOW + datetime.timedelta(seconds=5)
    renewed = lease_spec(ELECTION, later, {"spec": taken}, "renew")
    assert renewed["acquireTime"] == taken["acquireTime"] and renewed["leaseTransitions"] == 3
    assert renewed["renewTime"] == "2026-01-01T12:00:05.000000Z"


def test_a_standby_answers_its_probes_and_frees_the_port_for_kopf():
    port = free_port()
    standby = StandbyHealth("127.0.0.1", port)
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert response.status_code == 200 and response.text == "standby\n"
    finally:
        standby.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    StandbyHealth("127.0.0.1", port).close()  # the port can be bound again at once


def test_a_leaving_leader_resets_its_connections_so_nothing_queued_arrives_later():
    """A request still in a socket when the leader exits must not reach the API server after a standby
    took over: every TCP connection of the process is set to reset on close (SO_LINGER 0)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    unix_a, unix_b = socket.socketpair()  # not TCP: left alone
    try:
        assert reset_connections_on_close() >= 2  # the client's end and the accepted one, at least
        for sock in (client, accepted):
            assert struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 0)
        assert struct.unpack("ii", unix_a.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))[0] == 0
        client.sendall(b"a request queued")
        client.close()  # reset: the peer sees the connection reset instead of an orderly end
        with pytest.raises(ConnectionResetError):
            while accepted.recv(1024):
                pass
    finally:
        for sock in (server, accepted, unix_a, unix_b):
            sock.close()
