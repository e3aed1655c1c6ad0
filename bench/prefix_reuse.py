"""Prefix-cache reuse of multi-turn sessions behind the real sglang-router, by routing policy.

Each turn of a session re-sends the whole history; an engine that served the session's previous turn
holds that history in its prefix (radix) cache and reports it as `meta_info.cached_tokens`. The
proxy sends the session id as `X-SMG-Routing-Key`, which the router's `manual` policy routes by, so a
session's turns stay on one engine. `cache_aware` routes on the prompt text and `round_robin` ignores
it; both are measured beside it.

Setup per policy (fresh processes, so every cache starts empty): E SGLang emulators (a test
stand-in for GPU engines, with SGLang's radix-cache accounting and a finite cache) behind the real
router, one proxy process in front. S sessions of T turns, C at a time, each turn a new user message
and a short greedy reply. Measured: Σ cached_tokens / Σ reusable history tokens over turns 2..T,
where a turn's reusable history is everything the session held before the turn (its first new
token's offset). First turns run first, so their (template-prefix) hits are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    IMAGES,
    ChatSessions,
    progress,
    proxy_process,
    save_figure,
    save_result,
    sglang_emulators,
    sglang_router,
)


async def engine_totals(client: httpx.AsyncClient, engines: list[str]) -> dict[str, int]:
    totals = {"prompt_tokens": 0, "cached_tokens": 0}
    for url in engines:
        stats = (await client.get(f"{url}/emulator_stats")).json()
        for name in totals:
            totals[name] += int(stats[name])
    return totals


async def run_sessions(
    proxy_url: str, engines: list[str], sessions: int, turns: int, concurrency: int, max_tokens: int
) -> dict:
    async with ChatSessions(proxy_url, sessions, concurrency, max_tokens, temperature=0.0) as chats:
        started = time.monotonic()
        await chats.run_turns(1)
        before = await engine_totals(chats.client, engines)
        progress(f"first turns done in {time.monotonic() - started:.1f}s; turns 2..{turns} now")
        await chats.run_turns(turns - 1)
        after = await engine_totals(chats.client, engines)
        elapsed = time.monotonic() - started
        reusable = 0
        for trajectory in await chats.trajectories():
            assert len(trajectory["turns"]) == turns, "a turn went missing"
            reusable += sum(bounds[0] for bounds in trajectory["turns"][1:])
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {
        "reusable_history_tokens": reusable,
        "cached_tokens": cached,
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "reuse": cached / reusable if reusable else float("nan"),
        "seconds": round(elapsed, 1),
    }


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    values = [results[n]["reuse"] for n in names]
    bars = ax.bar(names, values, color=["#2a7", "#79c", "#c96"][: len(names)])
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.02, f"{value:.3f}", ha="center")
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="goal 0.95")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("Σ cached / Σ reusable history tokens")
    ax.set_title("Prefix-cache reuse by router policy")
    ax.legend(loc="lower right")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-capacity-tokens", type=int, default=200_000, help="per engine")
    parser.add_argument("--policies", nargs="+", default=["manual", "cache_aware", "round_robin"])
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        work = Path(tmp)
        for policy in args.policies:
            progress(f"policy {policy}: {args.engines} emulators, the router, one proxy")
            flags = ("--cache-capacity-tokens", str(args.cache_capacity_tokens))
            with (
                sglang_emulators(work, args.engines, *flags) as engines,
                sglang_router(work, engines, policy) as router_url,
                proxy_process(work, router_url) as (proxy_url, _),
            ):
                load = (args.sessions, args.turns, args.concurrency, args.max_tokens)
                results[policy] = asyncio.run(run_sessions(proxy_url, engines, *load))
            progress(f"policy {policy}: reuse {results[policy]['reuse']:.3f} ({results[policy]})")
    save_result(
        "prefix_reuse",
        {
            "parameters": vars(args),
            "goal": {"policy": "manual", "reuse_at_least": 0.95},
            "results": results,
        },
    )
    plot(results, IMAGES / "prefix_reuse.png")


if __name__ == "__main__":
    main()
