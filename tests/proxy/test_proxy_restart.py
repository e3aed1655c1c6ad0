"""Restart without loss: a proxy process drains and dumps on SIGTERM, its successor restores and continues."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from proxy_harness import ADMIN, ADMIN_KEY, chat_body, proxy_process
from rolloutfleet_proxy.storage.dumps import LIVE_AREA
from rolloutfleet_testkit.processes import ServerProcess, free_port, proxy_command, serve_app
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app


@pytest.fixture(scope="module")
def engine_url(test_tokenizer_dir):
    # A little latency so a turn can be in flight when SIGTERM arrives.
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=1, delay_s=0.3)) as url:
        yield url


def start_proxy(engine_url: str, tokenizer_dir: Path, dump_dir: Path, log: Path) -> tuple[ServerProcess, str]:
    process, url = proxy_process(engine_url, tokenizer_dir, dump_dir, log, "--drain-grace-s", "10")
    process.wait_ready(f"{url}/readyz", 90)
    return process, url


async def run_turn(client: httpx.AsyncClient, sid: str, key: str, messages: list[dict]) -> httpx.Response:
    return await client.post(
        f"/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=chat_body(messages, max_tokens=8),
    )


async def test_sigterm_drains_dumps_and_successor_continues(engine_url, test_tokenizer_dir, tmp_path):
    dumps = tmp_path / "dumps"
    first, url = start_proxy(engine_url, test_tokenizer_dir, dumps, tmp_path / "first.log")
    conversations: dict[str, tuple[str, list[dict]]] = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for i in range(4):
                created = (await client.post("/v1/sessions", headers=ADMIN)).json()
                sid, key = created["session_id"], created["session_key"]
                messages = [{"role": "user", "content": f"session {i} turn 0"}]
                for turn in range(2):
                    reply = await run_turn(client, sid, key, messages)
                    assert reply.status_code == 200, reply.text
                    messages += [
                        reply.json()["choices"][0]["message"],
                        {"role": "user", "content": f"session {i} turn {turn + 1}"},
                    ]
                conversations[sid] = (key, messages)
            before = {
                sid: (
                    await client.get(
                        f"/v1/sessions/{sid}",
                        params={"tokens": "true"},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                ).json()
                for sid, (key, _) in conversations.items()
            }
            # A turn in flight when SIGTERM lands must finish, be recorded and delivered.
            sid0, (key0, messages0) = next(iter(conversations.items()))
            in_flight = asyncio.create_task(run_turn(client, sid0, key0, messages0))
            await asyncio.sleep(0.1)
            first.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            refused = await client.post("/v1/sessions", headers=ADMIN)
            ready = await client.get("/readyz")
            delivered = await in_flight
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert ready.status_code == 503
        assert delivered.status_code == 200
        messages0 += [delivered.json()["choices"][0]["message"], {"role": "user", "content": "after restart"}]
        assert first.process.wait(30) == 0
    finally:
        first.terminate()
    assert sorted(p.stem for p in (dumps / LIVE_AREA).glob("*.safetensors")) == sorted(conversations)

    second, url = start_proxy(engine_url, test_tokenizer_dir, dumps, tmp_path / "second.log")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            stats = (await client.get("/stats")).json()
            assert stats["live_sessions"] == 4 and stats["totals"]["sessions_restored"] == 4
            # Kept until a compaction or drain has made them durable again: a second kill loses nothing.
            assert len(list((dumps / LIVE_AREA).glob("*.safetensors"))) == 4
            for sid, (key, messages) in conversations.items():
                restored = (
                    await client.get(
                        f"/v1/sessions/{sid}",
                        params={"tokens": "true"},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                ).json()
                old = before[sid]["trajectory"]
                # All earlier turns intact: the restored ids start with exactly what was there before.
                assert restored["trajectory"]["input_ids"][: len(old["input_ids"])] == old["input_ids"]
                assert restored["trajectory"]["logprobs"][: len(old["logprobs"])] == old["logprobs"]
                expected_turns = 3 if sid == sid0 else 2
                assert restored["num_turns"] == expected_turns
                reply = await run_turn(client, sid, key, messages)  # continues with the same key and history
                assert reply.status_code == 200, reply.text
                assert reply.json()["rolloutfleet"]["turn"] == expected_turns
    finally:
        assert second.terminate() == 0


def proxy_exit(tmp_path, test_tokenizer_dir, *args: str) -> tuple[int, str]:
    """Start a proxy that is expected to refuse to start: its exit code and its log."""
    process = ServerProcess(
        proxy_command(
            "--port",
            str(free_port()),
            "--upstream-url",
            "http://127.0.0.1:1",
            "--tokenizer-path",
            str(test_tokenizer_dir),
            *args,
        ),
        tmp_path / "refused.log",
        env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY},
    )
    deadline = time.monotonic() + 60
    while process.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return process.terminate(), process.log_path.read_text()


def test_refuses_to_start_without_dump_dir(test_tokenizer_dir, tmp_path):
    code, log = proxy_exit(tmp_path, test_tokenizer_dir)
    assert code == 2
    assert "no dump directory" in log


def test_refuses_to_start_when_the_dump_directory_is_not_writable(test_tokenizer_dir, tmp_path):
    # A file where the directory belongs (root ignores permission bits, not this).
    blocked = tmp_path / "dumps"
    blocked.write_text("not a directory")
    code, log = proxy_exit(tmp_path, test_tokenizer_dir, "--dump-dir", str(blocked))
    assert code == 3
    assert f"the dump directory {blocked} is not writable" in log
    assert blocked.read_text() == "not a directory"


def test_corrupt_live_dump_is_kept_aside_not_deleted(engine_url, test_tokenizer_dir, tmp_path):
    dumps = tmp_path / "dumps"
    (dumps / LIVE_AREA).mkdir(parents=True)
    (dumps / LIVE_AREA / "broken-session.safetensors").write_bytes(b"garbage")
    process, url = start_proxy(engine_url, test_tokenizer_dir, dumps, tmp_path / "p.log")
    try:
        stats = httpx.get(f"{url}/stats").json()
        assert stats["totals"]["restore_failures"] == 1 and stats["live_sessions"] == 0
        (kept,) = (dumps / "corrupt").iterdir()
        assert kept.read_bytes() == b"garbage"
    finally:
        assert process.terminate() == 0


def test_malformed_dumps_are_quarantined_and_start_goes_on(engine_url, test_tokenizer_dir, tmp_path):
    import numpy as np
    from rolloutfleet_proxy.storage.dumps import FORMAT
    from safetensors.numpy import save_file

    live = tmp_path / "dumps" / LIVE_AREA
    live.mkdir(parents=True)
    empty = {
        "input_ids": np.zeros(0, np.int32),
        "loss_mask": np.zeros(0, np.uint8),
        "logprobs": np.zeros(0, np.float32),
        "turn_bounds": np.zeros((0, 3), np.int32),
    }
    save_file(empty, str(live / "list-header.safetensors"), metadata={FORMAT: "[1, 2]"})
    escaping = {"format": FORMAT, "format_version": 1, "session_id": "../../x", "key_sha256": "00"}
    save_file(empty, str(live / "escaping-id.safetensors"), metadata={FORMAT: json.dumps(escaping)})
    process, url = start_proxy(engine_url, test_tokenizer_dir, tmp_path / "dumps", tmp_path / "p.log")
    try:
        stats = httpx.get(f"{url}/stats").json()
        assert stats["totals"]["restore_failures"] == 2 and stats["live_sessions"] == 0
        assert len(list((tmp_path / "dumps" / "corrupt").iterdir())) == 2
    finally:
        assert process.terminate() == 0


def test_sigterm_during_startup_keeps_restored_sessions(test_tokenizer_dir, tmp_path):
    """A replacement terminated while it restores must write its sessions back, not lose them."""
    from array import array

    from rolloutfleet_proxy.ids import key_digest
    from rolloutfleet_proxy.session import RecordedTurn, Session
    from rolloutfleet_proxy.storage.dumps import write_session_dump

    dumps = tmp_path / "dumps"
    expected = {}
    for i in range(3):
        session = Session(f"restored-{i:03d}", key_digest("k"))
        session.append_turn(
            RecordedTurn(
                array("i", [1, 2, 3 + i]),
                array("i", [9, 9]),
                array("f", [-0.5, -0.25]),
                message_count=2,
                history_digest=b"\x01" * 32,
                stopped=False,
                stop_token=None,
            ),
        )
        write_session_dump(dumps, LIVE_AREA, session.to_record(), "drain")
        expected[session.session_id] = session.token_ids.tolist()
    log = tmp_path / "p.log"
    process = ServerProcess(
        proxy_command(
            "--port",
            str(free_port()),
            "--host",
            "127.0.0.1",
            "--upstream-url",
            "http://127.0.0.1:1",
            "--tokenizer-path",
            str(test_tokenizer_dir),
            "--dump-dir",
            str(dumps),
        ),
        log,
        env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY},
    )
    deadline = time.monotonic() + 60
    while "Waiting for application startup" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    process.process.send_signal(signal.SIGTERM)  # while the tokenizer loads, before or during the restore
    assert process.process.wait(60) == 0, process.log_tail()
    process.terminate()
    from rolloutfleet_proxy.storage.dumps import load_session_file

    files = sorted((dumps / LIVE_AREA).glob("*.safetensors"))
    assert {
        load_session_file(f).session_id: load_session_file(f).token_ids.tolist() for f in files
    } == expected
