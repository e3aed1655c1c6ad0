"""The one mapping from domain failures to HTTP answers, and the shared error vocabulary."""

from __future__ import annotations

import pytest
from rolloutfleet_proxy import failures
from rolloutfleet_proxy.errors import http_error
from rolloutfleet_wire.errors import RETRY_LATER, ErrorCode


def _all_failures() -> list[type[failures.Failure]]:
    pending, found = [failures.Failure], []
    while pending:
        for sub in pending.pop().__subclasses__():
            found.append(sub)
            pending.append(sub)
    return found


@pytest.mark.parametrize("kind", _all_failures(), ids=lambda kind: kind.__name__)
def test_every_failure_maps_to_its_code_and_a_client_status(kind):
    failure = kind.__new__(kind)  # the facts do not matter to the mapping, only the kind
    failures.Failure.__init__(failure, "why")
    if kind is failures.DeletionNotDurable:  # answers as its cause does, with its own message
        failure.cause = failures.StorageUnavailable("the deletion was not recorded", "read-only")
        failure.code = failure.cause.code
    elif not hasattr(kind, "code"):
        failure.code = ErrorCode.BATCH_EXPIRED  # a code per instance
    answer = http_error(failure)
    assert answer.code is failure.code and answer.message == "why"
    # SGLang's failures: 502, 504
    gateway = kind in (
        failures.UpstreamFailed,
        failures.UpstreamTimedOut,
        failures.UpstreamImageMismatch,
        failures.UpstreamRoutingMissing,
    )
    assert 400 <= answer.status < 500 or answer.status == 503 or (gateway and answer.status in (502, 504))
    assert ("Retry-After" in answer.headers) == (answer.status == 503 or kind is failures.SessionBeingWritten)


def test_domain_failures_keep_their_messages():
    assert failures.SessionEnded("s-00000001", "dumped").message == "session s-00000001 has ended: dumped"
    many = failures.UnknownSessions([f"s-{i:08d}" for i in range(22)])
    assert many.message.endswith("s-00000019 and 2 more")
    assert http_error(failures.ShuttingDown("bye")).headers == {"Retry-After": "2"}


def test_a_deletion_not_made_durable_answers_as_its_cause_and_says_so():
    answer = http_error(failures.DeletionNotDurable("s-00000001", failures.ShuttingDown("closing")))
    assert (answer.status, answer.code, answer.headers) == (503, ErrorCode.DRAINING, {"Retry-After": "2"})
    assert answer.message.startswith("session s-00000001 is deleted here, but the deletion could not be")
    assert answer.message.endswith("(closing)")


def test_session_busy_is_one_code_with_or_without_retry_after():
    in_flight = http_error(failures.TurnInFlight("s-00000001"))
    assert (in_flight.status, in_flight.code, in_flight.headers) == (409, ErrorCode.SESSION_BUSY, {})
    assert in_flight.message == "session s-00000001 already has a turn in flight"
    written = http_error(failures.SessionBeingWritten("s-00000001"))
    assert (written.status, written.code, written.headers) == (
        409,
        ErrorCode.SESSION_BUSY,
        {"Retry-After": "1"},
    )


def test_retry_later_codes_are_members_with_their_wire_values():
    assert {code.value for code in RETRY_LATER} >= {"draining", "storage_unavailable", "generation_paused"}
    assert ErrorCode("request_budget_exhausted") is ErrorCode.REQUEST_BUDGET
