"""Proxy overhead: K concurrent sessions x T turns against an upstream with fixed latency L.

Throughput is compared with the Little's-law bound K/L and latency with the same load sent straight
to the upstream. The proxy, the upstream stand-in and this load generator are separate processes
sharing the machine's cores.

Each session is a closed loop (next turn when the previous answer arrived). Sessions start at
seeded random offsets within the first L seconds, as rollouts do, instead of in lockstep (which
would make every answer land in the same instant and measure a burst, not a steady state). The
throughput of a loop is its turns over its own active time; the fleet's is their sum.

`--family qwen3` gives the proxy a model family's real tokenizer and chat template (test kit) instead
of the test tokenizer (`test`); `--family test qwen3 --rounds 2` runs both for each K, one after the
other, so they are compared on the same machine in the same minutes.

`--workload` picks what the sessions send: `linear` (each turn continues the last one: today's load,
the default) or `branching` (every third turn leaves the branch, alternately going back to an
earlier reply of it with a new question, and compacting: a new conversation of one summary message;
the other turns continue the branch). Several run one after another for each K, like `--family`.

`--routing off on` runs each K without and with routing replay (R3): the proxy with
`--routed-experts` and a model directory of Qwen3-30B-A3B's routing shape (48 layers x top-8 of 128
experts: 384 bytes per token), the stand-in answering `routed_experts` rows of that shape.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from common import (
    ADMIN,
    IMAGES,
    cpu_seconds,
    percentile,
    progress,
    proxy_process,
    save_figure,
    save_result,
    tokenizer_dir,
    upstream_stub,
)

PROMPT_IDS = list(range(3, 53))  # 50 tokens, as a short first-turn prompt
WORKLOADS = ("linear", "branching")
FIRST_MESSAGE = {"role": "user", "content": "Solve the task step by step, please."}
SUMMARY = (
    "Summary of the work so far: the task was split into three parts; the first two are solved and "
    "checked, the third needs another approach because the direct method ran out of steps. "
    "Continue from here."
)
# Routing replay's shape in the `on` runs: Qwen3-30B-A3B's (layers x top-k of experts).
ROUTING_SHAPE = (48, 8, 128)
# The journal's modes; `none` is a proxy without a dump directory (no journal: the baseline).
DURABILITY_FLAGS = {
    "sync": ["--durability", "sync"],
    "async": ["--durability", "async"],
    "none": ["--dump-dir", "null", "--allow-dropping-sessions"],
}


def _stats(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/stats") as response:
        return json.loads(response.read())


@dataclass
class Measured:
    latencies: list[float]
    loop_rates: list[float]  # turns per second of each closed loop over its own active time
    wall: float
    errors: int
    branches: int = 1  # leaves of the first session's tree (1 for a linear session)


def start_offsets(sessions: int, latency_s: float) -> list[float]:
    rng = random.Random(1)
    return [rng.uniform(0, latency_s) for _ in range(sessions)]


async def direct_load(url: str, sessions: int, turns: int, output_tokens: int, latency_s: float) -> Measured:
    latencies: list[float] = []
    loop_rates: list[float] = []
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": output_tokens},
        "return_logprob": True,
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions)) as http:

        async def worker(offset: float) -> None:
            await asyncio.sleep(offset)
            began = time.perf_counter()
            for _ in range(turns):
                start = time.perf_counter()
                async with http.post(f"{url}/generate", json=body) as response:
                    await response.read()
                    assert response.status == 200
                latencies.append(time.perf_counter() - start)
            loop_rates.append(turns / (time.perf_counter() - began))

        start = time.perf_counter()
        await asyncio.gather(*(worker(o) for o in start_offsets(sessions, latency_s)))
        return Measured(latencies, loop_rates, time.perf_counter() - start, 0)


def next_request(workload: str, turn: int, messages: list[dict], rng: random.Random) -> list[dict]:
    """The messages of turn `turn` (from 1), after `messages` (the branch so far, ending with the last
    reply). `branching`: turns 2, 5, 8, ... leave the branch, alternately going back to an earlier
    reply (not the last) with a new question, and compacting to a new conversation of one summary
    message; the turns in between continue the branch, as every turn of `linear` does."""
    if workload == "linear" or turn % 3 != 2:
        return [*messages, {"role": "user", "content": f"Observation {turn - 1}: continue."}]
    if (turn // 3) % 2 == 1:
        return [{"role": "user", "content": SUMMARY}]
    replies = [i for i, m in enumerate(messages[:-1]) if m["role"] == "assistant"]
    back_to = rng.choice(replies)
    question = f"Go back to step {back_to // 2} and try another way (turn {turn})."
    return [*messages[: back_to + 1], {"role": "user", "content": question}]


async def proxy_load(
    url: str, sessions: int, turns: int, output_tokens: int, latency_s: float, workload: str = "linear"
) -> Measured:
    latencies: list[float] = []
    loop_rates: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions)) as http:
        created = []
        for _ in range(sessions):  # not timed
            async with http.post(f"{url}/v1/sessions", headers=ADMIN, json={}) as response:
                created.append(await response.json())

        async def worker(index: int, session: dict, offset: float) -> None:
            nonlocal errors
            await asyncio.sleep(offset)
            began = time.perf_counter()
            chat_url = f"{url}/v1/sessions/{session['session_id']}/chat/completions"
            auth = {"Authorization": f"Bearer {session['session_key']}"}
            messages = [FIRST_MESSAGE]
            rng = random.Random(index)
            for turn in range(turns):
                body = {"model": "m", "messages": messages, "max_tokens": output_tokens}
                start = time.perf_counter()
                async with http.post(chat_url, json=body, headers=auth) as response:
                    answer = await response.json()
                    if response.status != 200:
                        errors += 1
                        return
                latencies.append(time.perf_counter() - start)
                messages = next_request(workload, turn + 1, [*messages, answer["choices"][0]["message"]], rng)
            loop_rates.append(turns / (time.perf_counter() - began))

        start = time.perf_counter()
        offsets = start_offsets(sessions, latency_s)
        await asyncio.gather(
            *(worker(i, s, o) for i, (s, o) in enumerate(zip(created, offsets, strict=True)))
        )
        wall = time.perf_counter() - start
        first = created[0]  # not timed: how many branches a session's tree has
        async with http.get(
            f"{url}/v1/sessions/{first['session_id']}",
            headers={"Authorization": f"Bearer {first['session_key']}"},
        ) as response:
            branches = (await response.json()).get("num_branches", 1)
        return Measured(latencies, loop_rates, wall, errors, branches)


def summarize(measured: Measured, sessions: int, latency_s: float) -> dict:
    latencies = measured.latencies
    throughput = sum(measured.loop_rates)
    bound = sessions / latency_s
    return {
        "requests": len(latencies),
        "errors": measured.errors,
        "wall_seconds": round(measured.wall, 3),
        "wall_clock_rps": round(len(latencies) / measured.wall, 1),
        "throughput_rps": round(throughput, 1),
        "littles_law_bound_rps": bound,
        "fraction_of_bound": round(throughput / bound, 3),
        "latency_p50_ms": round(percentile(latencies, 50) * 1000, 1),
        "latency_p99_ms": round(percentile(latencies, 99) * 1000, 1),
    }


def run_one(
    work: Path,
    sessions: int,
    turns: int,
    latency_s: float,
    output_tokens: int,
    log_requests: bool,
    tokenizer: Path | None = None,
    durability: str = "sync",
    workload: str = "linear",
    routing: bool = False,
) -> dict:
    """One K: the same closed-loop load straight to the stand-in, then through a fresh proxy."""
    me = psutil.Process()
    shape = "x".join(map(str, ROUTING_SHAPE)) if routing else None
    if routing:
        from rolloutfleet_testkit.moe_model import moe_model_dir

        source = tokenizer or tokenizer_dir()
        tokenizer = moe_model_dir(source, work / f"moe-{source.name}", *ROUTING_SHAPE)
    with upstream_stub(work, latency_s, output_tokens, routing=shape) as (stub, stub_process):
        progress(f"K={sessions}: direct to the upstream stand-in, {sessions * turns} requests")
        measured = asyncio.run(
            asyncio.wait_for(direct_load(stub, sessions, turns, output_tokens, latency_s), 600)
        )
        direct = summarize(measured, sessions, latency_s)
        flags = ["--upstream-max-connections", str(max(1024, sessions * 2))]
        flags.append("--log-requests" if log_requests else "--no-log-requests")
        flags += DURABILITY_FLAGS[durability]
        if routing:
            flags.append("--routed-experts")
        with proxy_process(work, stub, *flags, tokenizer=tokenizer) as (proxy, proxy_process_):
            progress(f"K={sessions}: through the proxy, {sessions * turns} turns ({workload})")
            processes = {"proxy": proxy_process_, "upstream_stub": stub_process, "load_generator": me}
            before = {name: cpu_seconds(p) for name, p in processes.items()}
            measured = asyncio.run(
                asyncio.wait_for(proxy_load(proxy, sessions, turns, output_tokens, latency_s, workload), 600)
            )
            used = {name: cpu_seconds(p) - before[name] for name, p in processes.items()}
            through = summarize(measured, sessions, latency_s)
            through["branches_per_session"] = measured.branches
            stats = _stats(proxy)
            through["tokens_held"] = stats["tokens_held"]
            if durability != "none":
                journal = stats["journal"]
                through.update(
                    journal_bytes_written=journal["bytes_written"],
                    journal_syncs=journal["syncs"],
                    journal_bytes_per_held_token=round(
                        journal["bytes_written"] / max(1, stats["tokens_held"]), 2
                    ),
                    journal_commit_wait_mean_ms=journal["commit_wait_mean_ms"],
                )
            if routing and durability != "none":
                files = (work / f"dumps-{proxy.rsplit(':', 1)[1]}" / "routing").glob("*.r3")
                routed_bytes = sum(path.stat().st_size for path in files)
                through["routing_file_bytes_per_held_token"] = round(
                    routed_bytes / max(1, stats["tokens_held"]), 2
                )
            through["rss_bytes"] = proxy_process_.memory_info().rss
    through.update(
        proxy_cpu_seconds=round(used["proxy"], 2),
        proxy_cpu_us_per_turn=round(used["proxy"] / max(1, len(measured.latencies)) * 1e6),
        cpu_cores_used={name: round(seconds / measured.wall, 2) for name, seconds in used.items()},
    )
    result = {
        "sessions": sessions,
        "turns": turns,
        "upstream_latency_s": latency_s,
        "output_tokens": output_tokens,
        "log_requests": log_requests,
        "durability": durability,
        "workload": workload,
        "routing": "on" if routing else "off",
        "direct": direct,
        "proxy": through,
        "added_latency_p50_ms": round(through["latency_p50_ms"] - direct["latency_p50_ms"], 1),
        "added_latency_p99_ms": round(through["latency_p99_ms"] - direct["latency_p99_ms"], 1),
    }
    progress(
        f"K={sessions}: proxy {through['throughput_rps']} rps = {through['fraction_of_bound']} of K/L "
        f"(direct {direct['fraction_of_bound']}); added p50 {result['added_latency_p50_ms']} ms, "
        f"p99 {result['added_latency_p99_ms']} ms; proxy CPU {through['proxy_cpu_us_per_turn']} us/turn; "
        f"cores used {through['cpu_cores_used']}"
    )
    return result


def series_name(runs: list[dict]):
    """A run's series in the plot: its tokenizer, with its workload and journal mode when the runs
    have several."""
    workloads = {r.get("workload", "linear") for r in runs}
    modes = {r.get("durability", "sync") for r in runs}
    routings = {r.get("routing", "off") for r in runs}

    def name_of(r: dict) -> str:
        parts = [r.get("tokenizer", "test")]
        if len(workloads) > 1:
            parts.append(r.get("workload", "linear"))
        if len(modes) > 1:
            parts.append(r.get("durability", "sync"))
        if len(routings) > 1:
            parts.append(f"R3 {r.get('routing', 'off')}")
        return ", ".join(parts)

    return name_of


def plot(runs: list[dict], path: Path, name_of=None) -> None:
    """Per K: the direct load's and each series' fraction of K/L (mean over rounds, each round a
    dot), and the added latency. A series is a tokenizer (with its workload and journal mode when
    there are several), or what `name_of(run)` says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name_of = name_of or series_name(runs)
    ks = list(dict.fromkeys(r["sessions"] for r in runs))
    names = list(dict.fromkeys(name_of(r) for r in runs))
    series = ["direct", *names]
    width = 0.8 / len(series)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11 if len(names) > 2 else 10, 4))

    def values(k: int, name: str, key) -> list[float]:
        return [key(r) for r in runs if r["sessions"] == k and (name == "direct" or name_of(r) == name)]

    for j, name in enumerate(series):
        key = (
            (lambda r: r["direct"]["fraction_of_bound"])
            if name == "direct"
            else (lambda r: r["proxy"]["fraction_of_bound"])
        )
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(ks))]
        samples = [values(k, name, key) for k in ks]
        label = name if name == "direct" else f"through proxy ({name})"
        left.bar(xs, [sum(v) / len(v) for v in samples], width, label=label)
        for x, v in zip(xs, samples, strict=True):
            left.scatter([x] * len(v), v, color="k", s=8, zorder=3)
    left.axhline(0.95, color="k", linestyle="--", linewidth=1, label="goal 0.95")
    left.set_xticks(range(len(ks)), [str(k) for k in ks])
    left.set_xlabel("concurrent sessions K")
    left.set_ylabel("throughput / (K / L)")
    left.set_ylim(0, 1.05)
    left.legend(loc="lower left", fontsize="small")
    left.set_title(f"Throughput vs Little's-law bound (L = {runs[0]['upstream_latency_s']} s)")
    width = 0.8 / (2 * len(names))
    for j, name in enumerate(names):
        for q, quantile in enumerate(("p50", "p99")):
            xs = [i + (2 * j + q - (2 * len(names) - 1) / 2) * width for i in range(len(ks))]
            samples = [values(k, name, lambda r, q_=quantile: r[f"added_latency_{q_}_ms"]) for k in ks]
            right.bar(xs, [sum(v) / len(v) for v in samples], width, label=f"{quantile} ({name})")
    right.set_xticks(range(len(ks)), [str(k) for k in ks])
    right.set_xlabel("concurrent sessions K")
    right.set_ylabel("added latency (ms)")
    right.set_title("Latency added by the proxy")
    right.legend(fontsize="small")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--latency-s", type=float, default=0.5)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--no-log-requests", action="store_true", help="turn the per-request log line off")
    parser.add_argument("--work-dir", type=Path, help="keep logs here (default: a temporary directory)")
    parser.add_argument(
        "--family",
        nargs="+",
        default=["test"],
        help="tokenizers: `test` (the test tokenizer, default) or model families' real tokenizers and "
        "templates (test kit: qwen3, llama31, ...); several run one after another for each K, "
        "the order reversed every other round",
    )
    parser.add_argument(
        "--workload",
        nargs="+",
        default=["linear"],
        choices=WORKLOADS,
        help="what the sessions send: `linear` (every turn continues the last, the default) or "
        "`branching` (every third turn goes back to an earlier reply or compacts, alternately); "
        "several run one after another for each K and tokenizer, the order reversed every other round",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat every K and tokenizer this many times")
    parser.add_argument(
        "--durability",
        nargs="+",
        default=["sync"],
        choices=sorted(DURABILITY_FLAGS),
        help="journal modes to run for each K (none: no dump directory, the no-journal baseline)",
    )
    parser.add_argument(
        "--routing",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="routing replay (R3) off or on for each K (on: Qwen3-30B-A3B's routing shape)",
    )
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    progress(f"1-minute load average at start: {load_average:.2f}")
    tokenizers: dict[str, Path | None] = {}
    for name in args.family:
        if name == "test":
            tokenizers[name] = None
        else:
            from rolloutfleet_testkit.model_families import FAMILIES

            tokenizers[name] = FAMILIES[name].build_cached()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-overhead-") as tmp:
        work = args.work_dir or Path(tmp)
        for round_ in range(args.rounds):
            for k in args.sessions:
                order = list(tokenizers) if round_ % 2 == 0 else list(reversed(tokenizers))
                workloads = args.workload if round_ % 2 == 0 else list(reversed(args.workload))
                for name in order:
                    for workload in workloads:
                        for durability in args.durability:
                            routings = args.routing if round_ % 2 == 0 else list(reversed(args.routing))
                            for routing in routings:
                                progress(
                                    f"round {round_}, K={k}, tokenizer {name}, workload {workload}, "
                                    f"durability {durability}, routing {routing}"
                                )
                                result = run_one(
                                    work,
                                    k,
                                    args.turns,
                                    args.latency_s,
                                    args.output_tokens,
                                    not args.no_log_requests,
                                    tokenizers[name],
                                    durability,
                                    workload,
                                    routing == "on",
                                )
                                runs.append({"round": round_, "tokenizer": name, **result})
    families = [name for name in tokenizers if name != "test"]
    suffix = ("-nolog" if args.no_log_requests else "") + "".join(f"-{name}" for name in families)
    if args.durability != ["sync"]:
        suffix += "-durability"
    if args.workload != ["linear"]:
        suffix += "".join(f"-{workload}" for workload in args.workload)
    if args.routing != ["off"]:
        suffix += "-r3"
    save_result(
        "overhead" + suffix,
        {
            # save_result names the command after the result; this script is `overhead`
            "command": " ".join(["./dev", "bench", "overhead", *sys.argv[1:]]),
            "load_average_1m_at_start": round(load_average, 2),
            "tokenizers": list(tokenizers),
            "workloads": args.workload,
            "routing_shape": list(ROUTING_SHAPE) if "on" in args.routing else None,
            "runs": runs,
        },
    )
    plot(runs, IMAGES / f"overhead{suffix}.png")


if __name__ == "__main__":
    main()
