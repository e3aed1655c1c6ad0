"""SGLang emulators (test stand-ins for GPU engines) behind the real sglang-router, in-process, for
tests that involve routing: the router is the PyPI `sglang-router`, run as its own process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from .processes import ServerProcess, free_ports, python_module, serve_app, wait_until_routed


@contextlib.contextmanager
def routed_emulators(
    tokenizer_dir: str | Path, log_dir: Path, count: int = 2, policy: str = "manual", **emulator: object
) -> Iterator[tuple[str, list[str]]]:
    """(router URL, engine URLs): `count` emulators (weights of seed 0, `emulator` options such as
    token_delay_s) behind the router with `policy`."""
    from .sglang_emulator.server import create_app

    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(serve_app(create_app(str(tokenizer_dir), seed=0, **emulator)))  # type: ignore[arg-type]
            for _ in range(count)
        ]
        yield stack.enter_context(router_before(engines, log_dir, policy)), engines


@contextlib.contextmanager
def router_before(workers: list[str], log_dir: Path, policy: str = "manual") -> Iterator[str]:
    """The router's URL, with `workers` (SGLang servers or stand-ins that answer its info routes)
    behind it."""
    port, metrics = free_ports(2)
    args = python_module(
        "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers, "--policy", policy, "--log-level", "warn",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
    )  # fmt: skip
    with ServerProcess(args, log_dir / f"router-{port}.log") as router:
        url = f"http://127.0.0.1:{port}"
        router.wait_ready(f"{url}/health", 60)
        wait_until_routed(url)
        yield url
