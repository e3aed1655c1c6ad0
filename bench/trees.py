"""Session trees: memory per stored token of branched sessions, replay latency of retries, journal
bytes per branch.

1. Stored tokens (a fresh proxy per kind, upstream stand-in with latency 0). `tree`: N sessions,
   each a trunk of 3 turns, then 4 branches off the trunk's last reply (each a new question there,
   then one reply), so every branch's path is 4 turns of which 3 (about 75% of the tokens) are
   shared. `linear`: N sessions of 7 turns in one line, with the same messages (the trunk, then the
   4 questions one after the other): the same total stored length per session. After a warm-up (20
   sessions created, run and deleted; a cleanup cycle trims the heap) the trunks of all sessions
   run, then all branches (or continuation turns); RSS above the warmed-up baseline, divided by the
   proxy's own `tokens_held`, is bytes per stored token. The journal's `bytes_written` before and
   after the second phase, divided by its turns and tokens, is journal bytes per branch (per
   continuation turn for `linear`).
2. Replay (a fresh proxy, stand-in latency L): C sessions run T turns each, concurrently (closed
   loops); every turn is sent, answered, then sent again identically (the retry) and must be
   answered from the record (`Idempotent-Replayed: true`, the same body byte for byte). Half the
   sessions send an `Idempotency-Key` per turn (as FleetClient does), half rely on the request
   digest. Latency of normal turns and of retries; then the same one session at a time.

`--family` picks the proxy's tokenizer (`test` or a model family's real tokenizer and template from
the test kit); `--rounds` repeats everything, the order of the two kinds reversed every other round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import aiohttp
from common import (
    ADMIN,
    IMAGES,
    ChatSessions,
    percentile,
    progress,
    proxy_process,
    save_figure,
    save_result,
    upstream_stub,
)

TRUNK_TURNS = 3
PHASE_TIMEOUT_S = 900  # every load phase is bounded in time as well as in count
KINDS = ("linear", "tree")


def question(session: int, step: int, words: int) -> str:
    """A user message of `words` seeded words: the same text for the same session and step in both
    kinds, so their sessions store the same tokens."""
    rng = random.Random(session * 1000 + step)
    topic = " ".join(rng.choice(ChatSessions.WORDS) for _ in range(words))
    return f"Session {session}, step {step}: consider {topic} and continue."


class Sessions:
    """N proxy sessions driven by one aiohttp client, `concurrency` sessions at a time."""

    def __init__(self, http: aiohttp.ClientSession, url: str, concurrency: int):
        self.http, self.url, self.concurrency = http, url, concurrency
        self.failures = 0

    async def stats(self) -> dict:
        async with self.http.get(f"{self.url}/stats") as response:
            return await response.json()

    async def create(self) -> tuple[str, dict[str, str]]:
        async with self.http.post(f"{self.url}/v1/sessions", headers=ADMIN, json={}) as response:
            created = await response.json()
        return created["session_id"], {"Authorization": f"Bearer {created['session_key']}"}

    async def turn(self, sid: str, auth: dict, messages: list[dict], max_tokens: int) -> dict | None:
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
        url = f"{self.url}/v1/sessions/{sid}/chat/completions"
        async with self.http.post(url, json=body, headers=auth) as response:
            answer = await response.json()
            if response.status != 200:
                self.failures += 1
                return None
        return answer["choices"][0]["message"]

    async def each(self, count: int, job) -> None:
        """job(i) for i in range(count), `concurrency` at a time."""
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < count:
                index = next_index
                next_index += 1
                await job(index)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(self.concurrency))), PHASE_TIMEOUT_S)


async def stored_tokens(
    url: str, kind: str, sessions: int, concurrency: int, output_tokens: int, words: int, branches: int
) -> dict:
    """Phase 1 (trunks), phase 2 (branches or continuation turns); RSS, tokens and journal bytes."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as http:
        s = Sessions(http, url, concurrency)
        post_start = (await s.stats())["rss_bytes"]

        async def warm_up(index: int) -> None:
            sid, auth = await s.create()
            messages = [{"role": "user", "content": question(index, 0, words)}]
            for step in range(1, 3):
                reply = await s.turn(sid, auth, messages, output_tokens)
                if reply is None:
                    return
                messages += [reply, {"role": "user", "content": question(index, step, words)}]
            async with http.delete(f"{url}/v1/sessions/{sid}", headers=auth) as response:
                assert response.status == 204

        await s.each(20, warm_up)
        await asyncio.sleep(2.5)  # a cleanup cycle (1 s interval) trims what the warm-up freed
        baseline = await s.stats()
        conversations: list[tuple[str, dict, list[dict]]] = [("", {}, [])] * sessions

        async def trunk(index: int) -> None:
            sid, auth = await s.create()
            messages: list[dict] = []
            for step in range(TRUNK_TURNS):
                messages.append({"role": "user", "content": question(index, step, words)})
                reply = await s.turn(sid, auth, messages, output_tokens)
                if reply is None:
                    return
                messages.append(reply)
            conversations[index] = (sid, auth, messages)

        async def grow(index: int) -> None:
            sid, auth, messages = conversations[index]
            if not sid:  # its trunk failed (counted)
                return
            for branch in range(branches):
                asked = {"role": "user", "content": question(index, TRUNK_TURNS + branch, words)}
                if kind == "tree":  # back to the trunk's last reply, a new question there
                    await s.turn(sid, auth, [*messages, asked], output_tokens)
                else:  # the next turn of the one line
                    reply = await s.turn(sid, auth, [*messages, asked], output_tokens)
                    if reply is None:
                        return
                    messages = [*messages, asked, reply]

        started = time.monotonic()
        await s.each(sessions, trunk)
        trunk_seconds = time.monotonic() - started
        await asyncio.sleep(1.0)
        after_trunk = await s.stats()
        started = time.monotonic()
        await s.each(sessions, grow)
        grow_seconds = time.monotonic() - started
        await asyncio.sleep(1.0)
        loaded = await s.stats()
        sid, auth, _ = conversations[0]
        async with http.get(f"{url}/v1/sessions/{sid}", headers=auth) as response:
            branches_seen = (await response.json())["num_branches"]
    tokens = loaded["tokens_held"]
    trunk_tokens = after_trunk["tokens_held"]
    grown_tokens = tokens - trunk_tokens
    grown_turns = sessions * branches
    journal_grown = loaded["journal"]["bytes_written"] - after_trunk["journal"]["bytes_written"]
    journal_trunk = after_trunk["journal"]["bytes_written"] - baseline["journal"]["bytes_written"]
    own_per_branch = grown_tokens / grown_turns
    trunk_per_session = trunk_tokens / sessions
    return {
        "kind": kind,
        "sessions": loaded["live_sessions"],
        "failed_turns": s.failures,
        "branches_per_session": branches_seen,
        "tokens_held": tokens,
        "tokens_held_per_session": round(tokens / sessions, 1),
        "trunk_tokens_per_session": round(trunk_per_session, 1),
        "grown_tokens_per_turn": round(own_per_branch, 1),
        # A tree branch's path: the trunk and its own turn; the share of it the branches have in common.
        "path_tokens": round(trunk_per_session + own_per_branch, 1),
        # RSS per token of the branches' paths as a client sees them (each path whole, the trunk 4 times)
        "bytes_per_path_token": round(
            (loaded["rss_bytes"] - baseline["rss_bytes"])
            / (sessions * branches * (trunk_per_session + own_per_branch)),
            2,
        )
        if kind == "tree"
        else None,
        "shared_fraction": round(trunk_per_session / (trunk_per_session + own_per_branch), 3),
        "rss_post_start_bytes": post_start,
        "rss_baseline_bytes": baseline["rss_bytes"],
        "rss_after_trunk_bytes": after_trunk["rss_bytes"],
        "rss_loaded_bytes": loaded["rss_bytes"],
        "bytes_per_token": round((loaded["rss_bytes"] - baseline["rss_bytes"]) / tokens, 2),
        "trunk_bytes_per_token": round((after_trunk["rss_bytes"] - baseline["rss_bytes"]) / trunk_tokens, 2),
        "grown_bytes_per_token": round((loaded["rss_bytes"] - after_trunk["rss_bytes"]) / grown_tokens, 2),
        "journal_bytes_trunk": journal_trunk,
        "journal_bytes_grown": journal_grown,
        "journal_bytes_per_trunk_turn": round(journal_trunk / (sessions * TRUNK_TURNS)),
        "journal_bytes_per_grown_turn": round(journal_grown / grown_turns),
        "journal_bytes_per_grown_token": round(journal_grown / grown_tokens, 2),
        "trunk_seconds": round(trunk_seconds, 2),
        "grow_seconds": round(grow_seconds, 2),
    }


async def replay_latency(url: str, sessions: int, turns: int, concurrency: int, words: int) -> dict:
    """Every turn sent, answered, and sent again identically; the retry must come from the record."""
    normal: list[float] = []
    retried: dict[str, list[float]] = {"key": [], "digest": []}
    problems: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as http:
        s = Sessions(http, url, concurrency)
        before = (await s.stats())["totals"]

        async def post(sid: str, headers: dict, body: dict) -> tuple[float, int, bytes, str | None]:
            start = time.perf_counter()
            async with http.post(
                f"{url}/v1/sessions/{sid}/chat/completions", json=body, headers=headers
            ) as response:
                raw = await response.read()
            return (
                time.perf_counter() - start,
                response.status,
                raw,
                response.headers.get("Idempotent-Replayed"),
            )

        async def session(index: int) -> None:
            sid, auth = await s.create()
            by = "key" if index % 2 == 0 else "digest"
            messages: list[dict] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": question(index, turn, words)})
                headers = dict(auth)
                if by == "key":
                    headers["Idempotency-Key"] = f"{sid}-{turn}"
                body = {"model": "m", "messages": messages, "max_tokens": 16}
                seconds, status, first, _ = await post(sid, headers, body)
                if status != 200:
                    problems.append(f"turn {status}")
                    return
                normal.append(seconds)
                seconds, status, again, replayed = await post(sid, headers, body)
                if status != 200 or replayed != "true" or again != first:
                    problems.append(f"retry {status} replayed={replayed} same={again == first}")
                retried[by].append(seconds)
                messages.append(json.loads(first)["choices"][0]["message"])

        started = time.monotonic()
        await s.each(sessions, session)
        wall = time.monotonic() - started
        after = (await s.stats())["totals"]
    every = retried["key"] + retried["digest"]

    def quantiles(values: list[float]) -> dict:
        return {
            "count": len(values),
            "p50_ms": round(percentile(values, 50) * 1000, 2),
            "p99_ms": round(percentile(values, 99) * 1000, 2),
            "max_ms": round(max(values) * 1000, 2) if values else None,
        }

    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "concurrency": concurrency,
        "wall_seconds": round(wall, 2),
        "problems": problems[:20],
        "problem_count": len(problems),
        "turns_replayed": after["turns_replayed"] - before["turns_replayed"],
        "engine_turns": after["turns"] - before["turns"],
        "normal": quantiles(normal),
        "retry": quantiles(every),
        "retry_by_key": quantiles(retried["key"]),
        "retry_by_digest": quantiles(retried["digest"]),
        "normal_latencies_ms": [round(x * 1000, 2) for x in normal],
        "retry_latencies_ms": [round(x * 1000, 2) for x in every],
    }


def plot(stored: list[dict], replays: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, kind in enumerate(KINDS):
        values = [r["bytes_per_token"] for r in stored if r["kind"] == kind]
        left.bar(i, sum(values) / len(values), 0.6, label=kind)
        left.scatter([i] * len(values), values, color="k", s=10, zorder=3)
    linear = [r["bytes_per_token"] for r in stored if r["kind"] == "linear"]
    left.axhline(1.3 * sum(linear) / len(linear), color="r", linestyle="--", label="goal: 1.3 x linear")
    left.axhline(9, color="k", linestyle=":", label="payload 9 B (id, logprob, mask)")
    left.set_xticks(range(len(KINDS)), [f"{k} ({stored[0]['sessions']} sessions)" for k in KINDS])
    left.set_ylabel("RSS bytes per stored token")
    tree = next(r for r in stored if r["kind"] == "tree")
    left.set_title(
        f"{tree['branches_per_session']} branches sharing {tree['shared_fraction']:.0%}: RSS per stored token"
    )
    left.legend(fontsize="small", loc="lower right")
    styles = ["-", "--", ":", "-."]
    for replay in replays:
        concurrent = [r["concurrency"] for r in replays if r["round"] == replay["round"]]
        style = styles[concurrent.index(replay["concurrency"]) % len(styles)]
        label = f"{replay['concurrency']} at a time" + (
            f", round {replay['round']}" if replay["round"] else ""
        )
        for name, color in (("normal", "C0"), ("retry", "C1")):
            values = sorted(replay[f"{name}_latencies_ms"])
            ys = [(j + 1) / len(values) for j in range(len(values))]
            middle.plot(values, ys, linestyle=style, color=color, label=f"{name} turn, {label}")
    middle.set_xscale("log")
    middle.set_xlabel("latency (ms, log scale)")
    middle.set_ylabel("fraction of turns")
    middle.set_title(f"Retries answered from the record (upstream L = {replays[0]['upstream_latency_s']} s)")
    middle.legend(fontsize="small")
    for i, kind in enumerate(KINDS):
        values = [r["journal_bytes_per_grown_turn"] for r in stored if r["kind"] == kind]
        right.bar(i, sum(values) / len(values), 0.6)
        right.scatter([i] * len(values), values, color="k", s=10, zorder=3)
    right.set_xticks(range(len(KINDS)), ["continuation turn (linear)", "branch (tree)"])
    right.set_ylabel("journal bytes written")
    tokens = next(r["grown_tokens_per_turn"] for r in stored if r["kind"] == "tree")
    right.set_title(f"Journal bytes per new turn ({tokens:.0f} own tokens)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=500, help="per turn")
    parser.add_argument("--words", type=int, default=40, help="words per user message")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-s", type=float, default=0.5, help="the stand-in's latency for replays")
    parser.add_argument("--replay-sessions", type=int, default=20)
    parser.add_argument("--replay-turns", type=int, default=10)
    parser.add_argument("--family", default="test", help="`test` or a test-kit model family (qwen3, ...)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, help="keep logs here (default: a temporary directory)")
    args = parser.parse_args()
    load_average = os.getloadavg()
    progress(f"load average at start: {load_average}")
    tokenizer = None
    if args.family != "test":
        from rolloutfleet_testkit.model_families import FAMILIES

        tokenizer = FAMILIES[args.family].build_cached()
    flags = ("--cleanup-interval-s", "1", "--no-log-requests")
    stored: list[dict] = []
    replays: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-trees-") as tmp:
        work = args.work_dir or Path(tmp)
        for round_ in range(args.rounds):
            kinds = KINDS if round_ % 2 == 0 else tuple(reversed(KINDS))
            with upstream_stub(work, 0.0, args.output_tokens) as (stub, _):
                for kind in kinds:
                    with proxy_process(work, stub, *flags, tokenizer=tokenizer) as (url, _):
                        progress(f"round {round_}, {kind}: {args.sessions} sessions")
                        result = asyncio.run(
                            stored_tokens(
                                url,
                                kind,
                                args.sessions,
                                args.concurrency,
                                args.output_tokens,
                                args.words,
                                args.branches,
                            )
                        )
                    result.update(round=round_, load_average_1m=round(os.getloadavg()[0], 2))
                    stored.append(result)
                    progress(
                        f"{kind}: {result['tokens_held']} tokens held, {result['bytes_per_token']} B/token "
                        f"(trunk {result['trunk_bytes_per_token']}, "
                        f"grown {result['grown_bytes_per_token']}); "
                        f"{result['branches_per_session']} branches, shared {result['shared_fraction']}; "
                        f"journal {result['journal_bytes_per_grown_turn']} B per new turn, "
                        f"{result['journal_bytes_per_grown_token']} B per token; "
                        f"{result['failed_turns']} failed turns"
                    )
            with upstream_stub(work, args.latency_s, 16) as (stub, _):
                for concurrency in (args.replay_sessions, 1):
                    with proxy_process(work, stub, *flags, tokenizer=tokenizer) as (url, _):
                        sessions = args.replay_sessions if concurrency > 1 else 4
                        progress(
                            f"round {round_}, replay: {sessions} sessions x {args.replay_turns} turns, "
                            f"{concurrency} at a time"
                        )
                        result = asyncio.run(
                            replay_latency(url, sessions, args.replay_turns, concurrency, args.words)
                        )
                    result.update(
                        round=round_,
                        upstream_latency_s=args.latency_s,
                        load_average_1m=round(os.getloadavg()[0], 2),
                    )
                    replays.append(result)
                    progress(
                        f"replay, {concurrency} at a time: normal p50/p99 {result['normal']['p50_ms']}/"
                        f"{result['normal']['p99_ms']} ms, retry {result['retry']['p50_ms']}/"
                        f"{result['retry']['p99_ms']} ms; {result['turns_replayed']} replayed, "
                        f"{result['problem_count']} problems"
                    )
    summary = {}
    for kind in KINDS:
        values = [r["bytes_per_token"] for r in stored if r["kind"] == kind]
        summary[f"{kind}_bytes_per_token"] = values
    means = {kind: sum(summary[f"{kind}_bytes_per_token"]) / args.rounds for kind in KINDS}
    summary["tree_over_linear"] = round(means["tree"] / means["linear"], 3)
    progress(f"tree / linear bytes per stored token: {summary['tree_over_linear']}")
    plot(stored, replays, IMAGES / "trees.png")
    save_result(
        "trees",
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "load_average_at_start": [round(x, 2) for x in load_average],
            "summary": summary,
            "stored": stored,
            "replay": replays,
        },
    )


if __name__ == "__main__":
    main()
