"""Cancelled turns stop their generation on the engine, through the real sglang-router.

sglang-router 0.3.2 has no `/abort_request` route (it answers 404), so the abort travels as SGLang
defines it for a client that goes away: the proxy cancels the turn's upstream call, which closes its
connection to the router; the router drops its request to the engine, and the engine, seeing its
client gone, aborts that rid (`TokenizerManager._wait_one_response`, emulated). The emulators count
it: the rid ends with finish `abort` and fewer tokens than it was allowed.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from proxy_harness import bearer, running_proxy
from rolloutfleet_testkit.routed_engines import routed_emulators

MAX_TOKENS = 400
# Slow decoding, so a turn is still generating when its client leaves; the EOS bonus of the
# emulator's model ends greedy generations within a few dozen tokens, well under MAX_TOKENS.
TOKEN_DELAY_S = 0.1
MESSAGES = [{"role": "user", "content": "count slowly"}]


def _engine_requests(engines: list[str], session_id: str) -> tuple[list[str], list[dict]]:
    """(running rids, ended requests) of this session's engine requests, over every engine (the
    proxy names each `<session id>-<turn>-...`)."""
    running: list[str] = []
    ended: list[dict] = []
    for url in engines:
        stats = httpx.get(f"{url}/emulator_stats").json()
        running += [rid for rid in stats["running_rids"] if rid.startswith(f"{session_id}-")]
        ended += [r for r in stats["ended"] if r["rid"].startswith(f"{session_id}-")]
    return running, ended


def _running_rid(engines: list[str], session_id: str) -> str:
    (rid,) = _wait_for(lambda: _engine_requests(engines, session_id)[0], 30, "the turn to reach an engine")
    return rid


def _ended(engines: list[str], session_id: str) -> list[dict]:
    return _wait_for(lambda: _engine_requests(engines, session_id)[1], 10, "the engine to end the request")


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _open_turn(proxy_url: str, session_id: str, key: str) -> socket.socket:
    """A chat request sent on a raw socket, left unanswered: closing the socket is the client leaving."""
    address = urlsplit(proxy_url)
    body = orjson.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})
    head = (
        f"POST /v1/sessions/{session_id}/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    client = socket.create_connection((address.hostname, address.port))
    client.sendall(head.encode() + body)
    return client


@pytest.fixture
def routed_proxy(test_tokenizer_dir, tmp_path):
    with (
        routed_emulators(test_tokenizer_dir, tmp_path, token_delay_s=TOKEN_DELAY_S) as (router_url, engines),
        running_proxy(router_url, test_tokenizer_dir, None) as proxy,
    ):
        yield router_url, engines, proxy


@pytest.mark.router
def test_the_router_has_no_abort_route(routed_proxy):
    """Why the abort travels as a closed connection: sglang-router 0.3.2 does not forward it."""
    router_url, _, _ = routed_proxy
    assert httpx.post(f"{router_url}/abort_request", json={"rid": "any"}).status_code == 404


@pytest.mark.router
def test_a_client_that_disconnects_mid_generation_stops_the_engine(routed_proxy):
    _, engines, proxy = routed_proxy
    session_id, key = proxy.create_session()
    client = _open_turn(proxy.url, session_id, key)
    try:
        rid = _running_rid(engines, session_id)
    finally:
        client.close()
    ended = _ended(engines, session_id)
    assert ended == [{"rid": rid, "finish": "abort", "output_tokens": ended[0]["output_tokens"]}]
    assert ended[0]["output_tokens"] < MAX_TOKENS
    _wait_for(lambda: proxy.stats()["totals"]["turns_client_gone"] == 1, 10, "the proxy to count the turn")
    totals = proxy.stats()["totals"]
    assert totals["turns"] == 0 and totals["turns_cancelled"] == 1
    # Nothing was recorded: the session takes the same turn again, and it runs to its end.
    again = httpx.post(
        f"{proxy.url}/v1/sessions/{session_id}/chat/completions",
        headers=bearer(key),
        json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert again.status_code == 200, again.text
    assert again.json()["rolloutfleet"]["turn"] == 0


@pytest.mark.router
def test_a_session_deleted_mid_generation_stops_the_engine(routed_proxy):
    _, engines, proxy = routed_proxy
    session_id, key = proxy.create_session()
    client = _open_turn(proxy.url, session_id, key)
    try:
        rid = _running_rid(engines, session_id)
        assert httpx.delete(f"{proxy.url}/v1/sessions/{session_id}", headers=bearer(key)).status_code == 204
        ended = _ended(engines, session_id)
        assert [(r["rid"], r["finish"]) for r in ended] == [(rid, "abort")]
        answer = client.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 410") and "session_deleted" in answer
    finally:
        client.close()
    assert proxy.stats()["totals"]["turns_client_gone"] == 0


@pytest.mark.router
def test_a_turn_whose_client_waits_is_not_aborted(routed_proxy):
    _, engines, proxy = routed_proxy
    session_id, key = proxy.create_session()
    response = httpx.post(
        f"{proxy.url}/v1/sessions/{session_id}/chat/completions",
        headers=bearer(key),
        json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    running, ended = _engine_requests(engines, session_id)
    assert running == []
    assert [r["finish"] for r in ended] == [response.json()["choices"][0]["finish_reason"]]
    assert ended[0]["output_tokens"] == response.json()["usage"]["completion_tokens"]
    totals = proxy.stats()["totals"]
    assert totals["turns"] == 1 and totals["turns_cancelled"] == 0
