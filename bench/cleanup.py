"""Event-loop stall while the proxy's stale-session cleanup dumps thousands of sessions.

N sessions are recorded (2 turns each), then left idle. The proxy runs with a 1 s stale timeout
and a cleanup interval long enough that one cycle finds all N stale at once. During that cycle
this script polls /stats: the proxy's own loop-lag monitor (a 20 ms sleep, how late it wakes) and
the round-trip time of the /stats probe itself. Dumps are real files on disk, fsynced.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
from common import IMAGES, progress, proxy_process, save_figure, save_result, upstream_stub
from memory import run_sessions


async def measure(url: str, sessions: int, concurrency: int, output_tokens: int, interval_s: float) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as http:

        async def stats() -> dict:
            async with http.get(f"{url}/stats") as response:
                return await response.json()

        started = time.monotonic()
        failures = await run_sessions(
            http, url, sessions, concurrency, output_tokens, delete=False, label="load"
        )
        loaded = await stats()
        load_seconds = time.monotonic() - started
        if load_seconds > interval_s - 15:
            raise SystemExit(
                f"loading took {load_seconds:.0f}s: raise --interval-s so one cycle sees all sessions"
            )
        progress(
            f"{loaded['live_sessions']} sessions, {loaded['tokens_held']} tokens held; waiting for the cycle"
        )
        samples = []
        while True:
            t0 = time.perf_counter()
            current = await stats()
            rtt = time.perf_counter() - t0
            samples.append(
                {
                    "t": round(time.monotonic() - started, 3),
                    "probe_rtt_s": round(rtt, 5),
                    "loop_lag_recent_max_s": current["loop_lag_recent_max_seconds"],
                    "dumped": current["totals"]["sessions_dumped"],
                    "being_written": current["sessions_being_written"],
                }
            )
            if current["totals"]["sessions_dumped"] >= loaded["live_sessions"]:
                break
            if time.monotonic() - started > interval_s * 3 + 300:
                raise SystemExit("cleanup did not finish")
            await asyncio.sleep(0.1)
        final = await stats()
    during = [s for s in samples if s["dumped"] > 0 or s["being_written"] > 0]
    first = during[0]["t"] if during else samples[-1]["t"]
    window = [s for s in samples if s["t"] >= first - 0.2]  # from the cycle's start
    return {
        "sessions": loaded["live_sessions"],
        "failed_turns": failures,
        "tokens_dumped": loaded["tokens_held"],
        "load_seconds": round(load_seconds, 1),
        "cleanup_seconds": final["last_cleanup_seconds"],
        "sessions_dumped": final["totals"]["sessions_dumped"],
        "dump_failures": final["totals"]["dump_failures"],
        "max_loop_lag_ms": round(max(s["loop_lag_recent_max_s"] for s in window) * 1000, 2),
        "max_probe_rtt_ms": round(max(s["probe_rtt_s"] for s in window) * 1000, 2),
        "loop_lag_before_cycle_ms": round(samples[0]["loop_lag_recent_max_s"] * 1000, 2),
        "rss_after_bytes": final["rss_bytes"],
        "rss_loaded_bytes": loaded["rss_bytes"],
        "samples": samples,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(
        [x["t"] for x in s],
        [x["loop_lag_recent_max_s"] * 1000 for x in s],
        label="loop lag, max of last 10 s",
    )
    ax.plot([x["t"] for x in s], [x["probe_rtt_s"] * 1000 for x in s], label="/stats round trip", alpha=0.7)
    ax.axhline(20, color="r", linestyle="--", label="goal 20 ms")
    ax.set_xlabel("seconds since load began")
    ax.set_ylabel("ms")
    twin = ax.twinx()
    twin.plot([x["t"] for x in s], [x["dumped"] for x in s], color="g", label="sessions dumped")
    twin.set_ylabel("sessions dumped")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    ax.set_title(
        f"Cleanup of {result['sessions']} stale sessions: max loop lag {result['max_loop_lag_ms']} ms"
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--output-tokens", type=int, default=1000, help="per turn (2 turns per session)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--interval-s", type=float, default=90.0, help="proxy cleanup interval")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-cleanup-") as tmp,
        upstream_stub(Path(tmp), 0.0, args.output_tokens) as (stub, _),
    ):
        flags = (
            "--cleanup-interval-s",
            str(args.interval_s),
            "--stale-session-timeout-s",
            "1",
            "--no-log-requests",
        )
        with proxy_process(Path(tmp), stub, *flags) as (url, _):
            progress(f"recording {args.sessions} sessions, then one cleanup cycle dumps them all")
            result = asyncio.run(
                measure(url, args.sessions, args.concurrency, args.output_tokens, args.interval_s)
            )
        dumped = list(Path(tmp).glob("dumps-*/stale/*.safetensors"))
        result["dump_files"] = len(dumped)
        result["dump_bytes"] = sum(p.stat().st_size for p in dumped)
    progress(
        f"cleanup dumped {result['sessions_dumped']} sessions in {result['cleanup_seconds']} s; "
        f"max loop lag {result['max_loop_lag_ms']} ms, max probe round trip {result['max_probe_rtt_ms']} ms"
    )
    plot(result, IMAGES / "cleanup.png")
    save_result("cleanup", {"args": vars(args), "result": result})


if __name__ == "__main__":
    main()
