"""The rollout-worker client (rolloutfleet_client) against real proxies: placement across a fleet of
three proxy processes, ride-through while one is restarted mid-rollout (SIGTERM, then a new process
on the same port and dump directory), a session lost on purpose reported as lost and never replaced,
and the placement and retry policies as tables."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from proxy_harness import ADMIN, ADMIN_KEY, running_proxy
from rolloutfleet_client import (
    Backoff,
    FleetClient,
    NoProxyAvailable,
    ProxyRequestError,
    SessionLost,
    turn_ids,
)
from rolloutfleet_client.placement import LEAST_LOADED, RANDOM, choose_endpoint
from rolloutfleet_client.retry import (
    DELETE,
    READ,
    TURN,
    WRITE,
    Action,
    classify_create_answer,
    classify_exception,
    classify_session_answer,
    retry_after_s,
)
from rolloutfleet_client.rollout_example import export_and_ack, run_rollouts
from rolloutfleet_proxy.storage.dumps import LIVE_AREA
from rolloutfleet_testkit.processes import ServerProcess, free_port, proxy_command, serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app

FAST = Backoff(initial_s=0.1, cap_s=1.0)  # the default caps at 5 s; the tests need not wait that long

# --- placement, as a table -------------------------------------------------------------------------

A, B, C = "http://a", "http://b", "http://c"


@pytest.mark.parametrize(
    ("policy", "live", "exclude", "allowed"),
    [
        (LEAST_LOADED, {}, (), {A, B, C}),  # all at 0: any of them
        (LEAST_LOADED, {A: 2, B: 1, C: 2}, (), {B}),
        (LEAST_LOADED, {A: 2, B: 1, C: 1}, (), {B, C}),  # a tie: either
        (LEAST_LOADED, {A: 0, B: 1, C: 2}, (A,), {B}),  # excluded (refused this round)
        (LEAST_LOADED, {A: 5}, (B,), {C}),  # unknown endpoints count 0
        (RANDOM, {A: 100, B: 0, C: 0}, (), {A, B, C}),  # random ignores the counts
        (RANDOM, {}, (A, C), {B}),
    ],
)
def test_choose_endpoint(policy, live, exclude, allowed):
    picks = {choose_endpoint([A, B, C], live, policy, random.Random(seed), exclude) for seed in range(40)}
    assert picks == allowed


def test_choose_endpoint_refuses_nonsense():
    with pytest.raises(ValueError, match="no endpoint left"):
        choose_endpoint([A, B], {}, LEAST_LOADED, random.Random(0), {A, B})
    with pytest.raises(ValueError, match="unknown placement"):
        choose_endpoint([A], {}, "round_robin", random.Random(0))


def test_least_loaded_placement_is_even_and_random_is_reproducible():
    live: Counter[str] = Counter()
    rng = random.Random(3)
    for _ in range(30):
        live[choose_endpoint([A, B, C], live, LEAST_LOADED, rng)] += 1
    assert live == {A: 10, B: 10, C: 10}
    first = [choose_endpoint([A, B, C], {}, RANDOM, random.Random(9)) for _ in range(5)]
    again = [choose_endpoint([A, B, C], {}, RANDOM, random.Random(9)) for _ in range(5)]
    assert first == again


# --- the retry policy, as tables -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "call", "maybe_handled", "action"),
    [
        (200, "", TURN, False, Action.OK),
        (204, "", DELETE, False, Action.OK),
        (503, "draining", TURN, False, Action.WAIT),  # owner shutting down, nothing recorded
        (503, "draining", WRITE, False, Action.WAIT),
        (503, "generation_paused", TURN, False, Action.WAIT),
        (503, "storage_unavailable", WRITE, False, Action.WAIT),  # the owner cannot persist right now
        (503, "http_error", READ, False, Action.WAIT),  # a 503 without the proxy's body
        (502, "upstream_error", TURN, False, Action.WAIT),
        (404, "not_found", TURN, False, Action.CHECK_READY),  # lost, or a replacement restoring
        (404, "not_found", READ, True, Action.CHECK_READY),
        (404, "not_found", DELETE, True, Action.OK),  # the lost attempt deleted it
        (410, "session_gone", TURN, False, Action.FATAL),
        (410, "session_deleted", TURN, True, Action.FATAL),
        (409, "history_mismatch", TURN, False, Action.FATAL),
        (409, "session_busy", TURN, False, Action.FATAL),  # a concurrent turn: a client bug
        (409, "session_busy", TURN, True, Action.WAIT),  # our own earlier attempt still running
        (409, "session_busy", WRITE, True, Action.FATAL),
        (400, "no_new_messages", TURN, False, Action.FATAL),
        (400, "no_new_messages", TURN, True, Action.TURN_RECORDED),  # recorded; its reply was lost
        (400, "invalid_parameter", TURN, True, Action.FATAL),
        (401, "unauthorized", READ, False, Action.FATAL),
        (504, "upstream_timeout", TURN, False, Action.FATAL),
        (500, "internal_error", TURN, False, Action.FATAL),
    ],
)
def test_session_answer_verdicts(status, code, call, maybe_handled, action):
    assert classify_session_answer(status, code, call=call, maybe_handled=maybe_handled).action is action


@pytest.mark.parametrize(
    ("status", "code", "action"),
    [
        (201, "", Action.OK),
        (503, "draining", Action.OTHER_PROXY),
        (503, "memory_pressure", Action.OTHER_PROXY),
        (429, "over_capacity", Action.OTHER_PROXY),
        (502, "http_error", Action.OTHER_PROXY),
        (400, "invalid_metadata", Action.FATAL),
        (401, "unauthorized", Action.FATAL),
        (409, "session_exists", Action.FATAL),
        (500, "internal_error", Action.FATAL),
    ],
)
def test_create_answer_verdicts(status, code, action):
    assert classify_create_answer(status, code).action is action


_REQUEST = httpx.Request("POST", "http://x/v1/sessions/s/chat/completions")


@pytest.mark.parametrize(
    ("exc", "action", "maybe_handled", "action_creating"),
    [
        (httpx.ConnectError("refused", request=_REQUEST), Action.WAIT, False, Action.OTHER_PROXY),
        (httpx.ConnectTimeout("slow", request=_REQUEST), Action.WAIT, False, Action.OTHER_PROXY),
        (httpx.PoolTimeout("pool", request=_REQUEST), Action.WAIT, False, Action.OTHER_PROXY),
        (httpx.ReadError("reset", request=_REQUEST), Action.WAIT, True, Action.OTHER_PROXY),
        (httpx.WriteError("broken pipe", request=_REQUEST), Action.WAIT, True, Action.OTHER_PROXY),
        (httpx.RemoteProtocolError("closed", request=_REQUEST), Action.WAIT, True, Action.OTHER_PROXY),
        (httpx.ReadTimeout("slow answer", request=_REQUEST), Action.FATAL, False, Action.FATAL),
        (httpx.UnsupportedProtocol("ftp", request=_REQUEST), Action.FATAL, False, Action.FATAL),
    ],
)
def test_exception_verdicts(exc, action, maybe_handled, action_creating):
    verdict = classify_exception(exc)
    assert (verdict.action, verdict.maybe_handled) == (action, maybe_handled)
    assert classify_exception(exc, creating=True).action is action_creating


@pytest.mark.parametrize(
    ("attempt", "retry_after", "rand", "expected"),
    [
        (0, None, 0.5, 0.2),
        (1, None, 0.5, 0.4),
        (3, None, 0.5, 1.6),
        (5, None, 0.5, 5.0),  # 6.4 capped
        (500, None, 0.5, 5.0),  # no overflow
        (0, 2.0, 0.5, 2.0),  # Retry-After is a floor
        (0, 60.0, 0.5, 5.0),  # ... capped too
        (4, 2.0, 0.5, 3.2),
        (0, None, 0.0, 0.18),  # jitter: -10 %
        (0, None, 0.999999, 0.22),  # +10 %
    ],
)
def test_backoff_delays(attempt, retry_after, rand, expected):
    assert Backoff().delay(attempt, retry_after, rand) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("attempt", "elapsed", "total", "expected"),
    [
        (0, 0.0, 10.0, 0.2),
        (5, 3.0, 10.0, 5.0),
        (5, 8.0, 10.0, 2.0),  # the last wait ends at the deadline
        (0, 10.0, 10.0, None),  # used up: give up
        (0, 11.0, 10.0, None),
    ],
)
def test_backoff_deadline(attempt, elapsed, total, expected):
    assert Backoff().next_wait(attempt, elapsed, total) == (
        expected if expected is None else pytest.approx(expected)
    )


def test_backoff_and_retry_after_parsing_edges():
    with pytest.raises(ValueError):
        Backoff(initial_s=0)
    with pytest.raises(ValueError):
        Backoff(initial_s=2, cap_s=1)
    assert [retry_after_s(v) for v in ("2", "0.5", None, "Wed, 21 Oct 2015 07:28:00 GMT", "-1")] == [
        2.0,
        0.5,
        None,
        None,
        None,
    ]


# --- real proxies ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream_url():
    # A little latency so that turns are in flight when a proxy is told to stop.
    with serve_app(create_stub_app(latency_s=0.1, output_tokens=4)) as url:
        yield url


@dataclass
class ProxyProcess:
    """A proxy process on a fixed port with its own dump directory; restartable on both."""

    upstream: str
    tokenizer: Path
    work: Path
    port: int = field(default_factory=free_port)
    process: ServerProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dump_dir(self) -> Path:
        return self.work / f"dumps-{self.port}"

    def start(self) -> None:
        self.starts += 1
        args = proxy_command(
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--public-url",
            self.url,  # the per-pod URL the operator would inject
            "--upstream-url",
            self.upstream,
            "--tokenizer-path",
            str(self.tokenizer),
            "--dump-dir",
            str(self.dump_dir),
            "--drain-grace-s",
            "5",
            "--no-log-requests",
        )
        log = self.work / f"proxy-{self.port}-{self.starts}.log"
        self.process = ServerProcess(args, log, env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY})

    def wait_ready(self) -> None:
        assert self.process is not None
        self.process.wait_ready(f"{self.url}/readyz", 120)

    def stop(self) -> int:
        """SIGTERM: the proxy drains and writes its sessions to live/; returns the exit code."""
        assert self.process is not None
        return self.process.terminate(60)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats").json()


@pytest.fixture(scope="module")
def fleet(upstream_url, test_tokenizer_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    proxies = [ProxyProcess(upstream_url, test_tokenizer_dir, work) for _ in range(3)]
    try:
        for proxy in proxies:  # all three start at once
            proxy.start()
        for proxy in proxies:
            proxy.wait_ready()
        yield proxies
    finally:
        for proxy in proxies:
            if proxy.process is not None:
                proxy.stop()


async def _delete_all(client: FleetClient, sessions) -> None:
    await asyncio.gather(*(client.delete(s) for s in sessions))


async def test_least_loaded_spreads_sessions_evenly(fleet):
    urls = [p.url for p in fleet]
    status = {"metadata": {"name": "rollouts"}, "status": {"proxyEndpoints": [urls[0] + "/", *urls[1:]]}}
    with pytest.raises(ValueError, match="no ready proxies"):
        FleetClient.from_fleet_status({"status": {"proxyEndpoints": []}}, ADMIN_KEY)
    async with FleetClient.from_fleet_status(status, ADMIN_KEY, seed=1) as client:
        assert client.endpoints == urls
        sessions = await asyncio.gather(*(client.create_session({"i": i}) for i in range(30)))
        assert Counter(s.owner for s in sessions) == dict.fromkeys(urls, 10)
        assert client.live_sessions == dict.fromkeys(urls, 10)
        for s in sessions:
            assert s.owner == s.endpoint  # proxy_url: the proxy's own public URL
            assert client.openai_base_url(s) == f"{s.owner}/v1/sessions/{s.session_id}"
        await client.finish(sessions[0])
        await _delete_all(client, sessions[1:])
        assert client.live_sessions == dict.fromkeys(urls, 0)
        await client.delete(sessions[0])
        client.update_endpoints(urls[:1])  # the fleet was scaled down: new sessions go to the rest
        extra = [await client.create_session() for _ in range(3)]
        assert {s.owner for s in extra} == {urls[0]}
        await _delete_all(client, extra)


async def test_random_placement_covers_every_proxy_reproducibly(fleet):
    urls = [p.url for p in fleet]
    placements = []
    for _ in range(2):
        async with FleetClient(urls, admin_key=ADMIN_KEY, placement="random", seed=7) as client:
            sessions = [await client.create_session() for _ in range(24)]
            placements.append([s.owner for s in sessions])
            await _delete_all(client, sessions)
    assert placements[0] == placements[1]  # the seed decides
    assert set(placements[0]) == set(urls)


async def test_rollout_rides_through_a_proxy_restart(fleet, caplog):
    """SIGTERM one proxy mid-rollout, start a new process on its port and dump directory: every
    session completes with every turn recorded."""
    caplog.set_level(logging.INFO, logger="rolloutfleet.client")
    victim = fleet[0]
    sessions, turns = 12, 10
    async with FleetClient([p.url for p in fleet], admin_key=ADMIN_KEY, seed=2, backoff=FAST) as client:
        rollout = asyncio.create_task(
            run_rollouts(
                client,
                sessions=sessions,
                turns=turns,
                concurrency=sessions,
                turn_rewards=True,
                progress=lambda _: None,
            )
        )
        async with httpx.AsyncClient() as http:
            for _ in range(600):
                if (await http.get(f"{victim.url}/stats")).json()["totals"]["turns"] >= 8:  # 2 turns each
                    break
                await asyncio.sleep(0.05)
        assert await asyncio.to_thread(victim.stop) == 0  # drained: written to live/
        victim.start()
        await asyncio.to_thread(victim.wait_ready)
        outcomes = await asyncio.wait_for(rollout, 90)
    assert [o.error for o in outcomes] == [None] * sessions
    waits = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert waits and all(victim.url in w for w in waits)  # every wait logged, all for the victim
    assert Counter(o.owner for o in outcomes) == dict.fromkeys((p.url for p in fleet), 4)
    restarted = victim.stats()
    assert restarted["totals"]["sessions_restored"] == 4
    assert restarted["totals"]["sessions_created"] == 0  # nothing was started in place of anything
    assert restarted["totals"]["turns"] > 0  # the rollout went on on the replacement
    async with httpx.AsyncClient(headers=ADMIN) as http:
        for o in outcomes:
            summary = (
                await http.get(f"{o.owner}/v1/sessions/{o.session_id}", params={"tokens": "true"})
            ).json()
            assert summary["num_turns"] == turns and len(summary["trajectory"]["turns"]) == turns
            assert summary["finished"] and summary["reward"] == o.reward
            assert len(summary["turn_rewards"]) == turns
    exported = await asyncio.to_thread(export_and_ack, ADMIN_KEY, outcomes)
    assert exported["trajectories_exported"] == sessions


async def test_a_session_lost_in_a_restart_is_reported_never_replaced(fleet):
    """The dump of one session is removed while its proxy is down: once the replacement is ready,
    that session's turn raises SessionLost naming it; the other session goes on."""
    owner = fleet[1]
    async with FleetClient([owner.url], admin_key=ADMIN_KEY, backoff=FAST, restart_timeout_s=60) as client:
        lost, kept = await client.create_session(), await client.create_session()
        conversations = {}
        for s in (lost, kept):
            messages = [{"role": "user", "content": f"hello from {s.session_id}"}]
            reply = await client.chat(s, messages, max_tokens=4)
            conversations[s.session_id] = [
                *messages,
                reply["choices"][0]["message"],
                {"role": "user", "content": "more"},
            ]
        assert await asyncio.to_thread(owner.stop) == 0
        (owner.dump_dir / LIVE_AREA / f"{lost.session_id}.safetensors").unlink()
        # Both turns are sent while the owner is down: they wait for it.
        turns = {
            s.session_id: asyncio.create_task(client.chat(s, conversations[s.session_id], max_tokens=4))
            for s in (lost, kept)
        }
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in turns.values())
        owner.start()
        await asyncio.to_thread(owner.wait_ready)
        with pytest.raises(SessionLost) as raised:
            await asyncio.wait_for(turns[lost.session_id], 30)
        assert raised.value.session_id == lost.session_id and raised.value.owner == owner.url
        assert lost.session_id in str(raised.value)
        assert (await asyncio.wait_for(turns[kept.session_id], 30))["rolloutfleet"]["turn"] == 1
        assert not lost.live and client.live_sessions == {owner.url: 1}
        stats = owner.stats()
        assert stats["live_sessions"] == 1 and stats["totals"]["sessions_created"] == 0
        await client.delete(kept)


async def test_a_finished_session_its_owner_lost_is_named_at_export_and_the_rest_exported(fleet):
    """Sessions that completed, then whose owner came back without one of them (its dump removed
    while it was down): the export marks exactly that one lost, by name, and exports the others."""
    owner = fleet[2]
    async with FleetClient([owner.url], admin_key=ADMIN_KEY, backoff=FAST) as client:
        outcomes = await run_rollouts(
            client, sessions=3, turns=1, concurrency=3, max_tokens=4, progress=lambda _: None
        )
    assert [o.error for o in outcomes] == [None] * 3
    assert await asyncio.to_thread(owner.stop) == 0
    gone = outcomes[1].session_id
    (owner.dump_dir / LIVE_AREA / f"{gone}.safetensors").unlink()
    owner.start()
    await asyncio.to_thread(owner.wait_ready)
    exported = await asyncio.to_thread(export_and_ack, ADMIN_KEY, outcomes)
    assert exported["trajectories_exported"] == 2
    assert outcomes[1].error and gone in outcomes[1].error and "lost" in outcomes[1].error
    assert outcomes[0].error is None and outcomes[2].error is None


def test_the_example_rollout_command(fleet, tmp_path, monkeypatch, capsys):
    from rolloutfleet_client.rollout_example import main

    status = tmp_path / "fleet.json"
    status.write_text(
        json.dumps({"kind": "RolloutFleet", "status": {"proxyEndpoints": [p.url for p in fleet]}})
    )
    monkeypatch.setenv("ROLLOUTFLEET_PROXY_ADMIN_KEY", ADMIN_KEY)
    with pytest.raises(SystemExit) as exited:
        main(["--fleet-status", str(status), "--sessions", "6", "--turns", "2", "--log-level", "warning"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("rollout: 6 sessions x 2 turns on 3 endpoint(s)")
    summary = json.loads(lines[-1])
    assert (summary["sessions"], summary["completed"], summary["turns"], summary["failures"]) == (6, 6, 12, 0)
    assert summary["trajectories_exported"] == 6 and sorted(summary["sessions_per_proxy"].values()) == [
        2,
        2,
        2,
    ]


# --- creation when proxies refuse, and the client URL (in-process proxies) -------------------------


async def test_creation_moves_on_from_a_refusing_proxy_then_gives_up_bounded(
    upstream_url, test_tokenizer_dir
):
    with (
        running_proxy(upstream_url, test_tokenizer_dir, None, max_concurrent_sessions=2) as small,
        running_proxy(upstream_url, test_tokenizer_dir, None) as big,
    ):
        async with FleetClient(
            [small.url, big.url], admin_key=ADMIN_KEY, seed=0, create_timeout_s=1.0
        ) as client:
            sessions = [await client.create_session() for _ in range(8)]
            # least-loaded alternates until `small` answers 429 over_capacity; then `big` takes the rest
            assert Counter(s.owner for s in sessions) == {small.url: 2, big.url: 6}
            assert small.stats()["admission"]["refused"] >= 1
        async with FleetClient([small.url], admin_key=ADMIN_KEY, create_timeout_s=1.0) as client:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(NoProxyAvailable, match="429 over_capacity") as raised:
                await client.create_session()
            assert 0.9 <= loop.time() - started < 3  # bounded by create_timeout_s
            assert list(raised.value.refusals) == [small.url]
            with pytest.raises(ProxyRequestError, match="invalid_metadata"):
                await client.create_session({"x": "y" * 10_000})  # a client bug is not retried


async def test_client_url_and_the_openai_client(upstream_url, test_tokenizer_dir):
    """Through a single client URL (the fleet's Service), with no public_url on the proxy: turns go
    to the URL the session was created at. The base URL works with the official openai client."""
    from openai import AsyncOpenAI

    with running_proxy(upstream_url, test_tokenizer_dir, None) as proxy:
        async with FleetClient(client_url=proxy.url + "/", admin_key=ADMIN_KEY) as client:
            session = await client.create_session({"task": "t"})
            assert session.owner == proxy.url and session.metadata == {"task": "t"}
            messages = [{"role": "user", "content": "hi"}]
            reply = await client.chat(session, messages, max_tokens=4)
            openai = AsyncOpenAI(
                base_url=client.openai_base_url(session), api_key=session.session_key, max_retries=0
            )
            async with openai:
                second = await openai.chat.completions.create(
                    model="rolloutfleet",
                    messages=[
                        *messages,
                        reply["choices"][0]["message"],
                        {"role": "user", "content": "again"},
                    ],
                    max_tokens=4,
                )
            assert second.model_extra["rolloutfleet"]["turn"] == 1
            # The agent's view: the capability URL alone (relative on this proxy: made absolute
            # against the owner), with the placeholder key frameworks pass.
            agent_url = client.agent_base_url(session)
            assert agent_url.startswith(proxy.url + f"/v1/sessions/{session.session_id}/cap/")
            async with AsyncOpenAI(base_url=agent_url, api_key="EMPTY", max_retries=0) as agent:
                retried = await agent.chat.completions.create(
                    model="rolloutfleet",
                    messages=[
                        *messages,
                        reply["choices"][0]["message"],
                        {"role": "user", "content": "again"},
                    ],
                    max_tokens=4,
                )
            assert retried.model_extra["rolloutfleet"]["turn"] == 1  # the same request: its recorded reply
            summary = await client.reward(session, 0.5, turn=1)
            assert summary["turn_rewards"] == {"1": 0.5}
            assert (await client.get(session))["num_turns"] == 2
            history = [*messages, reply["choices"][0]["message"], {"role": "user", "content": "again"}]
            history += [second.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
            history[0] = {"role": "user", "content": "edited"}
            edited = await client.chat(session, history)  # an edited history starts a branch
            assert turn_ids(edited) == [2]
            assert (await client.get(session))["num_branches"] == 2
            # A key that does not open the session gets the 404 of an unknown id from a ready owner.
            impostor = dataclasses.replace(session, session_key="rfs-not-its-key", live=False)
            with pytest.raises(SessionLost, match="not one this key opens"):
                await client.get(impostor)
            assert (await client.get(session))["num_turns"] == 3  # the impostor changed nothing
            await client.delete(session)
            with pytest.raises(SessionLost):  # deleted: 404 from a ready owner
                await client.get(session)


async def test_tool_turns_through_the_client(test_tokenizer_dir, tmp_path):
    """tools, tool_choice and chat_template_kwargs go through; tool_calls and reasoning_content come
    back; the tool result continues the session."""
    from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    upstream = ScriptedUpstream(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), [tokenizer.eos_token_id]
    )
    call = (
        "<think>\nadd them\n</think>\n\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    )
    upstream.script(
        tokenizer.encode(call, add_special_tokens=False),
        tokenizer.encode("5<|im_end|>", add_special_tokens=False),
    )
    calculator = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    parsers = {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"}
    with (
        serve_app(upstream) as url,
        running_proxy(url, test_tokenizer_dir, tmp_path / "d", **parsers) as proxy,
    ):
        async with FleetClient([proxy.url], admin_key=ADMIN_KEY) as client:
            session = await client.create_session()
            messages: list[dict] = [{"role": "user", "content": "2+3?"}]
            options = {"tools": [calculator], "tool_choice": "auto", "chat_template_kwargs": {"x": 1}}
            reply = await client.chat(session, messages, **options)
            message = reply["choices"][0]["message"]
            assert reply["choices"][0]["finish_reason"] == "tool_calls"
            assert message["reasoning_content"] == "add them"
            assert message["tool_calls"][0]["function"] == {
                "name": "calculator",
                "arguments": '{"expression": "2+3"}',
            }
            messages += [
                message,
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"},
            ]
            final = await client.chat(session, messages, **options)
            assert final["choices"][0]["message"]["content"] == "5"
            assert (await client.get(session, tokens=False))["num_turns"] == 2


async def test_small_pools_open_a_client_per_few_concurrent_requests(upstream_url):
    from rolloutfleet_client.http_pool import ShardedAsyncClient

    pool = ShardedAsyncClient(shard_size=2)
    try:
        for _ in range(3):  # one after another: the same client, its connection reused
            assert (await pool.request(upstream_url, "GET", f"{upstream_url}/health")).status_code == 200
        assert pool.clients == 1
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        answers = await asyncio.gather(
            *(pool.request(upstream_url, "POST", f"{upstream_url}/generate", json=body) for _ in range(5))
        )
        assert [a.status_code for a in answers] == [200] * 5
        assert pool.clients == 3  # at most 2 requests at a time per client
    finally:
        await pool.aclose()


async def test_an_owner_that_never_comes_back_is_bounded():
    from rolloutfleet_client import OwnerUnavailable, Session

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    session = Session("gone-for-good-1", "rfs-x", owner=dead, endpoint=dead)
    async with FleetClient([dead], admin_key=ADMIN_KEY, backoff=FAST, restart_timeout_s=0.6) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(OwnerUnavailable, match="gone-for-good-1") as raised:
            await client.chat(session, [{"role": "user", "content": "hi"}])
        assert 0.5 <= loop.time() - started < 3
        assert raised.value.owner == dead and "ConnectError" in str(raised.value)


async def test_a_finished_session_is_taken_in_one_call(upstream_url, test_tokenizer_dir, tmp_path):
    """One episode at a time, from async code: export and acknowledge in one call; the proxy then holds
    neither the session nor the batch. Per leaf, a regenerated turn gives two samples."""
    with running_proxy(upstream_url, test_tokenizer_dir, tmp_path / "dumps") as proxy:
        async with FleetClient([proxy.url], admin_key=ADMIN_KEY) as client:
            session = await client.create_session()
            messages = [{"role": "user", "content": "hi"}]
            reply = await client.chat(session, messages, max_tokens=4)
            await client.chat(session, messages, regenerate=True, max_tokens=4)
            await client.reward(session, 1.0)
            expected = (await client.get(session))["trajectory"]
            await client.finish(session)
            (latest,) = await client.take(session)
            assert latest["input_ids"] == expected["input_ids"] and latest["reward"] == 1.0
            assert latest["loss_mask"] == expected["loss_mask"] and latest["sample"]["turn"] == 1
            assert reply["rolloutfleet"]["turn"] == 0
            stats = proxy.stats()
            assert stats["live_sessions"] == 0 and stats["export_bytes"] == 0
            with pytest.raises(ProxyRequestError, match="410 session_gone"):
                await client.take(session)  # taken once
            other = await client.create_session()
            await client.chat(other, messages, max_tokens=4)
            await client.chat(other, messages, regenerate=True, max_tokens=4)
            await client.finish(other)
            leaves = await client.take(other, samples="leaves")
            assert [s["sample"]["turn"] for s in leaves] == [0, 1]
