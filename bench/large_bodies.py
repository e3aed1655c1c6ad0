"""Large bodies: what one client sending maximum-size turns costs everyone else, and the proxy's RSS.

Bystanders: B sessions in closed loops of short turns against the fixed-latency stand-in, first
alone (baseline), then while one client sends turns whose new message is the largest allowed
(`max_new_message_bytes`, 512 KiB of text by default) back to back. Measured: the bystanders' p50/p99
and errors in both phases, the proxy's loop lag, and its RSS sampled every 5 ms (baseline, peak,
resting after the large turns, heap trimmed). Goals (issue #13): bystanders' p99 within 50 ms of the
baseline with no 5xx; peak RSS <= baseline + 64 MiB + 4 x body size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp
from common import ADMIN, RssSampler, percentile, progress, proxy_process, save_result, upstream_stub

WORDS = ["alpha", "beta", "gamma", "delta", "tool", "output", "line", "value", "=", "42", "\n"]


def big_text(size: int, seed: int) -> str:
    rng = random.Random(seed)
    parts, total = [], 0
    while total < size:
        word = rng.choice(WORDS)
        parts.append(word + " ")
        total += len(word) + 1
    return "".join(parts)[:size]


async def new_session(http: aiohttp.ClientSession, url: str) -> tuple[str, dict]:
    async with http.post(f"{url}/v1/sessions", headers=ADMIN) as response:
        data = await response.json()
    return f"{url}/v1/sessions/{data['session_id']}/chat/completions", {
        "Authorization": f"Bearer {data['session_key']}"
    }


async def bystanders(url: str, count: int, seconds: float) -> tuple[list[float], dict[int, int]]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:

        async def loop() -> None:
            chat_url, auth = await new_session(http, url)
            messages = [{"role": "user", "content": "short task"}]
            while time.monotonic() < deadline and len(messages) < 200:
                started = time.perf_counter()
                body = {"messages": messages, "max_tokens": 8}
                async with http.post(chat_url, json=body, headers=auth) as response:
                    data = await response.json()
                    statuses[response.status] = statuses.get(response.status, 0) + 1
                latencies.append(time.perf_counter() - started)
                if response.status != 200:
                    return
                messages += [data["choices"][0]["message"], {"role": "user", "content": "next"}]

        await asyncio.gather(*(loop() for _ in range(count)))
    return latencies, statuses


def large_bodies(size: int, turns: int) -> list[bytes]:
    """Built before the measured phase: generating and encoding megabytes on the load generator's own
    loop would delay the bystanders' requests and be measured as the proxy's doing."""
    return [
        json.dumps(
            {"messages": [{"role": "user", "content": big_text(size, turn)}], "max_tokens": 8}
        ).encode()
        for turn in range(turns)
    ]


async def large_sender(url: str, bodies: list[bytes]) -> dict[int, int]:
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for body in bodies:
            chat_url, auth = await new_session(http, url)  # a fresh session each: first turn, all new
            headers = {**auth, "content-type": "application/json"}
            async with http.post(chat_url, data=body, headers=headers) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
    return statuses


async def stats(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/stats") as response:
        return await response.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bystanders", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--body-bytes", type=int, default=512 * 1024)
    parser.add_argument("--large-turns", type=int, default=8)
    parser.add_argument("--latency-s", type=float, default=0.1)
    parser.add_argument(
        "--family",
        default="test",
        help="tokenizer: `test` (default) or a model family's real one (qwen3, ...)",
    )
    args = parser.parse_args()
    tokenizer = None
    if args.family != "test":
        from rolloutfleet_testkit.model_families import FAMILIES

        tokenizer = FAMILIES[args.family].build_cached()
    with tempfile.TemporaryDirectory(prefix="rf-bench-large-") as tmp:
        work = Path(tmp)
        with (
            upstream_stub(work, args.latency_s, 8) as (stub, _),
            proxy_process(
                work, stub, "--no-log-requests", "--cleanup-interval-s", "2", tokenizer=tokenizer
            ) as (url, proxy),
        ):
            progress(f"baseline: {args.bystanders} bystander loops for {args.seconds} s")
            base_latencies, base_statuses = asyncio.run(bystanders(url, args.bystanders, args.seconds))
            time.sleep(3)  # a cleanup cycle trims the heap
            rss_baseline = proxy.memory_info().rss
            bodies = large_bodies(args.body_bytes, args.large_turns)
            progress(f"one turn of {args.body_bytes} bytes alone (what one maximum-size body costs)")
            with RssSampler(proxy) as single:
                single_status = asyncio.run(large_sender(url, bodies[:1]))
            single_peak = max(single.samples)
            time.sleep(3)
            progress(f"with one client sending {args.large_turns} turns of {args.body_bytes} bytes")
            with RssSampler(proxy) as sampler:

                async def both():
                    return await asyncio.gather(
                        bystanders(url, args.bystanders, args.seconds),
                        large_sender(url, bodies),
                    )

                (loaded_latencies, loaded_statuses), large_statuses = asyncio.run(both())
            after = asyncio.run(stats(url))
            time.sleep(3)
            rss_resting = proxy.memory_info().rss
    peak = max(sampler.samples)
    # The goal is for one body; the loaded phase also holds every large session it made.
    goal_peak = rss_baseline + 64 * 2**20 + 4 * args.body_bytes
    result = {
        "tokenizer": args.family,
        "bystanders": args.bystanders,
        "seconds_per_phase": args.seconds,
        "upstream_latency_s": args.latency_s,
        "body_bytes": args.body_bytes,
        "large_turns": args.large_turns,
        "large_turn_statuses": large_statuses,
        "baseline": {
            "turns": len(base_latencies),
            "p50_ms": round(1000 * percentile(base_latencies, 50), 1),
            "p99_ms": round(1000 * percentile(base_latencies, 99), 1),
            "statuses": base_statuses,
        },
        "with_large_bodies": {
            "turns": len(loaded_latencies),
            "p50_ms": round(1000 * percentile(loaded_latencies, 50), 1),
            "p99_ms": round(1000 * percentile(loaded_latencies, 99), 1),
            "statuses": loaded_statuses,
        },
        "loop_lag_max_seconds": after["loop_lag_max_seconds"],
        "turns_templated_off_loop": after["totals"]["turns_templated_off_loop"],
        "rss_baseline_bytes": rss_baseline,
        "single_turn_status": single_status,
        "rss_single_turn_peak_bytes": single_peak,
        "rss_single_turn_added_bytes": single_peak - rss_baseline,
        "rss_single_turn_within_goal": single_peak <= goal_peak,
        "rss_peak_bytes": peak,
        "rss_resting_bytes": rss_resting,
        "rss_peak_goal_bytes": goal_peak,
        "rss_peak_within_goal": peak <= goal_peak,
    }
    result["added_p99_ms"] = round(result["with_large_bodies"]["p99_ms"] - result["baseline"]["p99_ms"], 1)
    progress(
        f"bystander p99 {result['baseline']['p99_ms']} -> {result['with_large_bodies']['p99_ms']} ms "
        f"(+{result['added_p99_ms']}), statuses {loaded_statuses}; large turns {large_statuses}; "
        f"RSS {rss_baseline / 2**20:.0f} -> one body's peak {single_peak / 2**20:.0f} (goal "
        f"{goal_peak / 2**20:.0f}), loaded peak {peak / 2**20:.0f} -> "
        f"resting {rss_resting / 2**20:.0f} MiB"
    )
    save_result("large_bodies" + ("" if args.family == "test" else f"-{args.family}"), result)


if __name__ == "__main__":
    main()
