"""Starting proxies (in-process on real uvicorn sockets) in front of real upstreams, for the tests."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from rolloutfleet_proxy.app import create_app
from rolloutfleet_proxy.runtime import ProxyRuntime
from rolloutfleet_proxy.settings import ProxySettings
from rolloutfleet_testkit.processes import ServerProcess, free_port, proxy_command, serve_app

ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class RunningProxy:
    url: str
    runtime: ProxyRuntime
    dump_dir: Path | None

    def create_session(self, **body) -> tuple[str, str]:
        response = httpx.post(f"{self.url}/v1/sessions", headers=ADMIN, json=body)
        assert response.status_code == 201, response.text
        data = response.json()
        return data["session_id"], data["session_key"]

    def get(self, sid: str, key: str, tokens: bool = True) -> httpx.Response:
        return httpx.get(
            f"{self.url}/v1/sessions/{sid}",
            params={"tokens": str(tokens).lower()},
            headers={"Authorization": f"Bearer {key}"},
        )

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats").json()

    def chat_turn(self, sid: str, key: str, messages: list[dict], **params) -> dict:
        """One chat turn that must succeed; its answer's JSON."""
        answer = httpx.post(
            f"{self.url}/v1/sessions/{sid}/chat/completions",
            headers=bearer(key),
            json=chat_body(messages, **params),
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()


@contextlib.contextmanager
def running_proxy(
    upstream_url: str, tokenizer_dir: Path, dump_dir: Path | None, *, wrap_app=None, **overrides
) -> Iterator[RunningProxy]:
    """A proxy with `overrides` of its settings; `wrap_app`: an ASGI wrapper around its app (a test
    that watches what it answers)."""
    settings = ProxySettings(
        upstream_url=upstream_url,
        tokenizer_path=str(tokenizer_dir),
        admin_key=ADMIN_KEY,
        dump_dir=dump_dir,
        allow_dropping_sessions=dump_dir is None,
        **{"log_requests": False, **overrides},
    )
    runtime = ProxyRuntime(settings)
    app = create_app(settings, runtime)
    with serve_app(wrap_app(app) if wrap_app else app) as url:
        yield RunningProxy(url, runtime, dump_dir)


def proxy_process(
    upstream_url: str, tokenizer_dir: Path, dump_dir: Path, log: Path, *args: str
) -> tuple[ServerProcess, str]:
    """The proxy in a process of its own (`python -m rolloutfleet_proxy`, as a pod runs it), with
    `args` added; returned at once, not waited for. Its URL."""
    port = free_port()
    process = ServerProcess(
        proxy_command(
            *("--host", "127.0.0.1", "--port", str(port), "--upstream-url", upstream_url),
            *("--tokenizer-path", str(tokenizer_dir), "--dump-dir", str(dump_dir)),
            *args,
        ),
        log,
        env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY},
    )
    return process, f"http://127.0.0.1:{port}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def answer_but_the_id(response: httpx.Response, session_id: str) -> tuple[int, dict[str, str], object]:
    """What a client sees of an answer, with the session id it asked about blanked out: its status,
    its headers (but the date and the length, which differ between any two answers) and its JSON
    body. Two answers are indistinguishable when these are equal."""
    headers = {k: v for k, v in response.headers.items() if k not in ("date", "content-length")}
    return response.status_code, headers, json.loads(response.text.replace(session_id, "<id>"))


def chat_body(messages: list[dict], **params) -> dict:
    return {"model": "rolloutfleet", "messages": messages, "max_tokens": 16, "temperature": 0.7, **params}


def play_session(
    proxy: RunningProxy,
    turns: int = 1,
    reward: float | None = None,
    turn_rewards: dict[int, float] | None = None,
    finish: bool = True,
) -> tuple[str, str]:
    """Create a session, run `turns` turns against the proxy's upstream, set rewards, finish it."""
    sid, key = proxy.create_session(metadata={"task": "t"})
    auth = {"Authorization": f"Bearer {key}"}
    messages: list[dict] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}"})
        reply = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers=auth,
            json=chat_body(messages),
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        messages.append(reply.json()["choices"][0]["message"])
    for turn, value in (turn_rewards or {}).items():
        assert httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": value, "turn": turn}
        ).is_success
    if reward is not None:
        assert httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": reward}
        ).is_success
    if finish:
        assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", headers=auth).is_success
    return sid, key


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)
