"""Shared plumbing of the benchmarks: real processes on 127.0.0.1, results as JSON, progress lines."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from rolloutfleet_testkit.processes import ServerProcess, free_port, proxy_command, python_module
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
    cache = Path(os.environ.get("ROLLOUTFLEET_CACHE", Path.home() / ".cache" / "rolloutfleet"))
    return build_test_tokenizer(cache / "test-tokenizer")


@contextlib.contextmanager
def upstream_stub(work: Path, latency_s: float, output_tokens: int) -> Iterator[tuple[str, psutil.Process]]:
    """The fixed-latency SGLang stand-in, in its own process."""
    port = free_port()
    args = python_module(
        "rolloutfleet_testkit.upstream_stub",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--latency-s",
        str(latency_s),
        "--output-tokens",
        str(output_tokens),
    )
    with ServerProcess(args, work / f"stub-{port}.log") as stub:
        stub.wait_ready(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}", psutil.Process(stub.pid)


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


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system
