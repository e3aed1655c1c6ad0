"""Generated tokens wasted by weight updates during a rollout.

Setup: E SGLang emulators (a test stand-in for GPU engines that pauses, aborts and loads weights as
SGLang does) behind the real sglang-router (`manual` policy), one proxy process in front. S sessions
of T turns run, C at a time, with long enough replies that generations are in flight when the
trainer updates the weights U times (`TrainerClient.update_weights`: pause the proxies, pause the
engines in `--mode`, load new weights from disk with the new `weight_version`, publish the version,
continue, resume).

In abort mode every running generation comes back with its partial tokens; the proxy keeps them
and continues the turn. Measured from the proxy's counters: tokens discarded (the goal: 0), tokens
kept across an abort (what a proxy that discards aborted generations would have lost, and had
to generate again), turns continued; and from the export: every turn recorded once, the tokens per
model version, turns whose tokens span two versions.

`--driver engines` updates as slime, verl and AReaL do: at the engines only (`/pause_generation`,
`/update_weights_from_disk`, `/continue_generation`), never telling the proxy, which rides through
the aborts on its own. There the time from `/continue_generation` to the first token each engine
generates after it (polled from the emulators' counters every 5 ms) is measured (goal: within 1 s),
and the result is saved as `weight_updates-engines`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import (
    ADMIN,
    ADMIN_KEY,
    ChatSessions,
    progress,
    proxy_process,
    save_result,
    sglang_emulators,
    sglang_router,
    weights_for_version,
)
from rolloutfleet_client.trainer import TrainerClient

FIRST_TOKEN_POLL_S = 0.005
FIRST_TOKEN_TIMEOUT_S = 30.0


def generated_tokens(http: httpx.Client, engine: str) -> int:
    return int(http.get(f"{engine}/emulator_stats").json()["generated_tokens"])


def update_at_the_engines(
    http: httpx.Client, engines: list[str], checkpoint: str, version: int, mode: str
) -> dict:
    """Pause every engine, load the checkpoint with its version, continue: as a framework's trainer
    does, without the proxy. Returns, per engine, seconds from its continue to its first token."""
    for engine in engines:
        http.post(f"{engine}/pause_generation", json={"mode": mode}).raise_for_status()
    for engine in engines:
        body = {"model_path": checkpoint, "weight_version": str(version), "flush_cache": True}
        assert http.post(f"{engine}/update_weights_from_disk", json=body).json()["success"]
    before = {engine: generated_tokens(http, engine) for engine in engines}
    resumed = {}
    for engine in engines:
        http.post(f"{engine}/continue_generation", json={}).raise_for_status()
        resumed[engine] = time.monotonic()
    first_token: dict[str, float | None] = {engine: None for engine in engines}
    deadline = time.monotonic() + FIRST_TOKEN_TIMEOUT_S
    while None in first_token.values() and time.monotonic() < deadline:
        for engine in engines:
            if first_token[engine] is None and generated_tokens(http, engine) > before[engine]:
                first_token[engine] = round(time.monotonic() - resumed[engine], 3)
        time.sleep(FIRST_TOKEN_POLL_S)
    return first_token


def updater(
    proxy_url: str,
    engines: list[str],
    work: Path,
    updates: int,
    interval_s: float,
    mode: str,
    log: list,
    driver: str = "trainer",
) -> threading.Thread:
    # Checkpoints written before the rollout starts: the updates time the fleet, not file writing.
    checkpoints = {version: str(weights_for_version(work, version)) for version in range(1, updates + 1)}

    def run() -> None:
        with (
            TrainerClient(proxy_url, ADMIN_KEY, engine_urls=engines) as trainer,
            httpx.Client(timeout=60) as http,
        ):
            for version in range(1, updates + 1):
                time.sleep(interval_s)
                started = time.monotonic()
                inflight = httpx.get(f"{proxy_url}/stats").json()["inflight_turns"]
                entry: dict = {"version": version, "turns_in_flight": inflight}
                if driver == "engines":
                    entry["first_token_after_resume_s"] = update_at_the_engines(
                        http, engines, checkpoints[version], version, mode
                    )
                else:
                    trainer.update_weights(version, model_path=checkpoints[version], mode=mode)
                entry["seconds"] = round(time.monotonic() - started, 3)
                log.append(entry)
                progress(f"weights updated to version {version} ({mode}, by the {driver}): {entry}")

    thread = threading.Thread(target=run, name="trainer")
    thread.start()
    return thread


async def rollout(proxy_url: str, sessions: int, turns: int, concurrency: int, max_tokens: int) -> list[dict]:
    async with ChatSessions(proxy_url, sessions, concurrency, max_tokens, temperature=0.8) as chats:
        await chats.run_turns(turns)
        return await chats.trajectories()


def run_mode(args: argparse.Namespace, work: Path, mode: str) -> dict:
    flags = ("--token-delay-s", str(args.token_delay_s))
    with (
        sglang_emulators(work, args.engines, *flags) as engines,
        sglang_router(work, engines, "manual") as router_url,
        proxy_process(work, router_url) as (proxy_url, _),
    ):
        updates: list[dict] = []
        trainer = updater(
            proxy_url, engines, work, args.updates, args.update_interval_s, mode, updates, args.driver
        )
        started = time.monotonic()
        trajectories = asyncio.run(
            rollout(proxy_url, args.sessions, args.turns, args.concurrency, args.max_tokens)
        )
        elapsed = time.monotonic() - started
        trainer.join()
        totals = httpx.get(f"{proxy_url}/stats", headers=ADMIN).json()["totals"]
    by_version: collections.Counter[int] = collections.Counter()
    spanning = 0
    for trajectory in trajectories:
        assert len(trajectory["turns"]) == args.turns, "every turn is recorded once"
        for _, output_start, end in trajectory["turns"]:
            versions = trajectory["versions"][output_start:end]
            by_version.update(versions)
            spanning += len(set(versions)) > 1
    generated = sum(by_version.values())
    first_tokens = [s for u in updates for s in (u.get("first_token_after_resume_s") or {}).values()]
    return {
        "mode": mode,
        "driver": args.driver,
        "seconds": round(elapsed, 1),
        "turns": totals["turns"],
        "generated_tokens": generated,
        "generated_tokens_discarded": totals["generated_tokens_discarded"],
        "tokens_a_discarding_proxy_would_lose": totals["generated_tokens_continued"],
        "turns_continued": totals["turns_continued"],
        "turns_spanning_versions": spanning,
        "tokens_by_version": dict(sorted(by_version.items())),
        "updates": updates,
        **(
            {"first_token_after_resume_max_s": max(first_tokens) if None not in first_tokens else None}
            if first_tokens
            else {}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--update-interval-s", type=float, default=1.0)
    parser.add_argument("--token-delay-s", type=float, default=0.01, help="the emulators' time per token")
    parser.add_argument("--modes", nargs="+", default=["abort", "in_place"])
    parser.add_argument(
        "--driver",
        choices=["trainer", "engines"],
        default="trainer",
        help="trainer: TrainerClient.update_weights (pauses the proxies too); engines: at the engines only",
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-updates-") as tmp:
        for mode in args.modes:
            progress(f"mode {mode}: {args.sessions} sessions x {args.turns} turns, {args.updates} updates")
            results.append(run_mode(args, Path(tmp), mode))
            progress(f"mode {mode}: {results[-1]}")
    goal: dict = {"generated_tokens_discarded": 0}
    if args.driver == "engines":
        goal["first_token_after_resume_max_s"] = 1.0
    name = "weight_updates" if args.driver == "trainer" else "weight_updates-engines"
    command = " ".join(["./dev", "bench", "weight_updates", *sys.argv[1:]])
    save_result(name, {"command": command, "parameters": vars(args), "goal": goal, "results": results})


if __name__ == "__main__":
    main()
