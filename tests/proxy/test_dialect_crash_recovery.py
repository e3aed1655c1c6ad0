"""A session spoken in Anthropic Messages, OpenAI Responses and chat completions survives SIGKILL (what
the OOM killer sends): after a restart on the same dump directory every delivered turn, streamed or
not, replays byte-identical from the record in its own dialect, the trajectory is the same, and
`previous_response_id` resolves against the restored tree. A real proxy process behind which the real
sglang-router routes to the SGLang emulator (a stand-in: no GPU here)."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from anthropic import Anthropic
from proxy_harness import ADMIN, bearer, proxy_process
from rolloutfleet_testkit.routed_engines import routed_emulators

ANTHROPIC_TOOLS = [
    {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
]
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": ANTHROPIC_TOOLS[0]["input_schema"]}
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": ANTHROPIC_TOOLS[0]["input_schema"]},
    }
]


def start(router_url: str, tokenizer_dir, dumps, log):
    process, url = proxy_process(
        router_url, tokenizer_dir, dumps, log, "--tool-call-parser", "qwen25", "--no-log-requests"
    )
    process.wait_ready(f"{url}/readyz", 90)
    return process, url


def text_of_message(message: dict) -> str:
    return "".join(block["text"] for block in message["content"] if block["type"] == "text")


def sse_data(raw: bytes, event: str) -> list[dict]:
    """The `data` of the named events in a server-sent event stream."""
    out = []
    for chunk in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines() if ": " in line)
        if lines.get("event") == event:
            out.append(json.loads(lines["data"]))
    return out


@pytest.mark.router
def test_a_mixed_dialect_session_replays_byte_identical_after_sigkill(test_tokenizer_dir, tmp_path):
    dumps = tmp_path / "dumps"
    with routed_emulators(test_tokenizer_dir, tmp_path, count=1) as (router_url, _):
        process, url = start(router_url, test_tokenizer_dir, dumps, tmp_path / "first.log")
        created = httpx.post(f"{url}/v1/sessions", headers=ADMIN, json={}).json()
        sid, key = created["session_id"], created["session_key"]
        base = f"{url}/v1/sessions/{sid}"
        delivered: list[tuple[str, dict, str, bytes]] = []

        def send(path: str, body: dict) -> httpx.Response:
            idempotency_key = f"turn-{len(delivered)}"
            answer = httpx.post(
                base + path,
                headers={**bearer(key), "Idempotency-Key": idempotency_key},
                json=body,
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            delivered.append((path, body, idempotency_key, answer.content))
            return answer

        try:
            first = send(
                "/v1/messages",
                {
                    "model": "m",
                    "max_tokens": 6,
                    "system": "Be brief.",
                    "tools": ANTHROPIC_TOOLS,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            ).json()
            # A Responses turn continuing the Messages turn: a response id names any recorded turn.
            streamed = send(
                "/responses",
                {
                    "model": "m",
                    "previous_response_id": f"resp_{sid}_0",
                    "input": "More?",
                    "max_output_tokens": 6,
                    "tools": RESPONSES_TOOLS,
                    "stream": True,
                },
            ).content
            (done,) = sse_data(streamed, "response.completed") or sse_data(streamed, "response.incomplete")
            second_text = done["response"]["output"][-1]["content"][0]["text"]
            history = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": text_of_message(first)},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": second_text},
                {"role": "user", "content": "Last one."},
            ]
            third = send(
                "/chat/completions", {"messages": history, "max_tokens": 6, "tools": CHAT_TOOLS}
            ).json()
            assert third["rolloutfleet"]["turn"] == 2
            anthropic_history = [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": text_of_message(first)},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": second_text},
                {"role": "user", "content": "Last one."},
                {"role": "assistant", "content": third["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Bye."},
            ]
            send(
                "/v1/messages",
                {
                    "model": "m",
                    "max_tokens": 6,
                    "system": "Be brief.",
                    "tools": ANTHROPIC_TOOLS,
                    "messages": anthropic_history,
                    "stream": True,
                },
            )
            before = httpx.get(base, params={"tokens": "true"}, headers=bearer(key)).json()
            assert before["num_turns"] == 4 and before["num_branches"] == 1
        finally:
            process.process.send_signal(signal.SIGKILL)
            process.process.wait(10)
            process.terminate()

        process, url = start(router_url, test_tokenizer_dir, dumps, tmp_path / "second.log")
        try:
            for path, body, idempotency_key, answer in delivered:
                again = httpx.post(
                    url + f"/v1/sessions/{sid}" + path,
                    headers={**bearer(key), "Idempotency-Key": idempotency_key},
                    json=body,
                    timeout=60,
                )
                assert again.status_code == 200, again.text
                assert again.headers["Idempotent-Replayed"] == "true", path
                assert again.content == answer, path
            base = f"{url}/v1/sessions/{sid}"
            after = httpx.get(base, params={"tokens": "true"}, headers=bearer(key)).json()
            assert after == before
            # previous_response_id against the restored tree: a branch after the second turn.
            branch = httpx.post(
                base + "/responses",
                headers=bearer(key),
                json={
                    "model": "m",
                    "previous_response_id": f"resp_{sid}_1",
                    "input": "Another way?",
                    "max_output_tokens": 4,
                    "tools": RESPONSES_TOOLS,
                },
                timeout=60,
            )
            assert branch.status_code == 200, branch.text
            assert branch.json()["id"] == f"resp_{sid}_4"
            # And the Anthropic client goes on after the last turn from the capability URL alone.
            last = "".join(
                e["delta"]["text"]
                for e in sse_data(delivered[3][3], "content_block_delta")
                if e["delta"]["type"] == "text_delta"
            )
            client = Anthropic(base_url=url + created["capability_url"], api_key="EMPTY", max_retries=0)
            on = client.messages.create(
                model="m",
                max_tokens=4,
                system="Be brief.",
                tools=ANTHROPIC_TOOLS,
                messages=[
                    *anthropic_history,
                    {"role": "assistant", "content": last},
                    {"role": "user", "content": "Again."},
                ],
            )
            assert on.id == f"msg_{sid}_5"
            summary = httpx.get(base, headers=bearer(key)).json()
            assert summary["num_turns"] == 6 and summary["num_branches"] == 2
        finally:
            assert process.terminate() == 0
