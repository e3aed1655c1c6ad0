"""Session affinity through the real sglang-router: the proxy sends the session id as
`X-SMG-Routing-Key`, which the router's `manual` policy routes by, so every turn of a session lands on
the engine holding its history and the engine reports that history as `cached_tokens` (SGLang's
radix cache, emulated). `round_robin` ignores the key: a session's turns move and lose their cache."""

from __future__ import annotations

import httpx
import pytest
from proxy_harness import running_proxy
from rolloutfleet_testkit.routed_engines import routed_emulators

SESSIONS, TURNS = 7, 3  # odd: round_robin cannot line a session up with one engine by chance


def _cached(engines: list[str]) -> int:
    return sum(httpx.get(f"{url}/emulator_stats").json()["cached_tokens"] for url in engines)


def _reuse(policy: str, tokenizer_dir, tmp_path) -> float:
    """Σ cached_tokens / Σ history tokens over turns 2..TURNS (first turns run first, not counted)."""
    with (
        routed_emulators(tokenizer_dir, tmp_path, count=2, policy=policy) as (router_url, engines),
        running_proxy(router_url, tokenizer_dir, None) as proxy,
    ):
        sessions = [(*proxy.create_session(), []) for _ in range(SESSIONS)]

        def turn(sid: str, key: str, messages: list) -> None:
            messages.append({"role": "user", "content": f"turn {len(messages) // 2} of {sid}, go on"})
            response = httpx.post(
                f"{proxy.url}/v1/sessions/{sid}/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"messages": messages, "max_tokens": 12, "temperature": 0},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            messages.append(response.json()["choices"][0]["message"])

        for session in sessions:
            turn(*session)
        before = _cached(engines)
        for _ in range(TURNS - 1):
            for session in sessions:
                turn(*session)
        cached = _cached(engines) - before
        history = 0
        for sid, key, _ in sessions:
            turns = proxy.get(sid, key).json()["trajectory"]["turns"]
            history += sum(bounds[0] for bounds in turns[1:])
    return cached / history


@pytest.mark.router
def test_the_routing_key_keeps_a_session_on_its_engines_prefix_cache(test_tokenizer_dir, tmp_path):
    manual = _reuse("manual", test_tokenizer_dir, tmp_path)
    # Every continuation turn hits all of its history but the last token (RadixCache keeps
    # (input + output)[:-1] of a finished request).
    assert manual > 0.95
    assert _reuse("round_robin", test_tokenizer_dir, tmp_path) < manual - 0.2
