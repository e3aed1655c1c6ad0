"""/stats stand-in: a TEST STAND-IN for the proxy, with only what the memory watchdog looks at.

It runs where a proxy pod would (the test kit image, images/testkit, with TESTKIT_PROGRAM=stats-standin),
accepts the proxy's command line (`--host`, `--port`; every other flag and every environment
variable of the proxy is ignored) and serves:

    GET  /healthz          200
    GET  /readyz           200, or 503 while draining
    GET  /stats            a document shaped like the proxy's (`rss_bytes` and a few more fields),
                           reporting the RSS it was told to; or, by the control route, never
                           answering in time ("hang") or answering 500 ("error")
    POST /standin/control  JSON {"rss_bytes": int | null, "stats": "ok" | "hang" | "error",
                           "threshold_bytes": int | null}, every key optional; rss_bytes null
                           reports the process's real RSS; setting threshold_bytes clears what
                           was recorded against the old one. Answers the state.
    GET  /standin/state    what it reports and what it recorded: `first_over_threshold_at`, the
                           wall time (epoch seconds) of the first /stats answer that reported an
                           RSS above threshold_bytes, and `over_threshold_at`, those of the first
                           ones (up to 100)

On SIGTERM it behaves like a draining proxy: /readyz answers 503 for the drain time (`--drain-s`,
else `$STANDIN_DRAIN_S`, default 1 s), then it exits 0. The initial reported RSS and threshold come
from `$STANDIN_RSS_BYTES` and `$STANDIN_RSS_THRESHOLD_BYTES` (or the flags of the same names).

A bare ASGI app on uvicorn and the standard library: no proxy, torch or transformers imports, so a
process stays around 30 MB and the benchmark runs 64 of them on one small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import time
from collections.abc import Generator
from typing import Any

from .asgi import lifespan, read_body, send_json

STATS_MODES = ("ok", "hang", "error")
# A hung /stats answers after this long at the latest (or as soon as the mode changes), so hung
# requests do not pile up for the stand-in's whole life.
HANG_CAP_S = 120.0
MAX_RECORDED = 100
DEFAULT_DRAIN_S = 1.0


def real_rss_bytes() -> int:
    """This process's resident set size (from /proc; the peak RSS where there is no /proc)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StatsStandin:
    """The ASGI app and its state (`draining` is set by the server on SIGTERM)."""

    def __init__(self, rss_bytes: int | None = None, threshold_bytes: int | None = None) -> None:
        self.rss_bytes = rss_bytes  # None: the real RSS
        self.stats_mode = "ok"
        self.threshold_bytes = threshold_bytes
        self.draining = False
        self.started_at = time.time()
        self.stats_requests = 0
        self.stats_answers = 0
        self.over_threshold_at: list[float] = []
        self._mode_changed = asyncio.Event()

    # --- state ----------------------------------------------------------------------------------

    def reported_rss(self) -> int:
        return real_rss_bytes() if self.rss_bytes is None else self.rss_bytes

    def state(self) -> dict[str, Any]:
        return {
            "standin": True,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "rss_bytes": self.rss_bytes,
            "reported_rss_bytes": self.reported_rss(),
            "stats": self.stats_mode,
            "threshold_bytes": self.threshold_bytes,
            "draining": self.draining,
            "stats_requests": self.stats_requests,
            "stats_answers": self.stats_answers,
            "first_over_threshold_at": self.over_threshold_at[0] if self.over_threshold_at else None,
            "over_threshold_at": list(self.over_threshold_at),
        }

    def control(self, body: object) -> None:
        """Apply a control document (raises ValueError for a bad one)."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        unknown = set(body) - {"rss_bytes", "stats", "threshold_bytes"}
        if unknown:
            raise ValueError(f"unknown keys: {sorted(unknown)}")
        for key in ("rss_bytes", "threshold_bytes"):
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{key} must be a non-negative integer or null")
        if "stats" in body and body["stats"] not in STATS_MODES:
            raise ValueError(f"stats must be one of {', '.join(STATS_MODES)}")
        if "rss_bytes" in body:
            self.rss_bytes = body["rss_bytes"]
        if "threshold_bytes" in body:
            self.threshold_bytes = body["threshold_bytes"]
            self.over_threshold_at = []
        if "stats" in body and body["stats"] != self.stats_mode:
            self.stats_mode = body["stats"]
            self._mode_changed.set()  # wakes hung /stats requests
            self._mode_changed = asyncio.Event()

    def stats_document(self) -> dict[str, Any]:
        """The answer of GET /stats, shaped like the proxy's (rolloutfleet_proxy.stats.build_stats)."""
        rss = self.reported_rss()
        now = time.time()
        over = self.threshold_bytes is not None and rss > self.threshold_bytes
        if over and len(self.over_threshold_at) < MAX_RECORDED:
            self.over_threshold_at.append(now)
        self.stats_answers += 1
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(now - self.started_at, 3),
            "rss_bytes": rss,
            "real_rss_bytes": real_rss_bytes(),
            "live_sessions": 0,
            "sessions_being_written": 0,
            "tokens_held": 0,
            "inflight_turns": 0,
            "draining": self.draining,
            "standin": True,
        }

    # --- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/standin/control":
            if method != "POST":
                await send_json(send, 405, {"error": "use POST"})
                return
            try:
                self.control(json.loads(await read_body(receive) or b"{}"))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                await send_json(send, 400, {"error": str(exc)})
                return
            await send_json(send, 200, self.state())
        elif method != "GET":
            await send_json(send, 405, {"error": "use GET"})
        elif path == "/healthz":
            await send_json(send, 200, {"status": "ok"})
        elif path == "/readyz":
            if self.draining:
                await send_json(send, 503, {"status": "draining"})
            else:
                await send_json(send, 200, {"status": "ready"})
        elif path == "/stats":
            await self._stats(send)
        elif path == "/standin/state":
            await send_json(send, 200, self.state())
        else:
            await send_json(send, 404, {"error": f"no route {path}"})

    async def _stats(self, send) -> None:
        self.stats_requests += 1
        if self.stats_mode == "hang":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HANG_CAP_S):
                    while self.stats_mode == "hang":
                        await self._mode_changed.wait()
        if self.stats_mode == "error":
            await send_json(send, 500, {"error": "stand-in told to fail /stats"})
            return
        await send_json(send, 200, self.stats_document())


async def serve(app: StatsStandin, host: str, port: int, drain_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain for `drain_s` (/readyz 503) and return."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield  # the signals are ours (below); uvicorn's would re-raise SIGTERM at exit

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=1,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()

    async def drain() -> None:
        await asyncio.sleep(drain_s)
        server.should_exit = True

    drains: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if drains:  # already draining: a second SIGINT stops at once
            if sig == signal.SIGINT:
                server.should_exit = server.force_exit = True
            return
        print(f"stats stand-in: {sig.name}, draining for {drain_s:g}s", flush=True)
        app.draining = True
        drains.append(asyncio.create_task(drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.serve()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rolloutfleet-stats-standin",
        description="Test stand-in for the proxy's /stats, /healthz and /readyz (memory watchdog tests).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--drain-s", type=float, default=None, help="default $STANDIN_DRAIN_S, else 1")
    parser.add_argument("--rss-bytes", type=int, default=None, help="default $STANDIN_RSS_BYTES, else real")
    parser.add_argument(
        "--threshold-bytes", type=int, default=None, help="default $STANDIN_RSS_THRESHOLD_BYTES"
    )
    args, _ignored = parser.parse_known_args(argv)  # the proxy's other flags
    drain_s = args.drain_s
    if drain_s is None:
        drain_s = float(os.environ.get("STANDIN_DRAIN_S") or DEFAULT_DRAIN_S)
    rss = args.rss_bytes if args.rss_bytes is not None else _env_int("STANDIN_RSS_BYTES")
    threshold = args.threshold_bytes
    if threshold is None:
        threshold = _env_int("STANDIN_RSS_THRESHOLD_BYTES")
    app = StatsStandin(rss, threshold)
    asyncio.run(serve(app, args.host, args.port, drain_s))
    print("stats stand-in: drained, exiting", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
