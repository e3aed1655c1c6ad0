"""Proxy memory: bytes of RSS per stored token, and resting RSS after session churn.

1. Stored tokens: N sessions x 2 turns of ~1000 output tokens each are recorded and kept; RSS above
   the warmed-up baseline, divided by the tokens held (from /stats), gives bytes per token.
2. Churn (a fresh proxy): N sessions are created, run for 2 turns and deleted; after the cleanup
   cycle has trimmed the heap, resting RSS is compared with the RSS right after start.
RSS is sampled from the proxy's /stats (psutil) every half second and plotted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
from common import ADMIN, IMAGES, progress, proxy_process, save_figure, save_result, upstream_stub

QUESTION = "Please reason about the following task carefully and answer with a long derivation."


class Sampler:
    """Polls /stats in the background: the RSS curve of the run."""

    def __init__(self, http: aiohttp.ClientSession, url: str):
        self.http, self.url, self.samples, self._t0 = http, url, [], time.monotonic()

    async def stats(self) -> dict:
        async with self.http.get(f"{self.url}/stats") as response:
            return await response.json()

    async def run(self, phase: str) -> None:
        while True:
            stats = await self.stats()
            self.samples.append(
                {
                    "t": round(time.monotonic() - self._t0, 2),
                    "phase": phase,
                    "rss_bytes": stats["rss_bytes"],
                    "tokens_held": stats["tokens_held"],
                    "live_sessions": stats["live_sessions"],
                }
            )
            await asyncio.sleep(0.5)


async def run_sessions(
    http: aiohttp.ClientSession,
    url: str,
    count: int,
    concurrency: int,
    output_tokens: int,
    delete: bool,
    label: str,
) -> int:
    """Create `count` sessions, 2 turns each; optionally delete them. Returns turns that failed."""
    failures = 0
    next_index = 0
    done = 0

    async def worker() -> None:
        nonlocal failures, next_index, done
        while next_index < count:
            next_index += 1
            async with http.post(f"{url}/v1/sessions", headers=ADMIN, json={}) as response:
                created = await response.json()
            sid, auth = created["session_id"], {"Authorization": f"Bearer {created['session_key']}"}
            messages = [{"role": "user", "content": QUESTION}]
            for turn in range(2):
                body = {"model": "m", "messages": messages, "max_tokens": output_tokens}
                async with http.post(
                    f"{url}/v1/sessions/{sid}/chat/completions", json=body, headers=auth
                ) as r:
                    answer = await r.json()
                    if r.status != 200:
                        failures += 1
                        break
                messages += [
                    answer["choices"][0]["message"],
                    {"role": "user", "content": f"Next step {turn}."},
                ]
            if delete:
                async with http.delete(f"{url}/v1/sessions/{sid}", headers=auth) as response:
                    assert response.status == 204
            done += 1
            if done % 1000 == 0:
                progress(f"{label}: {done}/{count} sessions")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failures


async def stored_tokens_phase(url: str, sessions: int, concurrency: int, output_tokens: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as http:
        sampler = Sampler(http, url)
        post_start = (await sampler.stats())["rss_bytes"]
        await run_sessions(http, url, 20, 4, output_tokens, delete=True, label="warm-up")
        await asyncio.sleep(2.5)  # a cleanup cycle trims what the warm-up freed
        baseline = (await sampler.stats())["rss_bytes"]
        sampling = asyncio.create_task(sampler.run("stored"))
        failures = await run_sessions(
            http, url, sessions, concurrency, output_tokens, delete=False, label="stored"
        )
        await asyncio.sleep(1.0)
        stats = await sampler.stats()
        sampling.cancel()
    tokens = stats["tokens_held"]
    return {
        "sessions": stats["live_sessions"],
        "failed_turns": failures,
        "tokens_held": tokens,
        "rss_post_start_bytes": post_start,
        "rss_baseline_bytes": baseline,
        "rss_loaded_bytes": stats["rss_bytes"],
        "bytes_per_token": round((stats["rss_bytes"] - baseline) / tokens, 2),
        "payload_bytes_per_token": 9,
        "samples": sampler.samples,
    }


async def churn_phase(url: str, sessions: int, concurrency: int, output_tokens: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as http:
        sampler = Sampler(http, url)
        post_start = (await sampler.stats())["rss_bytes"]
        sampling = asyncio.create_task(sampler.run("churn"))
        failures = await run_sessions(
            http, url, sessions, concurrency, output_tokens, delete=True, label="churn"
        )
        peak = max(s["rss_bytes"] for s in sampler.samples)
        await asyncio.sleep(3.0)  # cleanup cycles (1 s interval) trim the heap after the deletions
        stats = await sampler.stats()
        sampling.cancel()
    return {
        "sessions": sessions,
        "failed_turns": failures,
        "rss_post_start_bytes": post_start,
        "rss_peak_bytes": peak,
        "rss_resting_bytes": stats["rss_bytes"],
        "resting_over_post_start": round(stats["rss_bytes"] / post_start, 3),
        "heap_trims": stats["totals"]["heap_trims"],
        "samples": sampler.samples,
    }


def plot(stored: dict, churn: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    mb = 1 / 2**20
    s = stored["samples"]
    left.plot([x["tokens_held"] / 1e6 for x in s], [x["rss_bytes"] * mb for x in s], label="RSS")
    base = stored["rss_baseline_bytes"]
    left.plot(
        [x["tokens_held"] / 1e6 for x in s],
        [(base + 9 * x["tokens_held"]) * mb for x in s],
        linestyle="--",
        label="baseline + 9 B/token (ids, logprobs, mask)",
    )
    left.set_xlabel("tokens held (millions)")
    left.set_ylabel("RSS (MiB)")
    left.set_title(f"Stored tokens: {stored['bytes_per_token']} B/token above baseline")
    left.legend()
    c = churn["samples"]
    right.plot([x["t"] for x in c], [x["rss_bytes"] * mb for x in c], label="RSS")
    right.axhline(churn["rss_post_start_bytes"] * mb, color="k", linestyle=":", label="post-start")
    right.axhline(1.25 * churn["rss_post_start_bytes"] * mb, color="r", linestyle="--", label="goal 1.25x")
    right.set_xlabel("seconds")
    right.set_ylabel("RSS (MiB)")
    right.set_title(f"Churn of {churn['sessions']} sessions: resting {churn['resting_over_post_start']}x")
    right.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10000)
    parser.add_argument("--output-tokens", type=int, default=1000, help="per turn (2 turns per session)")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    flags = ("--cleanup-interval-s", "1", "--no-log-requests")
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-memory-") as tmp,
        upstream_stub(Path(tmp), 0.0, args.output_tokens) as (stub, _),
    ):
        with proxy_process(Path(tmp), stub, *flags) as (url, _):
            progress(
                f"stored tokens: {args.sessions} sessions x 2 turns x {args.output_tokens} output tokens"
            )
            stored = asyncio.run(
                stored_tokens_phase(url, args.sessions, args.concurrency, args.output_tokens)
            )
        progress(
            f"stored: {stored['tokens_held']} tokens, {stored['bytes_per_token']} B/token above baseline"
        )
        with proxy_process(Path(tmp), stub, *flags) as (url, _):
            progress(f"churn: {args.sessions} sessions created, run and deleted")
            churn = asyncio.run(churn_phase(url, args.sessions, args.concurrency, args.output_tokens))
        progress(f"churn: resting RSS {churn['resting_over_post_start']}x the post-start RSS")
    plot(stored, churn, IMAGES / "memory.png")
    save_result("memory", {"args": vars(args), "stored": stored, "churn": churn})


if __name__ == "__main__":
    main()
