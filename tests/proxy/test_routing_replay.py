"""Routing replay (R3) through real proxies in front of the SGLang emulator in its mixture-of-experts
mode (a stand-in: no GPU here): the rows of a branching session survive a SIGKILL and a restart byte
for byte, are exported aligned with the tokens and equal to the model's own routing of them (an
independent reference over the whole sequence), cost the bytes per token their shape says, and are
rebuilt from the journal when their file lost what was never synced; a turn continued across a
weight update keeps each token's rows from the weights that computed them; an engine or gateway that
does not answer routing fails the turn (502) with nothing recorded, the real sglang-router 0.3.2
among them (it drops `return_routed_experts`)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from proxy_harness import ADMIN, bearer, chat_body, proxy_process, running_proxy
from rolloutfleet_client.trainer import PulledBatch, to_torch
from rolloutfleet_proxy.storage.routing_store import HEADER_BYTES, routing_key
from rolloutfleet_testkit.moe_model import moe_model_dir
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.model import MoeConfig, route
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from rolloutfleet_testkit.sglang_emulator.server import write_weights
from rolloutfleet_testkit.waiting import wait_for
from rolloutfleet_wire.export_format import decode_batch

MOE = MoeConfig(layers=4, top_k=2, experts=16)  # uint8 rows of 8 bytes
ENGINE_SEED = 3


@pytest.fixture(scope="module")
def model_dir(test_tokenizer_dir, tmp_path_factory) -> Path:
    return moe_model_dir(
        test_tokenizer_dir, tmp_path_factory.mktemp("moe"), MOE.layers, MOE.top_k, MOE.experts
    )


def reference(ids: list[int], seed: int = ENGINE_SEED) -> np.ndarray:
    """The model's routing of every token of `ids` but the last, over the whole sequence at once."""
    rows, _ = route(ids[:-1], seed, MOE)
    return rows


def routing_file(dumps: Path, sid: str, key: str) -> Path:
    import hashlib

    return dumps / "routing" / f"{routing_key(sid, hashlib.sha256(key.encode()).digest())}.r3"


def test_rows_survive_a_sigkill_byte_identical_and_export_aligned_with_the_tokens(model_dir, tmp_path):
    dumps = tmp_path / "dumps"
    engine = emulator_app(str(model_dir), seed=ENGINE_SEED, delay_s=0.5, routed_experts=True)
    with serve_app(engine) as engine_url:
        # A small compaction threshold: the restore reads snapshots (their routing files cut back to
        # what they hold), then the journal after them.
        args = ("--routed-experts", "--journal-compact-bytes", "4096", "--no-log-requests")
        process, url = proxy_process(engine_url, model_dir, dumps, tmp_path / "proxy-1.log", *args)
        process.wait_ready(f"{url}/readyz", 90)
        created = httpx.post(f"{url}/v1/sessions", headers=ADMIN, json={}).json()
        sid, key = created["session_id"], created["session_key"]
        chat = f"{url}/v1/sessions/{sid}/chat/completions"
        delivered: list[tuple[str, dict, bytes]] = []  # (idempotency key, body, answer bytes)

        def turn(messages: list[dict], idempotency_key: str, **params) -> dict:
            body = chat_body(list(messages), max_tokens=12, temperature=0.8, **params)
            headers = {**bearer(key), "Idempotency-Key": idempotency_key}
            answer = httpx.post(chat, headers=headers, json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            delivered.append((idempotency_key, body, answer.content))
            return answer.json()

        first = [{"role": "user", "content": "route me " * 30}]
        reply = turn(first, "t1")["choices"][0]["message"]
        second = [*first, reply, {"role": "user", "content": "and on"}]
        second.append(turn(second, "t2")["choices"][0]["message"])
        # A branch from the first reply, with a group of two samples on it, then on from the second.
        branch = [*first, reply, {"role": "user", "content": "another way " * 20}]
        branch.append(turn(branch, "t3", n=2)["choices"][1]["message"])
        branch.append({"role": "user", "content": "last"})
        turn(branch, "t4")
        rows_before = routing_file(dumps, sid, key).read_bytes()
        assert httpx.get(f"{url}/stats").json()["totals"]["compactions"] >= 1  # snapshots hold some turns

        # The fifth turn waits in the engine when the proxy is killed: never answered, never recorded.
        cut_off: list[object] = []
        fifth = chat_body([*second, {"role": "user", "content": "x"}])
        sender = threading.Thread(target=lambda: cut_off.append(_post_quietly(chat, bearer(key), fifth)))
        sender.start()
        wait_for(
            lambda: httpx.get(f"{url}/v1/generation", headers=ADMIN).json()["generating_turns"] == 1,
            30,
            "the fifth turn to reach the engine",
            0.01,
        )
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(10)
        process.terminate()
        sender.join(30)
        assert len(cut_off) == 1 and isinstance(cut_off[0], httpx.HTTPError)
        with routing_file(dumps, sid, key).open("ab") as f:
            f.write(b"\x07" * 80)  # rows of a turn written but never journaled: cut back at the start

        process, url = proxy_process(engine_url, model_dir, dumps, tmp_path / "proxy-2.log", *args)
        try:
            process.wait_ready(f"{url}/readyz", 90)
            assert httpx.get(f"{url}/stats").json()["sessions_lost"] == 0
            assert routing_file(dumps, sid, key).read_bytes() == rows_before  # byte for byte
            chat = f"{url}/v1/sessions/{sid}/chat/completions"
            for idempotency_key, body, answer in delivered:  # every delivered turn replays as it was
                headers = {**bearer(key), "Idempotency-Key": idempotency_key}
                again = httpx.post(chat, headers=headers, json=body, timeout=60)
                assert again.status_code == 200 and again.content == answer
            data = httpx.get(
                f"{url}/v1/sessions/{sid}", params={"tokens": "true"}, headers=bearer(key)
            ).json()
            # Rows on disk: one per recorded token but the last of each branch (never forwarded).
            leaves = data["num_branches"]
            row_bytes = MOE.layers * MOE.top_k  # uint8: 16 experts
            assert len(rows_before) == HEADER_BYTES + (data["num_tokens"] - leaves) * row_bytes
            assert httpx.post(f"{url}/v1/sessions/{sid}/finish", headers=bearer(key)).status_code == 200
            batch = export(url, "leaves")
            assert batch.num_trajectories == leaves == 3
            assert batch.routing is not None and batch.tensors["routed_experts"].dtype == np.uint8
            for i in range(batch.num_trajectories):
                ids = batch.trajectory(i)["input_ids"]
                rows = batch.routed_experts(i)
                assert rows.shape == (len(ids) - 1, MOE.layers, MOE.top_k)
                assert rows.nbytes == (len(ids) - 1) * row_bytes
                assert np.array_equal(rows, reference(ids)), i  # the engine's routing, token for token
        finally:
            assert process.terminate() == 0


def _post_quietly(url: str, headers: dict, body: dict) -> object:
    try:
        return httpx.post(url, headers=headers, json=body, timeout=60)
    except httpx.HTTPError as exc:
        return exc


def export_bytes(url: str, samples: str = "latest") -> bytes:
    body = {"samples": samples, "max_trajectories": 100}
    response = httpx.post(f"{url}/v1/exports", headers=ADMIN, json=body, timeout=60)
    assert response.status_code == 201, response.text
    return response.content


def export(url: str, samples: str = "latest"):
    return decode_batch(export_bytes(url, samples))


def test_a_turn_continued_across_a_weight_update_keeps_each_tokens_rows(model_dir, tmp_path):
    """The trainer aborts the engine mid-turn, loads new weights (seed 7) and continues it: the tokens
    made before keep the old weights' rows, the last of them and those after get the new weights'
    (the continuation's prefill is the first forward of that last token), each with its version."""
    weights = write_weights(tmp_path / "v1", seed=7)
    engine = emulator_app(str(model_dir), seed=ENGINE_SEED, token_delay_s=0.1, routed_experts=True)
    with (
        serve_app(engine) as engine_url,
        running_proxy(engine_url, model_dir, tmp_path / "dumps", routed_experts=True) as proxy,
    ):
        sid, key = proxy.create_session()
        messages = [{"role": "user", "content": "before the update"}]
        messages.append(
            proxy.chat_turn(sid, key, messages, max_tokens=6, temperature=0)["choices"][0]["message"]
        )
        messages.append({"role": "user", "content": "a long answer across the update please"})
        generated = httpx.get(f"{engine_url}/emulator_stats").json()["generated_tokens"]
        answers: list[httpx.Response] = []
        body = chat_body(messages, max_tokens=40, temperature=0)
        sender = threading.Thread(target=lambda: answers.append(_post_quietly(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions", bearer(key), body
        )))  # fmt: skip
        sender.start()
        wait_for(
            lambda: httpx.get(f"{engine_url}/emulator_stats").json()["generated_tokens"] >= generated + 3,
            30,
            "three tokens of the second turn",
            0.01,
        )
        # What a trainer does around an update in abort mode, on the engine (no gateway: see below).
        assert httpx.post(f"{engine_url}/pause_generation", json={"mode": "abort"}).status_code == 200
        update = {"model_path": str(weights), "weight_version": "1"}
        assert httpx.post(f"{engine_url}/update_weights_from_disk", json=update, timeout=60).json()["success"]
        assert httpx.post(f"{engine_url}/continue_generation", json={}).status_code == 200
        sender.join(60)
        assert answers[0].status_code == 200, answers[0]
        assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", headers=bearer(key)).status_code == 200
        data = export_bytes(proxy.url)
        batch = decode_batch(data)
        trajectory = batch.trajectory(0)
        ids, versions = trajectory["input_ids"], trajectory["versions"]
        _, output_start, end = trajectory["turn_bounds"][-1]
        assert set(versions[output_start:end]) == {0, 1}, "the turn spans the update"
        change = versions.index(1, output_start)  # the first token the new weights made
        old, _ = route(ids[: change - 1], ENGINE_SEED, MOE)
        new, _ = route(ids[: end - 1], 7, MOE)
        assert np.array_equal(batch.routed_experts(0), np.concatenate([old, new[change - 1 :]]))
        assert not np.array_equal(old[output_start:], route(ids[: change - 1], 7, MOE)[0][output_start:])
        # The trainer's tensors: aligned with input_ids, the last token without a row.
        tensors = to_torch([PulledBatch(proxy.url, batch.batch_id, data)], routed_experts=True)
        n = len(ids)
        assert tensors["routed_experts"].shape == (1, n, MOE.layers, MOE.top_k)
        assert tensors["routed_experts"].dtype == torch.uint8
        assert tensors["routed_experts_mask"][0].tolist() == [True] * (n - 1) + [False]
        assert np.array_equal(tensors["routed_experts"][0, : n - 1].numpy(), batch.routed_experts(0))


@pytest.mark.parametrize(
    "through_router",
    [
        pytest.param(False, id="engine-without-capture"),
        pytest.param(True, id="router", marks=pytest.mark.router),
    ],
)
def test_a_turn_without_routing_fails_with_502_and_records_nothing(through_router, model_dir, tmp_path):
    if through_router:  # the real sglang-router 0.3.2 before engines that capture: it drops the field
        from rolloutfleet_testkit.routed_engines import routed_emulators

        upstream = routed_emulators(model_dir, tmp_path, count=1, routed_experts=True)
    else:
        upstream = _single(serve_app(emulator_app(str(model_dir), seed=ENGINE_SEED)))
    with (
        upstream as (url, _),
        running_proxy(url, model_dir, tmp_path / "dumps", routed_experts=True) as proxy,
    ):
        sid, key = proxy.create_session()
        answer = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers=bearer(key),
            json=chat_body([{"role": "user", "content": "hello"}]),
            timeout=60,
        )
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert (
            error["code"] == "upstream_routing_missing"
            and "--enable-return-routed-experts" in error["message"]
        )
        assert proxy.get(sid, key).json()["num_turns"] == 0
        assert not (tmp_path / "dumps" / "routing").exists() or not any(
            (tmp_path / "dumps" / "routing").iterdir()
        )


def test_rows_lost_with_unsynced_writes_are_rebuilt_from_the_journal(model_dir, tmp_path):
    """A machine that loses the routing file's unsynced writes (here: all of them) keeps the journal,
    fsynced with every turn: the restore writes the file again, byte for byte. A restart with routing
    replay off keeps the sessions and drops their rows."""
    import shutil

    from rolloutfleet_proxy.storage.restore import recover
    from rolloutfleet_wire.routed_experts import RoutingShape

    dumps = tmp_path / "dumps"
    engine = emulator_app(str(model_dir), seed=ENGINE_SEED, routed_experts=True)
    with serve_app(engine) as url, running_proxy(url, model_dir, dumps, routed_experts=True) as proxy:
        sid, key = proxy.create_session()
        messages = [{"role": "user", "content": "one"}]
        for text in ("two", "three"):
            messages.append(proxy.chat_turn(sid, key, messages, max_tokens=8)["choices"][0]["message"])
            messages.append({"role": "user", "content": text})
        copy = tmp_path / "copy"
        shutil.copytree(dumps, copy)  # what a power cut leaves: the journal (synced), the files as written
    original = routing_file(copy, sid, key).read_bytes()
    routing_file(copy, sid, key).unlink()
    recovered = recover(copy, routing_shape=RoutingShape(MOE.layers, MOE.top_k, MOE.experts))
    assert sid in recovered.sessions and not recovered.lost
    assert routing_file(copy, sid, key).read_bytes() == original
    # Restarted with routing replay off: the session is back with its tokens, its rows dropped.
    off = recover(copy)
    assert off.sessions[sid].num_turns == 2 and not any(off.sessions[sid].turn_routed)
    assert not routing_file(copy, sid, key).exists()


class _single:
    """One emulator as `routed_emulators` yields them: (its URL, [its URL])."""

    def __init__(self, served):
        self._served = served

    def __enter__(self):
        url = self._served.__enter__()
        return url, [url]

    def __exit__(self, *exc):
        return self._served.__exit__(*exc)
