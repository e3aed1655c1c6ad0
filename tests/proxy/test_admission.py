"""Staleness-bounded admission: the capacity arithmetic as tables, then over real sockets, including a
real restart at model version 268 and the pause that lets the trainer swap weights."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from proxy_harness import ADMIN, chat_body, play_session, running_proxy
from rolloutfleet_proxy.admission import (
    AdmissionLimits,
    accepted_after_version_change,
    admission_capacity,
    concurrency_capacity,
    is_training_step,
    limiting_bound,
    rebased_accepted,
    staleness_capacity,
)
from rolloutfleet_proxy.storage.state_file import STATE_FILE, ProxyState, decode_state, encode_state
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app

# --- the arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_staleness", "version", "share", "accepted", "running", "expected"),
    [
        (None, 5, 4, 0, 0, None),  # no bound
        (0, 0, 1, 0, 0, 1),  # fully on-policy: one batch share at a time
        (2, 0, 4, 0, 0, 12),  # (2 + 0 + 1) * 4
        (2, 0, 4, 5, 3, 4),
        (2, 10, 4, 40, 0, 12),  # accepted kept pace with the version: the same room as at 0
        (2, 10, 4, 52, 0, 0),  # ran ahead by max_staleness batches: no room until the next version
        (2, 10, 4, 50, 7, -5),  # over the bound (restored sessions can do that): still refused
        (2, 268, 4, 0, 0, 1084),  # a counter restarted at 0 at version 268
        (2, 268, 4, 1072, 5, 7),  # the same after the rebase, with 5 rollouts running
        (1, 0, 0, 0, 0, 2),  # a share below 1 counts as 1
    ],
)
def test_staleness_capacity(max_staleness, version, share, accepted, running, expected):
    assert staleness_capacity(max_staleness, version, share, accepted, running) == expected


@pytest.mark.parametrize(
    ("max_concurrent", "running", "expected"), [(0, 5, None), (10, 3, 7), (10, 10, 0), (10, 12, -2)]
)
def test_concurrency_capacity(max_concurrent, running, expected):
    assert concurrency_capacity(max_concurrent, running) == expected


@pytest.mark.parametrize(
    ("limits", "version", "accepted", "running", "capacity", "bound"),
    [
        (AdmissionLimits(None, 4, 0), 9, 0, 500, None, None),  # both bounds off: unbounded
        (AdmissionLimits(2, 4, 10), 0, 0, 0, 10, None),  # min(10 - 0, 12 - 0)
        (AdmissionLimits(2, 4, 10), 0, 0, 9, 1, None),  # min(10 - 9, 12 - 9)
        (AdmissionLimits(2, 4, 10), 0, 3, 9, 0, "staleness"),  # min(1, 12 - 12)
        (AdmissionLimits(2, 4, 10), 0, 0, 10, 0, "concurrency"),  # concurrency is checked first
        (AdmissionLimits(None, 1, 5), 0, 1000, 2, 3, None),  # concurrency bound alone
        (AdmissionLimits(0, 2, 0), 3, 6, 1, 1, None),  # staleness bound alone: (0 + 3 + 1) * 2 - 7
    ],
)
def test_admission_capacity_is_the_smaller_bound(limits, version, accepted, running, capacity, bound):
    assert admission_capacity(limits, version, accepted, running) == capacity
    assert limiting_bound(limits, version, accepted, running) == bound
    assert limits.enabled == (limits.max_staleness is not None or limits.max_concurrent > 0)


@pytest.mark.parametrize(
    ("max_staleness", "share", "version", "running", "unconsumed"),
    [
        (0, 1, 0, 0, 0),  # recovery at version 0
        (2, 4, 0, 3, 1),  # at version 0, with rollouts running and a trajectory not yet consumed
        (2, 4, 268, 0, 0),  # at a large version
        (2, 4, 268, 5, 3),  # at a large version with rollouts running
        (4, 16, 268, 100, 0),  # more restored sessions than the bound: over capacity, refused
        (8, 3, 100_000, 2, 7),
    ],
)
def test_recovery_bounds_capacity_whatever_the_version(max_staleness, share, version, running, unconsumed):
    accepted = rebased_accepted(version, share, unconsumed)
    assert accepted == version * share + unconsumed
    capacity = staleness_capacity(max_staleness, version, share, accepted, running)
    assert capacity == (max_staleness + 1) * share - unconsumed - running
    assert capacity <= (max_staleness + 1) * share
    # Without the rebase (counting restarted at 0), the same recovery would admit this many at once:
    inflated = staleness_capacity(max_staleness, version, share, 0, running)
    assert inflated - capacity == version * share + unconsumed


@pytest.mark.parametrize(
    ("accepted", "old", "new", "share", "unconsumed", "expected"),
    [
        (40, 10, 10, 4, 2, 40),  # the same version again: nothing to do
        (40, 10, 11, 4, 2, 40),  # one training step: counting goes on (AReaL)
        (0, 0, 1, 4, 0, 0),
        (0, 0, 268, 4, 0, 1072),  # a new replica hears the fleet's version for the first time
        (40, 10, 12, 4, 2, 50),  # a jump over versions: rebased
        (1100, 275, 250, 4, 3, 1003),  # the trainer went back to a checkpoint: rebased down
    ],
)
def test_accepted_after_version_change(accepted, old, new, share, unconsumed, expected):
    assert accepted_after_version_change(accepted, old, new, share, unconsumed) == expected
    assert is_training_step(old, new) == (new in (old, old + 1))


def test_state_document_round_trip_and_rejects_bad_fields():
    state = ProxyState(model_version=268, paused=True, enqueued=9, accepted=1075, rejected=1, refused=2)
    assert decode_state(encode_state(state)) == state
    for bad in (b"{", b"[]", b'{"format": "x"}'):
        with pytest.raises(ValueError):
            decode_state(bad)
    document = orjson.loads(encode_state(state))
    for field, value in (("model_version", -1), ("paused", 1), ("accepted", True), ("enqueued", "9")):
        with pytest.raises(ValueError, match=field):
            decode_state(orjson.dumps({**document, field: value}))


# --- over real sockets ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast_upstream_url():
    with serve_app(create_stub_app(latency_s=0.0, output_tokens=3)) as url:
        yield url


@pytest.fixture(scope="module")
def slow_upstream_url():
    with serve_app(create_stub_app(latency_s=0.6, output_tokens=3)) as url:
        yield url


def create(proxy) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN)


def set_version(proxy, version) -> httpx.Response:
    return httpx.put(
        f"{proxy.url}/v1/generation/model_version", headers=ADMIN, json={"model_version": version}
    )


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "over_capacity"


def test_admission_refuses_beyond_capacity_and_counts(fast_upstream_url, test_tokenizer_dir, tmp_path):
    limits = {"max_staleness": 1, "staleness_batch_share": 2}  # (1 + version + 1) * 2
    with running_proxy(fast_upstream_url, test_tokenizer_dir, tmp_path / "d", **limits) as proxy:
        created = [create(proxy) for _ in range(4)]
        assert [r.status_code for r in created] == [201] * 4
        refused = create(proxy)
        assert_refused(refused)
        assert "max_staleness 1" in refused.json()["error"]["message"]
        # Finishing frees no staleness room: accepted + running stays 4.
        for r in created[:2]:
            auth = {"Authorization": f"Bearer {r.json()['session_key']}"}
            assert httpx.post(
                f"{proxy.url}/v1/sessions/{r.json()['session_id']}/finish", headers=auth
            ).is_success
        assert_refused(create(proxy))
        admission = proxy.stats()["admission"]
        assert (admission["enqueued"], admission["running"], admission["accepted"]) == (4, 2, 2)
        assert (admission["refused"], admission["capacity"]) == (2, 0)
        # A new model version (one step: no rebase) makes room for one more batch share.
        changed = set_version(proxy, 1)
        assert changed.json() == {
            "model_version": 1,
            "previous_model_version": 0,
            "rebased": False,
            "persisted": True,
        }
        assert proxy.stats()["admission"]["capacity"] == 2
        more = [create(proxy) for _ in range(3)]
        assert [r.status_code for r in more[:2]] == [201, 201]
        assert_refused(more[2])
        # A session deleted before it finished is rejected: it leaves running, never reaches accepted.
        gone = more[0].json()
        assert httpx.delete(f"{proxy.url}/v1/sessions/{gone['session_id']}", headers=ADMIN).status_code == 204
        admission = proxy.stats()["admission"]
        assert (admission["running"], admission["accepted"], admission["rejected"]) == (3, 2, 1)
        metrics = httpx.get(f"{proxy.url}/metrics").text
        for line in (
            "rolloutfleet_proxy_admission_enqueued_total 6.0",
            "rolloutfleet_proxy_admission_running 3.0",
            "rolloutfleet_proxy_admission_accepted 2.0",
            "rolloutfleet_proxy_admission_rejected_total 1.0",
            "rolloutfleet_proxy_admission_refused_total 3.0",
            "rolloutfleet_proxy_admission_capacity 1.0",
            "rolloutfleet_proxy_model_version 1.0",
        ):
            assert line in metrics, line


def test_concurrency_bound_alone_and_no_bound(fast_upstream_url, test_tokenizer_dir, tmp_path):
    with running_proxy(
        fast_upstream_url, test_tokenizer_dir, tmp_path / "a", max_concurrent_sessions=2
    ) as proxy:
        first, _ = create(proxy).json(), create(proxy)
        assert_refused(create(proxy))
        auth = {"Authorization": f"Bearer {first['session_key']}"}
        httpx.post(f"{proxy.url}/v1/sessions/{first['session_id']}/finish", headers=auth)
        assert create(proxy).status_code == 201  # finishing frees a concurrency slot
    with running_proxy(fast_upstream_url, test_tokenizer_dir, tmp_path / "b") as proxy:
        assert all(create(proxy).status_code == 201 for _ in range(20))
        admission = proxy.stats()["admission"]
        assert admission["enabled"] is False and admission["capacity"] is None
        assert "rolloutfleet_proxy_admission_capacity +Inf" in httpx.get(f"{proxy.url}/metrics").text


def test_restart_at_version_268_keeps_capacity_bounded(fast_upstream_url, test_tokenizer_dir, tmp_path):
    """Real restarts on one dump directory: the version and pause come back, `accepted` is rebased to
    268 x share plus the trajectories not yet consumed, restored sessions count as running."""
    dumps = tmp_path / "dumps"
    limits = {"max_staleness": 2, "staleness_batch_share": 4}  # bound: (2 + 1) * 4 = 12 past the anchor
    with running_proxy(fast_upstream_url, test_tokenizer_dir, dumps, **limits) as first:
        assert set_version(first, 268).json()["rebased"] is True  # new to a fleet at 268: anchored
        for _ in range(3):
            assert create(first).status_code == 201  # running
        for _ in range(3):
            play_session(first)  # finished: ready trajectories
        exported = httpx.post(f"{first.url}/v1/exports", headers=ADMIN, json={"max_trajectories": 1})
        assert exported.status_code == 201  # one trajectory exported, never acknowledged
        assert first.stats()["admission"]["capacity"] == 12 - 3 - 3
        assert httpx.post(f"{first.url}/v1/generation/pause", headers=ADMIN).json()["paused"] is True
    state = orjson.loads((dumps / STATE_FILE).read_bytes())
    assert state["model_version"] == 268 and state["paused"] is True

    with running_proxy(fast_upstream_url, test_tokenizer_dir, dumps, **limits) as second:
        stats = second.stats()
        assert stats["model_version"] == 268 and stats["generation_paused"] is True
        assert stats["ready_trajectories"] == 2 and stats["export_trajectories"] == 1
        admission = stats["admission"]
        assert admission["running"] == 3 and admission["accepted"] == 268 * 4 + 3
        assert admission["capacity"] == 6
        assert [create(second).status_code for _ in range(6)] == [201] * 6
        assert_refused(create(second))

    # A predecessor whose counter restarted at 0 cannot inflate the successor's capacity.
    (dumps / STATE_FILE).write_bytes(orjson.dumps({**state, "accepted": 0}))
    with running_proxy(fast_upstream_url, test_tokenizer_dir, dumps, **limits) as third:
        admission = third.stats()["admission"]
        assert admission["running"] == 9 and admission["accepted"] == 268 * 4 + 3
        assert admission["capacity"] == 0
        assert_refused(create(third))


def test_corrupt_state_file_is_kept_aside_and_start_goes_on(fast_upstream_url, test_tokenizer_dir, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / STATE_FILE).write_bytes(
        b'{"format": "rolloutfleet.proxy-state", "format_version": 1, "model_ver'
    )
    with running_proxy(fast_upstream_url, test_tokenizer_dir, dumps, max_staleness=0) as proxy:
        stats = proxy.stats()
        assert stats["model_version"] == 0 and stats["totals"]["restore_failures"] == 1
        assert stats["admission"]["capacity"] == 1
        (kept,) = (dumps / "corrupt").iterdir()
        assert kept.name.startswith(STATE_FILE)
        # The trainer's version is then a jump, and rebased: still one batch share of room.
        assert set_version(proxy, 268).json()["rebased"] is True
        assert proxy.stats()["admission"]["capacity"] == 1


def test_bad_generation_input_gets_4xx_and_leaves_state_intact(
    fast_upstream_url, test_tokenizer_dir, tmp_path
):
    with running_proxy(fast_upstream_url, test_tokenizer_dir, tmp_path / "d", max_staleness=1) as proxy:
        assert set_version(proxy, 7).status_code == 200
        before = proxy.stats()
        url = f"{proxy.url}/v1/generation"
        cases = [
            (set_version(proxy, -1), 400, "invalid_model_version"),
            (set_version(proxy, "8"), 400, "invalid_model_version"),
            (set_version(proxy, 8.5), 400, "invalid_model_version"),
            (set_version(proxy, True), 400, "invalid_model_version"),
            (set_version(proxy, 2**31), 400, "invalid_model_version"),
            (set_version(proxy, None), 400, "invalid_model_version"),
            (httpx.put(f"{url}/model_version", headers=ADMIN, content=b"{"), 400, "invalid_json"),
            (httpx.put(f"{url}/model_version", headers=ADMIN, json=[8]), 400, "invalid_body"),
            (httpx.put(f"{url}/model_version", json={"model_version": 8}), 401, "unauthorized"),
            (httpx.post(f"{url}/pause", headers=ADMIN, params={"wait_s": -1}), 400, "invalid_parameter"),
            (httpx.post(f"{url}/pause", headers=ADMIN, params={"wait_s": "soon"}), 400, "invalid_parameter"),
            (httpx.post(f"{url}/pause", headers=ADMIN, params={"wait_s": "nan"}), 400, "invalid_parameter"),
            (httpx.post(f"{url}/pause"), 401, "unauthorized"),
            (httpx.get(url), 401, "unauthorized"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, (code, response.text)
            assert response.json()["error"]["code"] == code and response.json()["error"]["message"]
        after = proxy.stats()
        assert after["model_version"] == 7 and after["generation_paused"] is False
        assert after["admission"] == before["admission"]
        assert httpx.get(f"{url}/model_version", headers=ADMIN).json() == {"model_version": 7}


async def test_pause_lets_inflight_turns_finish_and_holds_new_ones(
    slow_upstream_url, test_tokenizer_dir, tmp_path
):
    with running_proxy(slow_upstream_url, test_tokenizer_dir, tmp_path / "d") as proxy:
        (sid1, key1), (sid2, key2) = proxy.create_session(), proxy.create_session()
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:

            def turn(sid, key):
                return client.post(
                    f"/v1/sessions/{sid}/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json=chat_body([{"role": "user", "content": "hi"}]),
                )

            in_flight = asyncio.create_task(turn(sid1, key1))
            await asyncio.sleep(0.2)  # the turn is in its upstream call
            started = time.monotonic()
            paused = await client.post("/v1/generation/pause", headers=ADMIN, params={"wait_s": 10})
            # The pause answered once the in-flight generation was done, not before, not at wait_s.
            assert 0.2 < time.monotonic() - started < 5
            assert paused.json()["paused"] is True and paused.json()["generating_turns"] == 0
            assert (await in_flight).status_code == 200

            held = asyncio.create_task(turn(sid2, key2))
            await asyncio.sleep(0.3)
            assert not held.done()
            state = (await client.get("/v1/generation", headers=ADMIN)).json()
            assert state["paused_turns"] == 1 and state["generating_turns"] == 0
            assert proxy.stats()["paused_turns"] == 1
            # The trainer swaps weights, publishes the version, resumes.
            await client.put("/v1/generation/model_version", headers=ADMIN, json={"model_version": 5})
            await client.post("/v1/generation/resume", headers=ADMIN)
            assert (await held).status_code == 200
        first = proxy.get(sid1, key1).json()["trajectory"]
        second = proxy.get(sid2, key2).json()["trajectory"]
        assert first["turn_versions"] == [0] and second["turn_versions"] == [5]


def test_turn_paused_too_long_gets_503_and_nothing_recorded(fast_upstream_url, test_tokenizer_dir, tmp_path):
    with running_proxy(
        fast_upstream_url, test_tokenizer_dir, tmp_path / "d", paused_turn_timeout_s=0.3
    ) as proxy:
        sid, key = proxy.create_session()
        before = proxy.get(sid, key).json()
        assert httpx.post(f"{proxy.url}/v1/generation/pause", headers=ADMIN).is_success
        started = time.monotonic()
        response = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=chat_body([{"role": "user", "content": "hi"}]),
        )
        assert 0.3 <= time.monotonic() - started < 3
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "generation_paused"
        assert proxy.get(sid, key).json() == before
        totals = proxy.stats()["totals"]
        assert totals["turns_pause_timeouts"] == 1 and totals["turns_failed"] == 0
        # After resuming, the same request goes through.
        assert httpx.post(f"{proxy.url}/v1/generation/resume", headers=ADMIN).json()["paused"] is False
        retried = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=chat_body([{"role": "user", "content": "hi"}]),
        )
        assert retried.status_code == 200


def test_admission_settings_from_flags_and_environment(monkeypatch):
    from rolloutfleet_proxy.settings import ENV, load_settings

    base = ["--upstream-url", "http://x", "--tokenizer-path", "/t", "--admin-key", "k", "--dump-dir", "/d"]
    assert load_settings(base).max_staleness is None  # unset: no staleness bound
    monkeypatch.setenv(ENV["max_staleness"], "4")
    monkeypatch.setenv(ENV["staleness_batch_share"], "16")
    settings = load_settings([*base, "--max-concurrent-sessions", "200", "--export-ttl-s", "30"])
    assert (settings.max_staleness, settings.staleness_batch_share) == (4, 16)
    assert (settings.max_concurrent_sessions, settings.export_ttl_s) == (200, 30.0)
    assert load_settings([*base, "--max-staleness", "0"]).max_staleness == 0
    for bad in (
        ["--max-staleness", "-1"],
        ["--staleness-batch-share", "0"],
        ["--paused-turn-timeout-s", "0"],
    ):
        with pytest.raises(ValueError):
            load_settings(base + bad)
