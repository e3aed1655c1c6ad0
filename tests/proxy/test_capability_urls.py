"""A session used from its capability URL alone, as frameworks hand their agents a bare base URL
(`api_key="EMPTY"`): the official openai client, any or no key, revoked with the session, and the
secret never in the proxy's logs."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai import OpenAI
from proxy_harness import ADMIN, running_proxy


@pytest.fixture
def proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path):
    with running_proxy(
        sglang_emulator_url, test_tokenizer_dir, tmp_path / "dumps", log_requests=True
    ) as running:
        yield running


def create(proxy) -> dict:
    created = httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={})
    assert created.status_code == 201
    return created.json()


def test_the_openai_client_runs_a_session_from_its_capability_url_alone(proxy, caplog):
    created = create(proxy)
    secret = created["session_key"]
    assert created["capability_url"] == f"/v1/sessions/{created['session_id']}/cap/{secret}"
    base_url = proxy.url + created["capability_url"]
    caplog.set_level(logging.INFO, logger="rolloutfleet.proxy.access")
    client = OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in second if c.choices)
    # Any other key, or none, works the same: the path's secret opens the session.
    bare = httpx.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 4})
    assert bare.status_code == 200 and bare.headers["Idempotent-Replayed"] == "true"
    summary = proxy.get(created["session_id"], secret).json()
    assert summary["num_turns"] == 2
    logged = "\n".join(str(getattr(r, "fields", r.getMessage())) for r in caplog.records)
    assert "/cap/<redacted>/chat/completions" in logged
    assert secret not in logged and secret not in proxy.runtime.settings.model_dump_json()


def test_a_wrong_secret_is_an_unknown_session_and_a_deleted_session_revokes_its_url(proxy):
    created = create(proxy)
    sid = created["session_id"]
    base_url = proxy.url + created["capability_url"]
    wrong = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/cap/rfs-guessed/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    unknown = httpx.post(
        f"{proxy.url}/v1/sessions/unknown-session-9/cap/rfs-guessed/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert wrong.status_code == unknown.status_code == 404
    assert wrong.json()["error"]["code"] == unknown.json()["error"]["code"] == "not_found"
    assert httpx.delete(f"{proxy.url}/v1/sessions/{sid}", headers=ADMIN).status_code == 204
    client = OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert getattr(refused.value, "status_code", None) in (404, 410)


def test_the_capability_url_is_absolute_when_the_proxy_knows_its_address(
    sglang_emulator_url, test_tokenizer_dir
):
    with running_proxy(
        sglang_emulator_url, test_tokenizer_dir, None, public_url="http://proxy-0.rollouts:8000"
    ) as proxy:
        created = create(proxy)
        assert created["capability_url"] == (
            f"http://proxy-0.rollouts:8000/v1/sessions/{created['session_id']}/cap/{created['session_key']}"
        )
