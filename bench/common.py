"""Shared plumbing of the benchmarks: real processes on 127.0.0.1, results as JSON, progress lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
from rolloutfleet_testkit.cache import project_cache
from rolloutfleet_testkit.processes import (
    ServerProcess,
    free_port,
    proxy_command,
    python_module,
    wait_until_routed,
)
from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
IMAGES = ROOT / "docs" / "img"
ADMIN_KEY = "bench-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
_started = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _started:7.1f}s] {message}", flush=True)


def tokenizer_dir() -> Path:
    cache = project_cache()
    return build_test_tokenizer(cache / "test-tokenizer")


@contextlib.contextmanager
def upstream_stub(
    work: Path, latency_s: float, output_tokens: int, host: str = "127.0.0.1", routing: str | None = None
) -> Iterator[tuple[str, psutil.Process]]:
    """The fixed-latency SGLang stand-in, in its own process, on `host` (the node's bridge address
    when pods must reach it); `routing` ("LAYERSxTOP_KxEXPERTS"): it answers routed experts."""
    port = free_port(host)
    args = python_module(
        "rolloutfleet_testkit.upstream_stub",
        "--host",
        host,
        "--port",
        str(port),
        "--latency-s",
        str(latency_s),
        "--output-tokens",
        str(output_tokens),
        *(["--routed-experts", routing] if routing else []),
    )
    with ServerProcess(args, work / f"stub-{port}.log") as stub:
        stub.wait_ready(f"http://{host}:{port}/health", 60)
        yield f"http://{host}:{port}", psutil.Process(stub.pid)


def proxy_args(
    work: Path, port: int, upstream_url: str, *flags: str, tokenizer: Path | None = None
) -> list[str]:
    """The command line of a benchmarked proxy on 127.0.0.1:`port`, with its own dump directory
    (and the test tokenizer unless `tokenizer` names another directory)."""
    return proxy_command(
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--upstream-url",
        upstream_url,
        "--tokenizer-path",
        str(tokenizer or tokenizer_dir()),
        "--dump-dir",
        str(work / f"dumps-{port}"),
        *flags,
    )


@contextlib.contextmanager
def proxy_process(
    work: Path, upstream_url: str, *flags: str, tokenizer: Path | None = None
) -> Iterator[tuple[str, psutil.Process]]:
    """The proxy as it runs in its image: its own process, proxy-only environment when available."""
    port = free_port()
    args = proxy_args(work, port, upstream_url, *flags, tokenizer=tokenizer)
    with ServerProcess(
        args, work / f"proxy-{port}.log", env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY}
    ) as proxy:
        proxy.wait_ready(f"http://127.0.0.1:{port}/readyz", 120)
        yield f"http://127.0.0.1:{port}", psutil.Process(proxy.pid)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[index]


def save_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {
        "benchmark": name,
        "command": " ".join(["./dev", "bench", name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total},
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **data,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    progress(f"results written to {path.relative_to(ROOT)}")
    return path


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    progress(f"plot written to {path}")


class RssSampler:
    """A process's RSS every 5 ms in a thread, while the block runs."""

    def __init__(self, process: psutil.Process):
        self.process = process
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# The SGLang emulator (a test stand-in for GPU engines) and the real sglang-router in front of it.
EMULATOR_MODULE = "rolloutfleet_testkit.sglang_emulator.server"


@contextlib.contextmanager
def sglang_emulators(
    work: Path, count: int, *flags: str, tokenizer: Path | None = None
) -> Iterator[list[str]]:
    """`count` SGLang emulator processes on 127.0.0.1 (one model, seed 0), each with `flags`, for the
    test tokenizer or the model directory `tokenizer`."""
    started: list[tuple[str, ServerProcess]] = []
    try:
        for _ in range(count):
            port = free_port()
            args = python_module(
                EMULATOR_MODULE,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--tokenizer-path",
                str(tokenizer or tokenizer_dir()),
                "--log-level",
                "warning",
                *flags,
            )
            started.append((f"http://127.0.0.1:{port}", ServerProcess(args, work / f"engine-{port}.log")))
        for url, process in started:
            process.wait_ready(f"{url}/get_model_info", 180)
        yield [url for url, _ in started]
    finally:
        for _, process in started:
            process.terminate()


@contextlib.contextmanager
def sglang_router(work: Path, worker_urls: list[str], policy: str) -> Iterator[str]:
    """The real sglang-router (PyPI `sglang-router`) over `worker_urls` with `policy`."""
    port, metrics_port = free_port(), free_port()
    args = python_module(
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    )
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(args, work / f"router-{port}.log") as router:
        router.wait_ready(f"{url}/health", 60)
        wait_until_routed(url)
        yield url


class ChatSessions:
    """S proxy sessions played by one asyncio client, C turns at a time: each turn adds a new user
    message (seeded per session) to the full history, as a rollout worker does."""

    WORDS = (
        "river", "stone", "cloud", "lamp", "orbit", "maple",
        "quartz", "harbor", "violet", "ember", "signal", "canyon",
    )  # fmt: skip

    def __init__(self, proxy_url: str, sessions: int, concurrency: int, max_tokens: int, temperature: float):
        self.proxy_url = proxy_url
        self.count = sessions
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._gate = asyncio.Semaphore(concurrency)
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: otherwise a turn sent
        # on a connection the server is closing fails with ReadError (seen when turns slow down).
        limits = httpx.Limits(max_connections=concurrency + 8, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(timeout=600, limits=limits)
        self.sessions: list[dict] = []
        self.turns_done = 0

    async def __aenter__(self) -> ChatSessions:
        for index in range(self.count):
            created = (await self.client.post(f"{self.proxy_url}/v1/sessions", headers=ADMIN, json={})).json()
            self.sessions.append(
                {
                    "id": created["session_id"],
                    "key": created["session_key"],
                    "messages": [],
                    "rng": random.Random(index),
                }
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    def _auth(self, session: dict) -> dict[str, str]:
        return {"Authorization": f"Bearer {session['key']}"}

    async def turn(self, index: int) -> None:
        session = self.sessions[index]
        rng = session["rng"]
        topic = " ".join(rng.choice(self.WORDS) for _ in range(rng.randint(6, 14)))
        step = len(session["messages"]) // 2
        session["messages"].append(
            {"role": "user", "content": f"Session {index}, step {step}: go on about {topic}."}
        )
        async with self._gate:
            response = await self.client.post(
                f"{self.proxy_url}/v1/sessions/{session['id']}/chat/completions",
                headers=self._auth(session),
                json={
                    "messages": session["messages"],
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                },
            )
        response.raise_for_status()
        session["messages"].append(
            {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
        )
        self.turns_done += 1

    async def run_turns(self, turns: int) -> None:
        """`turns` more turns of every session (sessions concurrently, each one's turns in order)."""

        async def play(index: int) -> None:
            for _ in range(turns):
                await self.turn(index)

        await asyncio.gather(*(play(i) for i in range(self.count)))

    async def trajectories(self) -> list[dict]:
        out = []
        for session in self.sessions:
            response = await self.client.get(
                f"{self.proxy_url}/v1/sessions/{session['id']}",
                params={"tokens": "true"},
                headers=self._auth(session),
            )
            out.append(response.json()["trajectory"])
        return out

    async def finish_all(self) -> None:
        for session in self.sessions:
            url = f"{self.proxy_url}/v1/sessions/{session['id']}/finish"
            (await self.client.post(url, headers=self._auth(session))).raise_for_status()


def weights_for_version(work: Path, version: int) -> Path:
    """A checkpoint the SGLang emulator loads with /update_weights_from_disk: version v's weights."""
    from rolloutfleet_testkit.sglang_emulator.server import write_weights

    return write_weights(work / f"weights-v{version}", seed=1000 + version)
