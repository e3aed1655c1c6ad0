"""A bounded, seeded fuzz of every route: no client input gets a 5xx, errors are JSON, and state the
fuzz did not legitimately touch is intact afterwards (a bystander session, the proxy's readiness)."""

from __future__ import annotations

import math
import random

import httpx
import pytest
from proxy_harness import ADMIN, ADMIN_KEY, answer_but_the_id, bearer, chat_body, running_proxy
from rolloutfleet_wire.errors import ErrorCode

REQUESTS = 1500
SEED = 20261122

STRANGE_IDS = [
    "",
    "0",
    "false",
    "-leading-dash",
    "a" * 65,
    "..%2F..%2Fetc",
    "ok-session-id",
    "null",
    "%00",
    "é" * 9,
]
STRANGE_SCALARS = [
    None,
    True,
    False,
    0,
    -1,
    1e308,
    -1e308,
    2**64,
    -(2**63),
    1.5,
    "",
    "user",
    "x" * 5000,
    "\u0000",
    "\ud7ff",
    [],
    {},
    ["user"],
    {"role": "user"},
]


DEEP_RAW = b'{"messages": [{"role": "user", "content": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"


def deep(depth: int, leaf=1):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def deep_object(depth: int, leaf=1) -> dict:
    """A JSON object `depth` containers deep: where a route takes an object, it gets this far."""
    return {"k": deep(depth - 1, leaf)}


def random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.05:
        return rng.choice([deep, deep_object])(rng.choice([64, 65, 200, 300]))
    if depth > 3 or roll < 0.5:
        return rng.choice(STRANGE_SCALARS)
    if roll < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


KEYS = [
    "session_id",
    "metadata",
    "messages",
    "role",
    "content",
    "name",
    "tool_calls",
    "tools",
    "tool_call_id",
    "function",
    "arguments",
    "reward",
    "turn",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "logprobs",
    "model_version",
    "session_ids",
    "max_trajectories",
    "chat_template_kwargs",
    "stop",
    "seed",
    "n",
    "regenerate",
    "samples",
    "drop_replaced",
    # the Messages and Responses dialects
    "system",
    "type",
    "tool_choice",
    "stop_sequences",
    "thinking",
    "tool_use_id",
    "input",
    "source",
    "instructions",
    "previous_response_id",
    "max_output_tokens",
    "call_id",
    "output",
    "text",
    "parallel_tool_calls",
]


def random_message(rng: random.Random) -> dict:
    message = {
        "role": rng.choice(["user", "assistant", "tool", "system", ["user"], 3, None]),
        "content": "hi",
    }
    for _ in range(rng.randint(0, 3)):
        message[rng.choice(KEYS)] = random_value(rng)
    return message


def random_body(rng: random.Random):
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(
            [b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe", b"1e999", b"NaN", b'{"a":' * 300, DEEP_RAW]
        )
    if roll < 0.5:
        body = chat_body([random_message(rng) for _ in range(rng.randint(1, 3))])
        for _ in range(rng.randint(0, 3)):
            body[rng.choice(KEYS)] = random_value(rng)
        return body
    return {rng.choice(KEYS): random_value(rng) for _ in range(rng.randint(0, 5))}


def route_templates(app) -> list[tuple[str, str]]:
    found = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or []):
            if method != "HEAD":
                found.append((method, route.path))
    return found


@pytest.fixture(scope="module")
def proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path_factory):
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path_factory.mktemp("dumps")) as proxy:
        yield proxy


def test_no_input_to_any_route_gets_a_5xx_and_bystanders_are_intact(proxy):
    rng = random.Random(SEED)
    routes = route_templates(proxy.runtime and _app_of(proxy))
    assert len(routes) >= 15, routes
    bystander, bystander_key = proxy.create_session()
    bystander_auth = {"Authorization": f"Bearer {bystander_key}"}
    first = httpx.post(
        f"{proxy.url}/v1/sessions/{bystander}/chat/completions",
        headers=bystander_auth,
        json=chat_body([{"role": "user", "content": "bystander"}]),
    )
    assert first.status_code == 200
    before = httpx.get(
        f"{proxy.url}/v1/sessions/{bystander}", params={"tokens": "true"}, headers=bystander_auth
    )
    target, target_key = proxy.create_session()
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for i in range(REQUESTS):
            method, template = rng.choice(routes)
            path = template
            for name in ("session_id", "batch_id"):
                value = (
                    rng.choice([target, rng.choice(STRANGE_IDS)])
                    if name == "session_id"
                    else rng.choice(STRANGE_IDS)
                )
                path = path.replace("{" + name + "}", value)
            if rng.random() < 0.15:
                path += "/"
            headers = rng.choice(
                [ADMIN, {"Authorization": f"Bearer {target_key}"}, {}, {"Authorization": "Bearer wrong"}]
            )
            if rng.random() < 0.2:  # the same few keys again and again: replays, reuse with other bodies
                headers = {**headers, "Idempotency-Key": rng.choice(["k1", "k2", "", "x" * 300])}
            body = random_body(rng)
            content = body if isinstance(body, bytes) else httpx._content.json_dumps(body).encode()
            params = rng.choice([{}, {"tokens": "true"}, {"limit": "-5"}, {"limit": "x"}, {"wait_s": "nan"}])
            response = client.request(
                method,
                path,
                content=content,
                params=params,
                headers={**headers, "content-type": "application/json"},
            )
            if path.startswith("/v1/generation/pause") and response.status_code == 200:
                # A legitimate pause holds every turn at the gate (by design); the trainer resumes.
                assert client.post("/v1/generation/resume", headers=ADMIN).status_code == 200
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500 or response.headers.get("retry-after"), (
                i,
                method,
                path,
                content[:300],
                response.status_code,
                response.text[:500],
            )
            if response.status_code >= 400 and method != "HEAD":
                error = response.json()["error"]  # always a JSON error that names what is wrong
                assert error["code"] and error["message"], (path, response.text)
    assert statuses.get(200, 0) + statuses.get(201, 0) > 0 and statuses.get(400, 0) > 100, statuses
    after = httpx.get(
        f"{proxy.url}/v1/sessions/{bystander}", params={"tokens": "true"}, headers=bystander_auth
    )
    assert after.json() | {"busy": False} == before.json() | {"busy": False}
    assert httpx.get(f"{proxy.url}/readyz").status_code == 200
    again = httpx.post(
        f"{proxy.url}/v1/sessions/{bystander}/chat/completions",
        headers=bystander_auth,
        json=chat_body(
            [
                {"role": "user", "content": "bystander"},
                first.json()["choices"][0]["message"],
                {"role": "user", "content": "still fine"},
            ]
        ),
    )
    assert again.status_code == 200, again.text
    assert all(math.isfinite(v) for v in [proxy.stats()["rss_bytes"]])


def _app_of(proxy):
    """The FastAPI app the harness serves (its routes are what the fuzz walks)."""
    from rolloutfleet_proxy.app import create_app

    return create_app(proxy.runtime.settings, proxy.runtime)


def test_the_issue_cases_get_specific_4xx(proxy):
    sid, key = proxy.create_session()
    auth = {"Authorization": f"Bearer {key}"}
    chat = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
    cases = [
        ("post", chat, auth, chat_body([{"role": ["user"], "content": "x"}]), 400),
        ("post", chat, auth, chat_body([{"role": "user", "content": "x", "name": deep(300, "n")}]), 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"metadata": deep(300)}, 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"metadata": deep_object(300)}, 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"session_id": ""}, 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"session_id": 0}, 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"session_id": False}, 400),
        ("post", f"{proxy.url}/v1/sessions", ADMIN, {"session_id": "-starts-with-dash"}, 400),
        ("post", f"{proxy.url}/v1/sessions/{sid}/reward", auth, {"reward": 1e308}, 400),
        ("post", f"{proxy.url}/v1/sessions/", ADMIN, {}, 404),
        ("get", f"{proxy.url}/stats/", {}, None, 404),
    ]
    for method, url, headers, body, status in cases:
        response = httpx.request(method, url, headers=headers, json=body)
        assert response.status_code == status, (
            url,
            body if not isinstance(body, dict) else list(body),
            response.text,
        )
        assert response.json()["error"]["code"], response.text
    assert httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=auth).json()["num_turns"] == 0
    assert ADMIN_KEY  # the admin routes above ran with the real admin key


def test_metadata_nested_too_deep_is_a_400_and_creates_nothing(proxy):
    """300 levels are past orjson's recursion limit (255), 65 just past the proxy's own (64)."""
    before = proxy.stats()
    for depth in (300, 65):
        response = httpx.post(
            f"{proxy.url}/v1/sessions", headers=ADMIN, json={"metadata": deep_object(depth)}
        )
        assert response.status_code == 400, (depth, response.text[:300])
        error = response.json()["error"]
        assert error["code"] == ErrorCode.INVALID_METADATA and "64 levels" in error["message"], error
    after = proxy.stats()
    assert after["live_sessions"] == before["live_sessions"]
    assert after["totals"]["sessions_created"] == before["totals"]["sessions_created"]
    assert after["admission"]["enqueued"] == before["admission"]["enqueued"]
    sid, key = proxy.create_session(metadata=deep_object(64))  # the deepest accepted
    assert proxy.get(sid, key, tokens=False).json()["metadata"] == deep_object(64)


def test_objects_nested_past_the_serializer_limit_never_get_a_5xx(proxy):
    """Every route that takes a JSON object, with an object 300 levels deep wherever it takes one (and
    where it takes none): a 4xx that says what is wrong, or the field is ignored; never a 5xx. Each
    session call goes to a new session, so that no earlier case (a finish, a turn) decides the answer."""
    nested = deep_object(300)
    user = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested}}
    tool_round = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    admin_cases = [
        ("post", "/v1/sessions", {"metadata": nested}),
        ("post", "/v1/sessions", {"session_id": nested}),
        ("post", "/v1/exports", {"session_ids": [nested]}),
        ("post", "/v1/exports", {"max_trajectories": nested}),
        ("put", "/v1/generation/model_version", {"model_version": nested}),
    ]
    session_cases = [
        ("reward", {"reward": nested}),
        ("reward", {"reward": 1, "turn": nested}),
        ("finish", nested),
        ("chat/completions", chat_body([{**user[0], "metadata": nested}], metadata=nested)),
        ("chat/completions", chat_body(user, chat_template_kwargs=nested)),
        ("chat/completions", chat_body(user, stream_options=nested, stream=True)),
        (
            "chat/completions",
            chat_body(user, tools=[{**tool, "function": {"name": "f", "parameters": nested}}]),
        ),
        ("chat/completions", chat_body(user, tools=[tool], tool_choice=nested)),
        ("chat/completions", chat_body(tool_round)),
        # The Messages and Responses dialects: what they echo, map or pass on.
        ("v1/messages", {"max_tokens": 4, "messages": user, "metadata": nested, "system": nested}),
        ("v1/messages", {"max_tokens": 4, "messages": user, "thinking": nested, "tool_choice": nested}),
        (
            "v1/messages",
            {
                "max_tokens": 4,
                "messages": [
                    *user,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": nested}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": nested}],
                    },
                ],
            },
        ),
        ("responses", {"input": "x", "metadata": nested, "parallel_tool_calls": nested, "text": nested}),
        ("responses", {"input": "x", "tool_choice": nested, "previous_response_id": nested}),
        (
            "responses",
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": nested}]},
        ),
        ("responses", {"input": [{"type": "reasoning", "summary": nested, "content": nested}, *user]}),
    ]
    answers = [
        httpx.request(method, f"{proxy.url}{path}", headers=ADMIN, json=body)
        for method, path, body in admin_cases
    ]
    for route, body in session_cases:
        sid, key = proxy.create_session()
        answers.append(
            httpx.post(
                f"{proxy.url}/v1/sessions/{sid}/{route}",
                headers={"Authorization": f"Bearer {key}"},
                json=body,
                timeout=30,
            )
        )
    for answer in answers:
        assert answer.status_code < 500, (answer.url, answer.text[:300])
        if answer.status_code >= 400:
            assert answer.json()["error"]["code"] in set(ErrorCode), (answer.url, answer.text[:300])


def test_every_session_route_answers_a_key_that_does_not_open_the_session_as_an_unknown_id(proxy):
    """No key learns whether an id exists: a made-up key, and another session's real key, get from
    every route with {session_id} exactly what they get for an id never created (and no key at all
    gets the same 401 for both). A capability route's credential is the secret in its path: a
    made-up one gets the 404 of an unknown id whatever the header, none included. None of those
    calls changes the session."""
    routes = [(m, path) for m, path in route_templates(_app_of(proxy)) if "{session_id}" in path]
    assert len(routes) >= 5, routes  # read, delete, turn, reward, finish
    sid, key = proxy.create_session()
    _, other_key = proxy.create_session()
    unknown = "never-created-1"
    body = {**chat_body([{"role": "user", "content": "x"}]), "reward": 1.0}
    for method, template in routes:
        for headers in (bearer("rfs-made-up"), bearer(other_key), {}):
            to_session, to_unknown = (
                httpx.request(
                    method,
                    proxy.url
                    + template.replace("{session_id}", target).replace("{capability}", "rfs-made-up"),
                    headers=headers,
                    json=body,
                )
                for target in (sid, unknown)
            )
            assert answer_but_the_id(to_session, sid) == answer_but_the_id(to_unknown, unknown), (
                method,
                template,
                headers,
                to_session.text,
                to_unknown.text,
            )
            no_credential = not headers and "{capability}" not in template
            expected = (401, ErrorCode.UNAUTHORIZED) if no_credential else (404, ErrorCode.NOT_FOUND)
            assert (to_session.status_code, to_session.json()["error"]["code"]) == expected
    own = proxy.get(sid, key).json()
    assert (own["num_turns"], own["finished"], own["reward"]) == (0, False, None)
