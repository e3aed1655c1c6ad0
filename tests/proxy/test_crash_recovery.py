"""SIGKILL (what the OOM killer sends) at random moments under concurrent multi-turn load that
branches (a turn resent from an earlier reply, a regeneration), then a restart on the same dump
directory: every turn, reward and finish a client got a 2xx for is there, and every delivered reply
replays byte-identical from the record without the engine. Ten kills in one run on one directory,
one of them during a journal compaction and one during a restore. Real proxy processes, the SGLang
emulator (a stand-in: no GPU here)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from proxy_harness import ADMIN, chat_body, proxy_process
from rolloutfleet_testkit.processes import ServerProcess, serve_app
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app

KILLS = 10
TURNS_PER_CYCLE = 20  # delivered turns before a random kill moment
WORKERS = 12
SEED = 13


@pytest.fixture(scope="module")
def engine_url(test_tokenizer_dir):
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=3, token_delay_s=0.002)) as url:
        yield url


@dataclass
class DeliveredTurn:
    body: dict
    idempotency_key: str
    answer: bytes  # the reply's bytes as the client got them


@dataclass
class Delivered:
    key: str
    turns: list[DeliveredTurn] = field(default_factory=list)
    reward: float | None = None
    finished: bool = False


def spawn(engine_url: str, tokenizer_dir: Path, dumps: Path, log: Path) -> tuple[ServerProcess, str]:
    # Compactions happen during the load, so kills land around them too.
    return proxy_process(
        engine_url, tokenizer_dir, dumps, log, "--journal-compact-bytes", "65536", "--no-log-requests"
    )


def kill(process: ServerProcess) -> None:
    process.process.send_signal(signal.SIGKILL)
    process.process.wait(10)
    process.terminate()  # closes its log


async def rollouts(url: str, ledger: dict[str, Delivered], rng: random.Random) -> None:
    """Multi-turn sessions until the proxy dies; only what got a 2xx goes into the ledger."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            created = await client.post("/v1/sessions", headers=ADMIN, json={"metadata": {"n": rng.random()}})
            if created.status_code != 201:
                return
            sid, key = created.json()["session_id"], created.json()["session_key"]
            ledger[sid] = delivered = Delivered(key)
            auth = {"Authorization": f"Bearer {key}"}
            messages: list[dict] = []
            body: dict = {}
            for turn in range(rng.randint(1, 5)):
                roll = rng.random()
                if turn and roll < 0.15:  # a new sample of the last request: a sibling branch
                    body = {**body, "regenerate": True}
                else:
                    if turn and roll < 0.4:  # back to an earlier reply, and on from there: a branch
                        messages = messages[: 2 * rng.randint(1, len(messages) // 2)]
                    messages.append(
                        {"role": "user", "content": f"{sid} turn {turn} " + "x" * rng.randint(0, 200)}
                    )
                    body = chat_body(list(messages), max_tokens=rng.randint(2, 12), logprobs=True)
                    if rng.random() < 0.15:
                        body["n"] = 2  # a group: two sibling branches from one engine call
                idempotency_key = f"{sid}-{turn}"
                reply = await client.post(
                    f"/v1/sessions/{sid}/chat/completions",
                    headers={**auth, "Idempotency-Key": idempotency_key},
                    json=body,
                )
                if reply.status_code != 200:
                    return
                delivered.turns.append(DeliveredTurn(body, idempotency_key, reply.content))
                choices = reply.json()["choices"]
                chosen = rng.choice(choices)["message"]  # a group goes on with one of its choices
                if "regenerate" not in body:
                    messages.append(chosen)
                else:
                    messages[-1] = chosen
            if rng.random() < 0.5:
                value = round(rng.uniform(-1, 1), 3)
                if (
                    await client.post(f"/v1/sessions/{sid}/reward", headers=auth, json={"reward": value})
                ).status_code != 200:
                    return
                delivered.reward = value
            if rng.random() < 0.5:
                if (await client.post(f"/v1/sessions/{sid}/finish", headers=auth)).status_code != 200:
                    return
                delivered.finished = True


async def load_until_killed(url: str, process: ServerProcess, ledger, rng, kill_when) -> None:
    workers = [
        asyncio.create_task(rollouts(url, ledger, random.Random(rng.random()))) for _ in range(WORKERS)
    ]
    try:
        await kill_when()
        kill(process)
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 30)
    finally:
        for worker in workers:
            worker.cancel()


async def poll_until(condition, timeout_s: float = 120.0) -> None:
    """The workers fill the ledger without signalling; a bounded poll is simplest here."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the load did not deliver enough turns"
        await asyncio.sleep(0.01)


def delivered_turns(ledger: dict[str, Delivered]) -> int:
    return sum(len(d.turns) for d in ledger.values())


def check_ledger(url: str, ledger: dict[str, Delivered]) -> int:
    """Every delivered change is present after the restart; returns the turns checked."""
    checked = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for sid, delivered in ledger.items():
            got = client.get(
                f"/v1/sessions/{sid}",
                params={"tokens": "true"},
                headers={"Authorization": f"Bearer {delivered.key}"},
            )
            assert got.status_code == 200, (sid, got.text)
            data = got.json()
            # One more call than delivered is allowed (a group's: two turns): recorded and durable, the
            # kill beat the reply.
            recorded = sum(turn.body.get("n", 1) for turn in delivered.turns)
            assert recorded <= data["num_turns"] <= recorded + 2, sid
            for index, turn in enumerate(delivered.turns):
                again = client.post(
                    f"/v1/sessions/{sid}/chat/completions",
                    headers={
                        "Authorization": f"Bearer {delivered.key}",
                        "Idempotency-Key": turn.idempotency_key,
                    },
                    json=turn.body,
                )
                assert again.status_code == 200, (sid, index, again.text)
                assert again.headers.get("Idempotent-Replayed") == "true", (sid, index)
                assert again.content == turn.answer, (sid, index)
                checked += 1
            if delivered.reward is not None:
                assert data["reward"] == delivered.reward, sid
            if delivered.finished:
                assert data["finished"], sid
    return checked


async def test_sigkill_at_random_moments_loses_no_delivered_change(engine_url, test_tokenizer_dir, tmp_path):
    rng = random.Random(SEED)
    dumps = tmp_path / "dumps"
    ledger: dict[str, Delivered] = {}
    checked_turns = 0
    kill_during_compaction, kill_during_restore = 4, 7
    for cycle in range(KILLS):
        process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / f"proxy-{cycle}.log")
        if cycle == kill_during_restore:
            # The start-up restores everything held so far; kill it in the middle of that.
            await wait_for_log(process, '"restoring from', 60)
            kill(process)
            process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / f"proxy-{cycle}b.log")
        process.wait_ready(f"{url}/readyz", 90)
        checked_turns = await asyncio.to_thread(check_ledger, url, ledger)
        stats = await asyncio.to_thread(get_stats, url)
        assert stats["sessions_lost"] == 0 and stats["totals"]["restore_failures"] == 0

        turns_before = delivered_turns(ledger)

        async def random_moment(turns_before: int = turns_before) -> None:
            # Under load first (a count, not a time: the machine may be busy), then a random moment.
            await poll_until(lambda: delivered_turns(ledger) >= turns_before + TURNS_PER_CYCLE)
            await asyncio.sleep(rng.uniform(0, 0.8))

        async def during_compaction(url: str = url) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if (await client.get("/stats")).json()["journal"]["compacting"]:
                        return
                    await asyncio.sleep(0.002)
            raise AssertionError("no compaction started within 30 s")

        await load_until_killed(
            url, process, ledger, rng, during_compaction if cycle == kill_during_compaction else random_moment
        )
    process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / "proxy-last.log")
    try:
        process.wait_ready(f"{url}/readyz", 90)
        checked_turns = await asyncio.to_thread(check_ledger, url, ledger)
        stats = await asyncio.to_thread(get_stats, url)
    finally:
        assert process.terminate() == 0
    assert stats["sessions_lost"] == 0
    assert stats["live_sessions"] >= len(ledger)
    assert checked_turns >= (KILLS - 2) * TURNS_PER_CYCLE, checked_turns  # the kills landed under real load


def get_stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


async def wait_for_log(process: ServerProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in process.log_path.read_text(errors="replace"):
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{text!r} not logged within {timeout_s} s:\n{process.log_tail()}")


async def test_an_exported_batch_survives_sigkill_until_acknowledged(
    engine_url, test_tokenizer_dir, tmp_path
):
    dumps = tmp_path / "dumps"
    process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / "first.log")
    process.wait_ready(f"{url}/readyz", 90)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        finished = []
        for i in range(3):
            created = (await client.post("/v1/sessions", headers=ADMIN)).json()
            auth = {"Authorization": f"Bearer {created['session_key']}"}
            sid = created["session_id"]
            turn = await client.post(
                f"/v1/sessions/{sid}/chat/completions",
                headers=auth,
                json=chat_body([{"role": "user", "content": f"task {i}"}], max_tokens=4),
            )
            assert turn.status_code == 200
            assert (await client.post(f"/v1/sessions/{sid}/finish", headers=auth)).status_code == 200
            finished.append((sid, auth))
        exported = await client.post("/v1/exports", headers=ADMIN, json={"max_trajectories": 2})
        assert exported.status_code == 201
        batch_id = exported.headers["x-rolloutfleet-batch-id"]
    kill(process)

    process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / "second.log")
    try:
        process.wait_ready(f"{url}/readyz", 90)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            again = await client.get(f"/v1/exports/{batch_id}", headers=ADMIN)
            assert again.status_code == 200 and again.content == exported.content
            stats = (await client.get("/stats")).json()
            # The two exported sessions are in the batch only (not live twice); the third is ready.
            assert stats["ready_trajectories"] == 1 and stats["live_sessions"] == 1
            assert (await client.post(f"/v1/exports/{batch_id}/ack", headers=ADMIN)).status_code == 200
    finally:
        kill(process)
    process, url = spawn(engine_url, test_tokenizer_dir, dumps, tmp_path / "third.log")
    try:
        process.wait_ready(f"{url}/readyz", 90)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            gone = await client.get(f"/v1/exports/{batch_id}", headers=ADMIN)
        assert gone.status_code == 404  # acknowledged before the kill: not offered again
    finally:
        assert process.terminate() == 0
