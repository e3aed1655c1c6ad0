"""Starting, waiting for and stopping local servers: subprocesses and in-thread uvicorn servers.

Used by the demo, the tests and the benchmarks; everything binds to loopback addresses only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from rolloutfleet_testkit.waiting import wait_for

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (another process may still take it before use)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` different TCP ports that were free a moment ago. The sockets are held until all are
    chosen: ports picked one after another can repeat (the kernel may hand a just-closed port out
    again), which once gave etcd the same client and peer port."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def wait_http_ok(
    url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None, interval: float = 0.05
) -> httpx.Response:
    """Poll GET url until it answers 2xx; fail early if `proc` exits meanwhile."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            response = httpx.get(url, timeout=min(2.0, max(timeout, 0.1)))
            if response.is_success:
                return response
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 2xx within {timeout}s (last: {last})")
        time.sleep(interval)


@contextlib.contextmanager
def serve_app(
    app, host: str = LOOPBACK, startup_timeout: float = 30.0, port: int = 0, **config
) -> Iterator[str]:
    """Run an ASGI app on a real uvicorn server in a background thread; yields its base URL.
    `port` 0 takes a free one (e.g. a fixed one serves several apps on one port, each on its own
    loopback address, as pods of one fleet listen on one port at their own IPs).

    The socket is bound here before the server starts, so the URL is valid at once and no other
    process can take the port in between. The server runs its own event loop in its thread and
    is shut down (open connections given `timeout_graceful_shutdown` seconds) on exit.
    """
    import uvicorn

    settings = {"log_level": "warning", "timeout_graceful_shutdown": 5, **config}
    server = uvicorn.Server(uvicorn.Config(app, **settings))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"uvicorn server for {app!r} exited during startup")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"uvicorn server for {app!r} did not start in {startup_timeout}s")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=settings["timeout_graceful_shutdown"] + 5)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"uvicorn server on port {port} did not shut down")


class ServerProcess:
    """A child process whose output goes to a log file; stopped with SIGTERM, then SIGKILL.

    Without `log_path` the log is a temporary file, removed when the process is stopped.
    """

    def __init__(
        self, args: Sequence[str], log_path: Path | None = None, env: Mapping[str, str] | None = None
    ):
        self.args = list(args)
        self._temporary_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="proc-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        self.process = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, url: str, timeout: float = 60.0) -> httpx.Response:
        try:
            return wait_http_ok(url, timeout, self.process)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{self.args[0]}: {exc}\n--- {self.log_path} ---\n{self.log_tail()}") from exc

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL if it overstays. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        if self._temporary_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def python_module(module: str, *args: str) -> list[str]:
    """Command line running a module with this interpreter (works without console scripts on PATH)."""
    return [sys.executable, "-m", module, *args]


def proxy_command(*args: str) -> list[str]:
    """Command line running the proxy, from the proxy-only environment when one is configured.

    `./dev` sets ROLLOUTFLEET_PROXY_PYTHON to an environment with just `rolloutfleet[proxy]`, like
    the proxy image; without it (or torch would be importable) the current interpreter is used.
    """
    python = os.environ.get("ROLLOUTFLEET_PROXY_PYTHON") or sys.executable
    return [python, "-m", "rolloutfleet_proxy", *args]


def wait_until_routed(router_url: str, timeout_s: float = 120) -> None:
    """The SGLang router answers /health before it has registered a worker: wait until /generate
    goes through."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}

    def routed() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.post(f"{router_url}/generate", json=body, timeout=10).status_code == 200
        return False

    wait_for(routed, timeout_s, f"the router at {router_url} to route /generate to an engine", 0.3)
