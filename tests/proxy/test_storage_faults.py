"""Disk faults on a real mount (tmpfs): a dump volume that turns read-only or fills up mid-run is
reported (/readyz 503, /stats, /metrics), new sessions and turns get 503 storage_unavailable with the
session unchanged, nothing delivered is lost, and the proxy recovers when the volume does."""

from __future__ import annotations

import contextlib

import httpx
from proxy_harness import ADMIN, chat_body, remount, running_proxy, tmpfs
from rolloutfleet_testkit.waiting import wait_for


def turn(url: str, sid: str, key: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=chat_body(messages, max_tokens=6),
    )


def converse(url: str, sid: str, key: str, messages: list[dict], text: str) -> httpx.Response:
    messages.append({"role": "user", "content": text})
    reply = turn(url, sid, key, messages)
    if reply.status_code == 200:
        messages.append(reply.json()["choices"][0]["message"])
    else:
        messages.pop()
    return reply


def session_state(url: str, sid: str, key: str) -> dict:
    return httpx.get(
        f"{url}/v1/sessions/{sid}", params={"tokens": "true"}, headers={"Authorization": f"Bearer {key}"}
    ).json()


def test_read_only_remount_mid_run_is_reported_refused_and_recovered(
    sglang_emulator_url, test_tokenizer_dir, tmp_path
):
    with tmpfs(tmp_path / "dumps", "16m") as dumps:
        with running_proxy(
            sglang_emulator_url, test_tokenizer_dir, dumps, storage_check_interval_s=0.1
        ) as proxy:
            sid, key = proxy.create_session()
            doomed, _ = proxy.create_session()
            messages: list[dict] = []
            assert converse(proxy.url, sid, key, messages, "before").status_code == 200
            before = session_state(proxy.url, sid, key)

            remount(dumps, "ro")
            wait_for(lambda: httpx.get(f"{proxy.url}/readyz").status_code == 503, 10, "/readyz 503", 0.05)
            ready = httpx.get(f"{proxy.url}/readyz").json()
            assert (
                ready["error"]["code"] == "storage_unavailable" and "Read-only" in ready["error"]["message"]
            )
            created = httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN)
            assert created.status_code == 503 and created.json()["error"]["code"] == "storage_unavailable"
            assert created.headers["retry-after"]
            refused = converse(proxy.url, sid, key, messages, "while read-only")
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "storage_unavailable"
            assert session_state(proxy.url, sid, key) == before  # unchanged
            # A deletion takes effect in memory, and the answer says it may not survive a restart.
            deleted = httpx.delete(f"{proxy.url}/v1/sessions/{doomed}", headers=ADMIN)
            assert deleted.status_code == 503 and deleted.json()["error"]["code"] == "storage_unavailable"
            assert f"session {doomed} is deleted here" in deleted.json()["error"]["message"]
            assert deleted.headers["retry-after"] == "5"
            gone = httpx.get(f"{proxy.url}/v1/sessions/{doomed}", headers=ADMIN)
            assert gone.status_code in (404, 410)
            stats = proxy.stats()
            assert stats["storage"]["writable"] is False and stats["storage"]["failures"] == 1
            metrics = httpx.get(f"{proxy.url}/metrics").text
            assert "rolloutfleet_proxy_storage_writable 0.0" in metrics

            remount(dumps, "rw")
            wait_for(lambda: httpx.get(f"{proxy.url}/readyz").status_code == 200, 10, "/readyz 200", 0.05)
            assert converse(proxy.url, sid, key, messages, "after").status_code == 200
            delivered = session_state(proxy.url, sid, key)
            assert delivered["num_turns"] == 2
        # Stopped (drained) and started again on the same volume: everything delivered is there.
        with running_proxy(sglang_emulator_url, test_tokenizer_dir, dumps) as successor:
            assert session_state(successor.url, sid, key)["trajectory"] == delivered["trajectory"]


def test_a_full_volume_fails_the_turn_cleanly_and_nothing_delivered_is_lost(
    sglang_emulator_url, test_tokenizer_dir, tmp_path
):
    with tmpfs(tmp_path / "dumps", "4m") as dumps:
        with running_proxy(
            sglang_emulator_url, test_tokenizer_dir, dumps, storage_check_interval_s=0.1
        ) as proxy:
            sid, key = proxy.create_session()
            messages: list[dict] = []
            assert converse(proxy.url, sid, key, messages, "first").status_code == 200
            before = session_state(proxy.url, sid, key)
            filler = dumps / "filler"
            with contextlib.suppress(OSError), open(filler, "wb") as f:
                while True:  # until ENOSPC
                    f.write(b"\0" * 65536)
                    f.flush()
            reply = converse(proxy.url, sid, key, messages, "x" * 20000)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "storage_unavailable"
            assert session_state(proxy.url, sid, key) == before
            wait_for(lambda: httpx.get(f"{proxy.url}/readyz").status_code == 503, 10, "/readyz 503", 0.05)
            assert "No space left" in proxy.stats()["storage"]["reason"]

            filler.unlink()
            wait_for(lambda: httpx.get(f"{proxy.url}/readyz").status_code == 200, 10, "/readyz 200", 0.05)
            assert converse(proxy.url, sid, key, messages, "again").status_code == 200
            delivered = session_state(proxy.url, sid, key)
        with running_proxy(sglang_emulator_url, test_tokenizer_dir, dumps) as successor:
            assert session_state(successor.url, sid, key)["trajectory"] == delivered["trajectory"]
