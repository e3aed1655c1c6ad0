"""`rolloutfleet-proxy`: run the proxy under uvicorn with a drain-then-exit SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Generator

import uvicorn
from pydantic import ValidationError

from .app import create_app
from .heap import limit_malloc_arenas
from .logs import configure_logging
from .runtime import ProxyRuntime
from .settings import load_settings

log = logging.getLogger("rolloutfleet.proxy")
MALLOC_ARENAS = 2  # the event loop's and one shared by worker threads


class DrainingServer(uvicorn.Server):
    """uvicorn stops listening at once on SIGTERM; we first drain and dump, then let it stop.

    While draining the socket stays open so in-flight turns deliver their replies and late calls get
    a clear 503 instead of a refused connection. A second SIGINT forces an immediate exit.
    """

    def __init__(self, config: uvicorn.Config, runtime: ProxyRuntime):
        super().__init__(config)
        self.runtime = runtime
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Unlike uvicorn's own, this does not re-raise the signal afterwards: a clean drain exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.runtime.lifecycle.draining and sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True
            return
        if self._loop is None:  # before serving began nothing was restored: nothing to lose
            self.should_exit = True
            return
        # Also during start-up: the drain waits for the restore to finish, then writes it back.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        task = self.runtime.request_drain()
        task.add_done_callback(self._after_drain)

    def _after_drain(self, _task: asyncio.Task) -> None:
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        print(f"rolloutfleet-proxy: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if settings.trim_heap:
        limit_malloc_arenas(MALLOC_ARENAS)
    runtime = ProxyRuntime(settings)
    app = create_app(settings, runtime)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=5,
        backlog=4096,
        proxy_headers=False,  # behind a Kubernetes Service; the header rewrite costs every request
    )
    server = DrainingServer(config, runtime)
    server.run()
    if runtime.lifecycle.lost_sessions:
        log.critical("exiting with sessions that could not be written")
        return 1
    if not server.started:
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
