"""Routing replay (R3): what recording the experts of every token costs, per token, in the proxy's
memory, its journal, its routing files and an export, against the same load without it.

Two proxies, one after the other, each in front of the fixed-latency SGLang stand-in answering
routed experts of Qwen3-30B-A3B's shape (48 layers x top-8 of 128 experts: uint8 rows of 384 bytes):
one with `--routed-experts` (and a model directory of that shape), one without. Each holds S
sessions of T turns (a user message and `--output-tokens` generated tokens per turn, the history
re-sent), left idle; then per token held: RSS above the proxy's RSS before the sessions (from
/stats, each after a heap trim), journal bytes written, routing file bytes; then every session is
finished and exported in one batch: its bytes per exported token.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from common import (
    ADMIN,
    ChatSessions,
    cpu_seconds,
    progress,
    proxy_process,
    save_result,
    tokenizer_dir,
    upstream_stub,
)

SHAPE = (48, 8, 128)  # Qwen3-30B-A3B: num_hidden_layers, num_experts_per_tok, num_experts


async def stats(url: str) -> dict:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{url}/stats")).json()


async def settled_rss(url: str) -> int:
    """RSS after the cleanup cycle trimmed the heap (turns leave freed memory in malloc's arenas, many
    at 64 turns at once: that is not what the sessions hold). A deleted throwaway session is a
    departure, which makes the next cycle (every second here) trim."""
    async with httpx.AsyncClient() as client:
        trims = (await stats(url))["totals"]["heap_trims"]
        created = (await client.post(f"{url}/v1/sessions", headers=ADMIN, json={})).json()
        await client.delete(f"{url}/v1/sessions/{created['session_id']}", headers=ADMIN)
        deadline = time.monotonic() + 30
        while (await stats(url))["totals"]["heap_trims"] <= trims:
            if time.monotonic() > deadline:
                raise RuntimeError("no heap trim within 30 s")
            await asyncio.sleep(0.2)
    await asyncio.sleep(1.2)  # the proxy samples its RSS at most once a second
    return int((await stats(url))["rss_bytes"])


async def measure(
    url: str, process: psutil.Process, work: Path, sessions: int, turns: int, output_tokens: int
) -> dict:
    before = await settled_rss(url)
    async with ChatSessions(
        url, sessions, concurrency=64, max_tokens=output_tokens, temperature=0.7
    ) as chats:
        started, cpu = time.monotonic(), cpu_seconds(process)
        await chats.run_turns(turns)
        played_s, cpu = time.monotonic() - started, cpu_seconds(process) - cpu
        held = await stats(url)
        rss = await settled_rss(url)
        tokens = int(held["tokens_held"])
        port = url.rsplit(":", 1)[1]
        routing_files = list((work / f"dumps-{port}" / "routing").glob("*.r3"))
        routing_bytes = sum(path.stat().st_size for path in routing_files)
        await chats.finish_all()
        async with httpx.AsyncClient(timeout=600) as client:
            exported = await client.post(
                f"{url}/v1/exports", headers=ADMIN, json={"max_trajectories": sessions + 1}
            )
            exported.raise_for_status()
            batch = exported.content
    from rolloutfleet_wire.export_format import decode_batch

    decoded = decode_batch(batch)
    exported_tokens = len(decoded.tensors["input_ids"])
    return {
        "sessions": sessions,
        "turns": turns,
        "tokens_held": tokens,
        "played_seconds": round(played_s, 1),
        "rss_before_bytes": before,
        "rss_held_bytes": rss,
        "rss_bytes_per_held_token": round((rss - before) / max(1, tokens), 1),
        "journal_bytes_written": held["journal"]["bytes_written"],
        "journal_bytes_per_held_token": round(held["journal"]["bytes_written"] / max(1, tokens), 1),
        "routing_files": len(routing_files),
        "routing_file_bytes_per_held_token": round(routing_bytes / max(1, tokens), 1),
        "export_bytes": len(batch),
        "exported_tokens": exported_tokens,
        "export_bytes_per_token": round(len(batch) / max(1, exported_tokens), 1),
        "routed_rows_exported": len(decoded.tensors["routed_experts"]),
        "proxy_cpu_ms_per_turn": round(cpu / (sessions * turns) * 1000, 3),
        "loop_lag_max_seconds": held["loop_lag_max_seconds"],
    }


def run(work: Path, routing: bool, sessions: int, turns: int, output_tokens: int, latency_s: float) -> dict:
    from rolloutfleet_testkit.moe_model import moe_model_dir

    model = moe_model_dir(tokenizer_dir(), work / "moe", *SHAPE)
    shape = "x".join(map(str, SHAPE))
    flags = ["--no-log-requests", "--upstream-max-connections", "256", "--cleanup-interval-s", "1"]
    if routing:
        flags.append("--routed-experts")
    with (
        upstream_stub(work, latency_s, output_tokens, routing=shape) as (stub, _),
        proxy_process(work, stub, *flags, tokenizer=model) as (url, process),
    ):
        progress(f"R3 {'on' if routing else 'off'}: {sessions} sessions x {turns} turns")
        result = asyncio.run(measure(url, process, work, sessions, turns, output_tokens))
    progress(f"R3 {'on' if routing else 'off'}: {result}")
    return {"routing": "on" if routing else "off", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-bench-routing-") as tmp:
        work = args.work_dir or Path(tmp)
        runs = [
            run(work, routing, args.sessions, args.turns, args.output_tokens, args.latency_s)
            for routing in (False, True)
        ]
    off, on = runs
    layers, top_k, _ = SHAPE
    save_result(
        "routing",
        {
            "command": " ".join(["./dev", "bench", "routing", *sys.argv[1:]]),
            "routing_shape": list(SHAPE),
            "row_bytes": layers * top_k,
            "runs": runs,
            "r3_cost_per_token": {
                "memory_rss_bytes": round(
                    on["rss_bytes_per_held_token"] - off["rss_bytes_per_held_token"], 1
                ),
                "journal_bytes": round(
                    on["journal_bytes_per_held_token"] - off["journal_bytes_per_held_token"], 1
                ),
                "routing_file_bytes": on["routing_file_bytes_per_held_token"],
                "export_bytes": round(on["export_bytes_per_token"] - off["export_bytes_per_token"], 1),
            },
        },
    )


if __name__ == "__main__":
    main()
