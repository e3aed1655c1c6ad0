"""Example rollout against a fleet: M concurrent multi-turn sessions with rewards, then the finished
trajectories exported and acknowledged with the trainer client.

    export ROLLOUTFLEET_PROXY_ADMIN_KEY=...            # the fleet's admin key (never a flag)
    kubectl get rolloutfleet rollouts -o json > fleet.json
    rolloutfleet-rollout-example --fleet-status fleet.json --sessions 64 --turns 4
    rolloutfleet-rollout-example --endpoints http://127.0.0.1:8001 http://127.0.0.1:8002
    rolloutfleet-rollout-example --client-url http://rollouts-proxy.default.svc:8000

Each session is a toy task ("What is a + b?", then follow-ups), scored per turn (1 when the reply
contains the answer); the session's reward is its last turn's score, and with `--turn-rewards`
every turn's score is set as that turn's reward too. With `--tools` the sessions offer a calculator
tool: a reply that calls it gets the tool's result as the next turn's message (an agentic tool
turn) instead of a follow-up question. A session that cannot be
completed (for example `SessionLost`) is counted as a failure, never replaced. Progress lines go
to stdout; the last line is a JSON summary. Exit code 0 when every session completed.

The export step needs the trainer client (`pip install 'rolloutfleet[trainer]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .calculator import CALCULATOR_TOOL, run_tool_call
from .errors import FleetClientError, ProxyRequestError
from .fleet_client import FleetClient
from .placement import POLICIES

ADMIN_KEY_ENV = "ROLLOUTFLEET_PROXY_ADMIN_KEY"
FOLLOW_UPS = [
    "Check your answer once more.",
    "Are you sure? Answer with the number only.",
    "Explain briefly.",
]


@dataclass
class Outcome:
    """One session of the rollout."""

    index: int
    session_id: str | None = None
    owner: str | None = None
    turns: int = 0
    tool_calls: int = 0
    reward: float | None = None
    error: str | None = None
    latencies: list[float] = field(default_factory=list)
    began: float | None = None  # first turn sent (perf_counter)
    ended: float | None = None  # last turn answered


def task_for(index: int, seed: int) -> tuple[str, int]:
    rng = random.Random(seed * 1_000_003 + index)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"What is {a} + {b}?", a + b


async def run_session(
    fleet: FleetClient,
    index: int,
    turns: int,
    max_tokens: int,
    seed: int,
    counts: Counter[str],
    turn_rewards: bool = False,
    tools: bool = False,
) -> Outcome:
    """Create one session, run `turns` turns, set the session reward (and with `turn_rewards`
    each turn's), finish. With `tools`, tool calls are answered by the calculator."""
    outcome = Outcome(index)
    question, answer = task_for(index, seed)
    try:
        session = await fleet.create_session({"task": "add", "index": index, "seed": seed})
        outcome.session_id, outcome.owner = session.session_id, session.owner
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful calculator."},
            {"role": "user", "content": question},
        ]
        scores: list[float] = []
        offered: dict[str, Any] = {"tools": [CALCULATOR_TOOL]} if tools else {}
        outcome.began = time.perf_counter()
        for turn in range(turns):
            sent = time.perf_counter()
            reply = await fleet.chat(
                session, messages, max_tokens=max_tokens, temperature=0.7, seed=seed + turn, **offered
            )
            outcome.latencies.append(time.perf_counter() - sent)
            outcome.turns += 1
            counts["turns"] += 1
            message = reply["choices"][0]["message"]
            content = message.get("content") or ""
            scores.append(1.0 if str(answer) in content else 0.0)
            messages.append(message)  # exactly as returned
            calls = message.get("tool_calls") or []
            outcome.tool_calls += len(calls)
            if calls:  # the next turn carries the tool results
                for call in calls:
                    result = run_tool_call(call)
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            else:
                messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
        outcome.ended = time.perf_counter()
        if turn_rewards:
            await asyncio.gather(*(fleet.reward(session, v, turn=t) for t, v in enumerate(scores)))
        outcome.reward = scores[-1] if scores else 0.0
        await fleet.reward(session, outcome.reward)
        await fleet.finish(session)
        counts["completed"] += 1
    except FleetClientError as exc:
        outcome.error = str(exc)
        counts["failures"] += 1
    return outcome


async def run_rollouts(
    fleet: FleetClient,
    *,
    sessions: int,
    turns: int,
    concurrency: int,
    max_tokens: int = 16,
    stagger_s: float = 0.0,
    seed: int = 0,
    turn_rewards: bool = False,
    tools: bool = False,
    progress: Callable[[str], None] = print,
    progress_interval_s: float = 2.0,
) -> list[Outcome]:
    """Run `sessions` sessions, at most `concurrency` at a time. The first wave starts at seeded
    random offsets within `stagger_s` (rollouts do not start in lockstep)."""
    counts: Counter[str] = Counter()
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    offsets = [
        rng.uniform(0, stagger_s) if stagger_s > 0 and i < concurrency else 0.0 for i in range(sessions)
    ]
    started = time.perf_counter()

    async def one(index: int) -> Outcome:
        await asyncio.sleep(offsets[index])
        async with gate:
            return await run_session(fleet, index, turns, max_tokens, seed, counts, turn_rewards, tools)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_interval_s)
            elapsed = time.perf_counter() - started
            progress(
                f"[{elapsed:7.1f}s] sessions {counts['completed']}/{sessions} completed, "
                f"{counts['failures']} failed; {counts['turns']} turns ({counts['turns'] / elapsed:.1f}/s); "
                f"live per proxy {fleet.live_sessions}"
            )

    reporter = asyncio.create_task(report())
    try:
        return list(await asyncio.gather(*(one(i) for i in range(sessions))))
    finally:
        reporter.cancel()


def export_and_ack(admin_key: str, outcomes: list[Outcome]) -> dict[str, Any]:
    """Export exactly this rollout's finished sessions from their owners and acknowledge the batches
    (synchronous: run it in a thread). A finished session its owner no longer has (it was replaced
    and could not restore it) is marked lost on its outcome, by name, never exported as nothing."""
    from rolloutfleet_client.trainer import TrainerClient

    by_owner: dict[str, list[str]] = {}
    outcome_of = {o.session_id: o for o in outcomes if o.session_id}
    for o in outcomes:
        if o.error is None and o.session_id and o.owner:
            by_owner.setdefault(o.owner, []).append(o.session_id)

    def export(trainer, owner: str, ids: list[str]) -> list:
        try:
            batch = trainer.export_from(owner, session_ids=ids)
            return [batch] if batch is not None else []
        except ProxyRequestError as error:
            if error.status not in (404, 410):
                raise
        if len(ids) == 1:  # this one is not on its owner any more
            outcome_of[ids[0]].error = f"session {ids[0]} lost: {owner} no longer holds it at export"
            return []
        return [batch for sid in ids for batch in export(trainer, owner, [sid])]

    trajectories = tokens = 0
    rewards: list[float] = []
    if not by_owner:
        return {"trajectories_exported": 0, "tokens_exported": 0, "batches": 0}
    batches = []
    with TrainerClient(list(by_owner), admin_key) as trainer:
        for owner, ids in by_owner.items():
            for start in range(0, len(ids), 10000):
                batches += export(trainer, owner, ids[start : start + 10000])
        for batch in batches:
            for info in batch.trajectories():
                trajectories += 1
                tokens += info["num_tokens"]
                if info["reward"] is not None:
                    rewards.append(info["reward"])
        trainer.ack(batches)
    return {
        "trajectories_exported": trajectories,
        "tokens_exported": tokens,
        "batches": len(batches),
        "mean_exported_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
    }


def _percentile_ms(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))] * 1000, 1)


def summarize(outcomes: list[Outcome], elapsed: float) -> dict[str, Any]:
    """Counts, throughput (wall over the turn phase, and the sum of per-session rates) and latency."""
    turns = sum(o.turns for o in outcomes)
    spans = [(o.began, o.ended, o.turns) for o in outcomes if o.began is not None and o.ended is not None]
    spans = [(b, e, n) for b, e, n in spans if e > b]
    phase = (max(e for _, e, _ in spans) - min(b for b, _, _ in spans)) if spans else 0.0
    latencies = [x for o in outcomes for x in o.latencies]
    failed = [o for o in outcomes if o.error is not None]
    return {
        "sessions": len(outcomes),
        "completed": len(outcomes) - len(failed),
        "turns": turns,
        "tool_calls": sum(o.tool_calls for o in outcomes),
        "failures": len(failed),
        "failed_sessions": [{"session_id": o.session_id, "error": o.error} for o in failed[:20]],
        "elapsed_s": round(elapsed, 3),
        "turn_phase_s": round(phase, 3),
        "turns_per_s": round(turns / phase, 1) if phase else None,
        "loop_turns_per_s": round(sum(n / (e - b) for b, e, n in spans), 1),
        "turn_latency_p50_ms": _percentile_ms(latencies, 50),
        "turn_latency_p99_ms": _percentile_ms(latencies, 99),
        "sessions_per_proxy": dict(sorted(Counter(o.owner for o in outcomes if o.owner).items())),
        "mean_reward": round(sum(o.reward or 0.0 for o in outcomes) / max(1, len(outcomes) - len(failed)), 4),
    }


def _admin_key(args: argparse.Namespace) -> str:
    if args.admin_key_file:
        return Path(args.admin_key_file).read_text().strip()
    key = os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise SystemExit(f"set {ADMIN_KEY_ENV} (or --admin-key-file) to the fleet's admin key")
    return key


def make_fleet(args: argparse.Namespace, admin_key: str) -> FleetClient:
    options = {
        "admin_key": admin_key,
        "placement": args.placement,
        "restart_timeout_s": args.restart_timeout_s,
        "seed": args.seed,
    }
    if args.fleet_status:
        fleet = json.loads(Path(args.fleet_status).read_text())
        return FleetClient.from_fleet_status(fleet, **options)
    if args.client_url:
        return FleetClient(client_url=args.client_url, **options)
    return FleetClient(args.endpoints, **options)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rolloutfleet-rollout-example", description=__doc__.splitlines()[0] if __doc__ else None
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", nargs="+", metavar="URL", help="the fleet's per-proxy URLs")
    where.add_argument("--client-url", help="the fleet's client Service URL")
    where.add_argument(
        "--fleet-status",
        metavar="FILE",
        help="a RolloutFleet as JSON (kubectl get rolloutfleet NAME -o json)",
    )
    parser.add_argument("--admin-key-file", help=f"file holding the admin key (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--sessions", type=int, default=16, help="sessions in total (M)")
    parser.add_argument("--concurrency", type=int, help="sessions at a time (default: all of them)")
    parser.add_argument("--turns", type=int, default=3, help="turns per session")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--placement", choices=POLICIES, default="least_loaded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turn-rewards", action="store_true", help="also set a reward on every turn")
    parser.add_argument(
        "--tools", action="store_true", help="offer a calculator tool and answer the model's calls to it"
    )
    parser.add_argument(
        "--stagger-s", type=float, default=0.0, help="spread the first wave's starts over this"
    )
    parser.add_argument("--restart-timeout-s", type=float, default=300.0)
    parser.add_argument("--progress-interval-s", type=float, default=2.0)
    parser.add_argument(
        "--no-export", action="store_true", help="leave the finished trajectories on the proxies"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.turns < 1 or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--sessions, --turns and --concurrency must be at least 1")
    return args


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    admin_key = _admin_key(args)
    async with make_fleet(args, admin_key) as fleet:
        print(
            f"rollout: {args.sessions} sessions x {args.turns} turns on {len(fleet.endpoints)} endpoint(s), "
            f"placement {args.placement}",
            flush=True,
        )
        began, cpu_began = time.perf_counter(), time.process_time()
        outcomes = await run_rollouts(
            fleet,
            sessions=args.sessions,
            turns=args.turns,
            concurrency=args.concurrency or args.sessions,
            max_tokens=args.max_tokens,
            stagger_s=args.stagger_s,
            seed=args.seed,
            turn_rewards=args.turn_rewards,
            tools=args.tools,
            progress=lambda line: print(line, flush=True),
            progress_interval_s=args.progress_interval_s,
        )
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    print(f"rollout: done in {elapsed:.1f}s", flush=True)
    exported: dict[str, Any] = {}
    if not args.no_export:  # first: sessions found lost at export count as failures below
        exported_at = time.perf_counter()
        exported = await asyncio.to_thread(export_and_ack, admin_key, outcomes)
        exported["export_s"] = round(time.perf_counter() - exported_at, 3)
    summary = summarize(outcomes, elapsed)
    summary["rollout_cpu_s"] = round(cpu, 3)  # this process's CPU while the sessions ran
    summary.update(exported)
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    summary = asyncio.run(amain(args))
    print(json.dumps(summary), flush=True)
    sys.exit(0 if summary["failures"] == 0 else 1)


if __name__ == "__main__":
    main()
