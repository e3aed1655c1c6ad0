"""Trajectory export with acknowledged drain, over real sockets: export, re-request, acknowledge, TTL
dump, drain and restore across a real restart, bad input."""

from __future__ import annotations

import asyncio
import math

import httpx
import numpy as np
import pytest
from proxy_harness import ADMIN, ADMIN_KEY, play_session, running_proxy
from rolloutfleet_proxy.storage.dumps import EXPORTED_AREA, LIVE_EXPORTS_AREA
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import TOKEN_LOGPROB
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from rolloutfleet_testkit.waiting import wait_for
from rolloutfleet_wire.export_format import MEDIA_TYPE, decode_batch

OUTPUT_TOKENS = 3


@pytest.fixture(scope="module")
def upstream_url():
    with serve_app(create_stub_app(latency_s=0.0, output_tokens=OUTPUT_TOKENS)) as url:
        yield url


@pytest.fixture
def proxy(upstream_url, test_tokenizer_dir, tmp_path):
    with running_proxy(upstream_url, test_tokenizer_dir, tmp_path / "dumps", cleanup_interval_s=0.05) as p:
        yield p


def export(proxy, params: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/exports", headers=ADMIN, json=body, params=params)


def ack(proxy, batch_id: str) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/exports/{batch_id}/ack", headers=ADMIN)


def test_export_then_ack_frees_the_buffer(proxy):
    version = httpx.put(f"{proxy.url}/v1/generation/model_version", headers=ADMIN, json={"model_version": 3})
    assert version.status_code == 200
    sid_a, key_a = play_session(proxy, turns=2, reward=1.0, turn_rewards={1: 0.25})
    sid_b, key_b = play_session(proxy, turns=1)  # no reward set
    sid_c, _ = play_session(proxy, turns=1, reward=0.0)
    expected = {
        sid: proxy.get(sid, key).json()["trajectory"] for sid, key in ((sid_a, key_a), (sid_b, key_b))
    }
    assert proxy.stats()["ready_trajectories"] == 3

    response = export(proxy, max_trajectories=2)
    assert response.status_code == 201 and response.headers["content-type"] == MEDIA_TYPE
    batch_id = response.headers["x-rolloutfleet-batch-id"]
    assert response.headers["location"] == f"/v1/exports/{batch_id}"
    assert response.headers["x-rolloutfleet-trajectories"] == "2"
    batch = decode_batch(response.content)
    assert batch.batch_id == batch_id and batch.header["model_version"] == 3
    assert [t["session_id"] for t in batch.header["trajectories"]] == [sid_a, sid_b]  # finish order
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == len(t["input_ids"])
    for i, sid in enumerate((sid_a, sid_b)):
        got, want = batch.trajectory(i), expected[sid]
        assert got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]
        assert got["logprobs"] == pytest.approx(want["logprobs"])
        assert got["attention_mask"] == [1] * len(want["input_ids"])
        assert got["turn_bounds"] == want["turns"]
        # Generated tokens carry the version they were generated under; the rest -1.
        assert got["versions"] == [3 if m else -1 for m in want["loss_mask"]]
        assert got["turn_versions"] == [3] * len(want["turns"])
    assert batch.trajectory(0)["reward"] == 1.0 and batch.trajectory(0)["turn_rewards"] == [None, 0.25]
    assert batch.trajectory(1)["reward"] is None and math.isnan(t["rewards"][1])
    assert t["logprobs"][t["loss_mask"] == 1].tolist() == [TOKEN_LOGPROB] * (3 * OUTPUT_TOKENS)

    stats = proxy.stats()
    assert (stats["export_batches"], stats["export_trajectories"]) == (1, 2)
    assert stats["export_bytes"] == len(response.content) and stats["ready_trajectories"] == 1
    assert stats["live_sessions"] == 1
    assert stats["tokens_held"] == proxy.get(sid_c, ADMIN_KEY).json()["num_tokens"]
    # The exported sessions left the store; their ids say where they went.
    gone = proxy.get(sid_a, key_a)
    assert gone.status_code == 410 and batch_id in gone.json()["error"]["message"]
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert f"rolloutfleet_proxy_export_bytes {float(len(response.content))}" in metrics
    assert "rolloutfleet_proxy_export_trajectories 2.0" in metrics

    acked = ack(proxy, batch_id)
    assert acked.status_code == 200
    assert acked.json() == {"batch_id": batch_id, "acknowledged": True, "trajectories": 2}
    stats = proxy.stats()
    assert (stats["export_batches"], stats["export_trajectories"], stats["export_bytes"]) == (0, 0, 0)
    assert stats["totals"]["batches_acknowledged"] == 1 and stats["totals"]["trajectories_exported"] == 2
    assert "rolloutfleet_proxy_export_bytes 0.0" in httpx.get(f"{proxy.url}/metrics").text
    again = httpx.get(f"{proxy.url}/v1/exports/{batch_id}", headers=ADMIN)
    assert again.status_code == 410 and again.json()["error"]["code"] == "batch_already_acknowledged"
    if stats["trim_available"]:  # the cleanup cycle returns the freed heap to the OS
        wait_for(lambda: proxy.stats()["totals"]["heap_trims"] >= 1, 5, "a heap trim", 0.02)
    assert not list((proxy.dump_dir / EXPORTED_AREA).glob("*"))


def test_rerequest_returns_the_same_bytes_and_json_view(proxy):
    sids = [play_session(proxy, reward=float(i))[0] for i in range(3)]
    created = export(proxy, session_ids=[sids[2], sids[0]])
    assert created.status_code == 201
    batch_id = created.headers["x-rolloutfleet-batch-id"]
    again = httpx.get(f"{proxy.url}/v1/exports/{batch_id}", headers=ADMIN)
    assert again.status_code == 200 and again.content == created.content
    as_json = httpx.get(f"{proxy.url}/v1/exports/{batch_id}", headers=ADMIN, params={"format": "json"})
    by_accept = httpx.get(
        f"{proxy.url}/v1/exports/{batch_id}", headers={**ADMIN, "Accept": "application/json"}
    )
    assert as_json.headers["content-type"] == "application/json" and as_json.json() == by_accept.json()
    view = as_json.json()
    assert view["batch_id"] == batch_id and view["num_trajectories"] == 2
    assert [t["session_id"] for t in view["trajectories"]] == [sids[2], sids[0]]  # the order asked for
    assert [t["reward"] for t in view["trajectories"]] == [2.0, 0.0]
    decoded = decode_batch(created.content)
    assert view["trajectories"][1] == decoded.trajectory(1)
    listing = httpx.get(f"{proxy.url}/v1/exports", headers=ADMIN).json()
    assert listing["total"] == 1 and listing["batches"][0]["batch_id"] == batch_id
    assert listing["batches"][0]["session_ids"] == [sids[2], sids[0]]
    assert listing["bytes"] == len(created.content)
    # A JSON export straight away, and nothing left to export.
    json_export = export(proxy, params={"format": "json"}, max_trajectories=5)
    assert json_export.status_code == 201 and json_export.json()["trajectories"][0]["session_id"] == sids[1]
    assert export(proxy, max_trajectories=5).status_code == 204


async def test_two_trainers_acknowledging_one_batch(proxy):
    play_session(proxy)
    batch_id = export(proxy, max_trajectories=1).headers["x-rolloutfleet-batch-id"]
    async with httpx.AsyncClient(base_url=proxy.url, headers=ADMIN) as client:
        answers = await asyncio.gather(*(client.post(f"/v1/exports/{batch_id}/ack") for _ in range(2)))
    assert sorted(a.status_code for a in answers) == [200, 410]
    loser = next(a for a in answers if a.status_code == 410).json()["error"]
    assert loser["code"] == "batch_already_acknowledged" and "already acknowledged" in loser["message"]
    assert proxy.stats()["totals"]["batches_acknowledged"] == 1


def test_unacknowledged_batch_is_dumped_after_ttl_and_freed(upstream_url, test_tokenizer_dir, tmp_path):
    dumps = tmp_path / "dumps"
    with running_proxy(upstream_url, test_tokenizer_dir, dumps, export_ttl_s=0.3) as proxy:
        sid, _ = play_session(proxy, turns=2, reward=0.5)
        created = export(proxy, max_trajectories=10)
        batch_id = created.headers["x-rolloutfleet-batch-id"]
        assert proxy.stats()["export_bytes"] == len(created.content)
        wait_for(lambda: proxy.stats()["export_batches"] == 0, 5, "the batch to expire", 0.02)
        stats = proxy.stats()
        assert stats["export_bytes"] == 0 and stats["totals"]["batches_expired"] == 1
        (path,) = (dumps / EXPORTED_AREA).iterdir()
        assert path.name.startswith(batch_id + ".") and path.name.endswith(".safetensors")
        assert path.read_bytes() == created.content
        on_disk = decode_batch(path.read_bytes())
        assert (
            on_disk.header["trajectories"][0]["session_id"] == sid and on_disk.trajectory(0)["reward"] == 0.5
        )
        from safetensors.numpy import load_file  # any safetensors reader opens it

        assert load_file(str(path))["input_ids"].dtype == np.int32
        for late in (httpx.get(f"{proxy.url}/v1/exports/{batch_id}", headers=ADMIN), ack(proxy, batch_id)):
            assert late.status_code == 410 and late.json()["error"]["code"] == "batch_expired"
            assert str(path) in late.json()["error"]["message"]


def test_drain_writes_unacknowledged_batches_and_successor_restores_them(
    upstream_url, test_tokenizer_dir, tmp_path
):
    dumps = tmp_path / "dumps"
    with running_proxy(upstream_url, test_tokenizer_dir, dumps) as first:
        for _ in range(3):
            play_session(first)
        created = export(first, max_trajectories=2)
        batch_id = created.headers["x-rolloutfleet-batch-id"]
    # Stopped (lifespan shutdown drains): the batch and the ready session are on disk.
    assert [p.name for p in (dumps / LIVE_EXPORTS_AREA).iterdir()] == [f"{batch_id}.safetensors"]
    assert len(list((dumps / "live").iterdir())) == 1

    with running_proxy(upstream_url, test_tokenizer_dir, dumps) as second:
        stats = second.stats()
        assert stats["export_batches"] == 1 and stats["export_bytes"] == len(created.content)
        assert stats["totals"]["batches_restored"] == 1 and stats["ready_trajectories"] == 1
        # Kept until acknowledged: a kill of this second process must not lose the batch either.
        assert [p.name for p in (dumps / LIVE_EXPORTS_AREA).iterdir()] == [f"{batch_id}.safetensors"]
        fetched = httpx.get(f"{second.url}/v1/exports/{batch_id}", headers=ADMIN)
        assert fetched.status_code == 200 and fetched.content == created.content
        assert ack(second, batch_id).status_code == 200
        assert not list((dumps / LIVE_EXPORTS_AREA).iterdir())
        assert export(second, max_trajectories=5).headers["x-rolloutfleet-trajectories"] == "1"


def test_bad_export_input_gets_clear_4xx_and_leaves_state_intact(proxy):
    finished = [play_session(proxy)[0] for _ in range(2)]
    running, running_key = play_session(proxy, finish=False)
    batch_id = export(proxy, session_ids=[finished[1]]).headers["x-rolloutfleet-batch-id"]
    before = proxy.stats()
    url = f"{proxy.url}/v1/exports"
    cases = [
        ("no body", httpx.post(url, headers=ADMIN), 400, "invalid_body"),
        ("not json", httpx.post(url, headers=ADMIN, content=b"{"), 400, "invalid_json"),
        ("both filters", export(proxy, max_trajectories=1, session_ids=[finished[0]]), 400, "invalid_body"),
        ("unknown field", export(proxy, max_trajectory=1), 400, "invalid_body"),
        ("N zero", export(proxy, max_trajectories=0), 400, "invalid_max_trajectories"),
        ("N negative", export(proxy, max_trajectories=-3), 400, "invalid_max_trajectories"),
        ("N string", export(proxy, max_trajectories="2"), 400, "invalid_max_trajectories"),
        ("N bool", export(proxy, max_trajectories=True), 400, "invalid_max_trajectories"),
        ("N huge", export(proxy, max_trajectories=10**6), 400, "invalid_max_trajectories"),
        ("ids not a list", export(proxy, session_ids=finished[0]), 400, "invalid_session_ids"),
        ("ids empty", export(proxy, session_ids=[]), 400, "invalid_session_ids"),
        ("bad id", export(proxy, session_ids=["../../etc"]), 400, "invalid_session_ids"),
        ("duplicate ids", export(proxy, session_ids=[finished[0]] * 2), 400, "invalid_session_ids"),
        ("unknown ids", export(proxy, session_ids=[finished[0], "unknown-sess-1"]), 404, "not_found"),
        ("unfinished", export(proxy, session_ids=[finished[0], running]), 409, "session_not_finished"),
        ("already exported", export(proxy, session_ids=[finished[1]]), 410, "session_gone"),
        (
            "bad format",
            export(proxy, params={"format": "pickle"}, max_trajectories=1),
            400,
            "invalid_parameter",
        ),
        (
            "session key",
            httpx.post(url, headers={"Authorization": f"Bearer {running_key}"}),
            401,
            "unauthorized",
        ),
        ("no key", httpx.get(url), 401, "unauthorized"),
        ("unknown batch", httpx.get(f"{url}/batch-unknown-000", headers=ADMIN), 404, "not_found"),
        ("bad batch id", httpx.get(f"{url}/bad.batch.id", headers=ADMIN), 400, "invalid_batch_id"),
        ("ack unknown", ack(proxy, "batch-unknown-000"), 404, "not_found"),
        ("ack bad id", ack(proxy, "bad.batch.id"), 400, "invalid_batch_id"),
        ("ack by GET", httpx.get(f"{url}/{batch_id}/ack", headers=ADMIN), 405, "method_not_allowed"),
    ]
    for name, response, status, code in cases:
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert error["code"] == code and error["message"], name
    unknown = export(proxy, session_ids=["unknown-sess-1", "unknown-sess-2"]).json()["error"]["message"]
    assert "unknown-sess-1" in unknown and "unknown-sess-2" in unknown
    after = proxy.stats()
    for field in ("live_sessions", "tokens_held", "ready_trajectories", "admission"):
        assert after[field] == before[field], field
    for field in ("export_batches", "export_trajectories", "export_bytes"):
        assert after[field] == before[field], field
    assert proxy.get(finished[0], ADMIN_KEY).json()["finished"] is True
    assert httpx.get(f"{url}/{batch_id}", headers=ADMIN).status_code == 200


def test_sigterm_drain_keeps_batches_and_version_for_the_successor(
    upstream_url, test_tokenizer_dir, tmp_path
):
    """The real program: SIGTERM exits 0 with the unacknowledged batch and the state on disk; the next
    process serves the same batch and the same model version."""
    import signal

    from rolloutfleet_testkit.processes import ServerProcess, free_port, proxy_command

    dumps = tmp_path / "dumps"

    def start(log_name: str) -> tuple[ServerProcess, str]:
        port = free_port()
        args = ["--host", "127.0.0.1", "--port", str(port), "--upstream-url", upstream_url]
        args += ["--tokenizer-path", str(test_tokenizer_dir), "--dump-dir", str(dumps)]
        process = ServerProcess(
            proxy_command(*args), tmp_path / log_name, env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY}
        )
        url = f"http://127.0.0.1:{port}"
        process.wait_ready(f"{url}/readyz", 90)
        return process, url

    first, url = start("first.log")
    try:
        httpx.put(f"{url}/v1/generation/model_version", headers=ADMIN, json={"model_version": 7})
        created = httpx.post(f"{url}/v1/sessions", headers=ADMIN).json()
        auth = {"Authorization": f"Bearer {created['session_key']}"}
        assert httpx.post(f"{url}/v1/sessions/{created['session_id']}/finish", headers=auth).is_success
        exported = httpx.post(f"{url}/v1/exports", headers=ADMIN, json={"max_trajectories": 1})
        assert exported.status_code == 201
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(30) == 0, first.log_tail()
    finally:
        first.terminate()
    batch_id = exported.headers["x-rolloutfleet-batch-id"]
    assert (dumps / LIVE_EXPORTS_AREA / f"{batch_id}.safetensors").read_bytes() == exported.content

    second, url = start("second.log")
    try:
        assert httpx.get(f"{url}/v1/generation/model_version", headers=ADMIN).json() == {"model_version": 7}
        again = httpx.get(f"{url}/v1/exports/{batch_id}", headers=ADMIN)
        assert again.status_code == 200 and again.content == exported.content
        assert httpx.post(f"{url}/v1/exports/{batch_id}/ack", headers=ADMIN).status_code == 200
    finally:
        assert second.terminate() == 0
