"""Proxy CPU per turn with real tokenizers and chat templates: a 6-turn tool conversation per session.

For each model family of the test kit (real vocabularies: Qwen's 151k ranks, DeepSeek V3's 128k
tokenizer.json, gpt-oss's 200k o200k_harmony; rebuilt ones on Qwen's or o200k's ranks) the proxy
runs as its own process, from the proxy-only environment, with the family's SGLang tool-call and
reasoning parsers, in front of a scripted SGLang stand-in that answers
in the family's own output format (reasoning, tool calls, stop token). Sessions run the conversation
of `tests/proxy/test_family_turns.py` (tools in every request, three tool calls answered by three tool
results), N sessions with bounded concurrency; the proxy process's CPU seconds over the turns it
served give CPU per turn. The same is measured with the test tokenizer (ChatML, 1,000 tokens) and
plain replies without tools: the path before real templates.

The stand-in (the test kit's upstream stub with a reply rule) runs in a thread of this process, so
its CPU is not the proxy's. It answers each session's turn with that turn's scripted reply: the turn
is read off the prompt as the number of stop tokens in it (every earlier reply ends on one, so the
count grows each turn), calibrated on the warm-up sessions, which run one at a time. Every reply is
checked against the script (its tool calls), so a wrong turn would count as an error.

With request logging on (the proxy's default), the proxy's own per-request timings split the turn:
`tokenize_ms` (history check, template rendering and encoding of the new messages) and `record_ms`
(reply parsing, recording). These are wall times of sections that do not yield, so close to CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from common import (
    ADMIN,
    IMAGES,
    cpu_seconds,
    progress,
    proxy_process,
    save_figure,
    save_result,
    tokenizer_dir,
)
from rolloutfleet_testkit.model_families import FAMILIES, ModelFamily
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import RuledReplies, UpstreamStub
from transformers import AutoTokenizer

# The conversation the tests drive, and the helpers it imports (tests/ and tests/proxy/).
for tests in ("tests", "tests/proxy"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / tests))
from test_family_turns import TOOLS, conversation  # noqa: E402 (needs the path above)

PLAIN = "test-tokenizer"
TURNS = 6


@dataclass
class Turn:
    new_messages: list[dict]
    reply_ids: list[int]
    call_names: list[str]  # the tool calls the proxy must parse out of the reply


def script_for(family: ModelFamily | None, tokenizer) -> list[Turn]:
    """The conversation's turns with the stand-in's reply ids: the tool conversation in the family's
    format, or (test tokenizer) plain questions and answers without tools."""
    if family is None:
        return [
            Turn(
                [{"role": "user", "content": f"Question {t}: what is {t} + {t}?"}],
                tokenizer.encode(
                    f"The answer is {2 * t}, since {t} plus {t} makes {2 * t}.<|im_end|>",
                    add_special_tokens=False,
                ),
                [],
            )
            for t in range(TURNS)
        ]
    return [
        Turn(
            new,
            tokenizer.encode(family.model_reply_text(reasoning, content, calls), add_special_tokens=False),
            [name for name, _ in calls],
        )
        for new, (reasoning, content, calls) in conversation(family)
    ]


@dataclass
class TurnReplies:
    """The stand-in's rule: the reply of the prompt's turn, the turn told by the number of stop ids in
    the prompt. While `calibrating` holds a turn index, that turn is answered and its count learnt."""

    replies: list[list[int]]
    stop_ids: frozenset[int]
    calibrating: int | None = None
    turn_by_stops: dict[int, int] = field(default_factory=dict)
    unknown: int = 0

    def __call__(self, input_ids: list[int]) -> list[int] | None:
        stops = sum(1 for i in input_ids if i in self.stop_ids)
        if self.calibrating is not None:
            known = self.turn_by_stops.setdefault(stops, self.calibrating)
            if known != self.calibrating:
                raise RuntimeError(f"turns {known} and {self.calibrating} both have {stops} stop tokens")
            return self.replies[self.calibrating]
        turn = self.turn_by_stops.get(stops)
        if turn is None:
            self.unknown += 1
            return None
        return self.replies[turn]


class Errors(Exception):
    pass


async def run_session(
    http: aiohttp.ClientSession, url: str, script: list[Turn], tools: bool, on_turn=None
) -> int:
    async with http.post(f"{url}/v1/sessions", headers=ADMIN, json={}) as response:
        created = await response.json()
    auth = {"Authorization": f"Bearer {created['session_key']}"}
    base = f"{url}/v1/sessions/{created['session_id']}"
    messages: list[dict] = []
    last_calls: list[dict] = []
    for index, turn in enumerate(script):
        for message in turn.new_messages:
            if message["role"] == "tool":  # answers the call the proxy returned last turn
                message = {**message, "tool_call_id": last_calls[0]["id"]}
            messages.append(message)
        body: dict = {"model": "m", "messages": messages, "max_tokens": 256}
        if tools:
            body["tools"] = TOOLS
        if on_turn is not None:
            on_turn(index)
        async with http.post(f"{base}/chat/completions", headers=auth, json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise Errors(f"turn {index}: HTTP {response.status}: {answer}")
        message = answer["choices"][0]["message"]
        last_calls = message.get("tool_calls") or []
        if [c["function"]["name"] for c in last_calls] != turn.call_names:
            raise Errors(f"turn {index}: tool calls {last_calls} instead of {turn.call_names}")
        messages.append(message)
    async with http.post(f"{base}/finish", headers=auth) as response:
        if response.status != 200:
            raise Errors(f"finish: HTTP {response.status}")
    return len(script)


def request_timings(log: Path, offset: int) -> dict:
    """Means of the proxy's per-request timings of the chat turns logged after `offset`."""
    fields: dict[str, list[float]] = {"tokenize_ms": [], "record_ms": [], "lock_wait_ms": []}
    with log.open("rb") as lines:
        lines.seek(offset)
        for raw in lines:
            if not raw.startswith(b"{"):
                continue
            line = json.loads(raw)
            if line.get("msg") == "request" and str(line.get("path", "")).endswith("/chat/completions"):
                for name, values in fields.items():
                    if name in line:
                        values.append(line[name])
    return {f"mean_{name}": round(statistics.fmean(v), 4) for name, v in fields.items() if v} | {
        "logged_turns": len(fields["tokenize_ms"])
    }


def measure(
    work: Path,
    name: str,
    directory: Path,
    family: ModelFamily | None,
    args: argparse.Namespace,
) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    stops = (
        [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
        if family
        else [tokenizer.eos_token_id]
    )
    script = script_for(family, tokenizer)
    texts = {tuple(t.reply_ids): tokenizer.decode(t.reply_ids, skip_special_tokens=True) for t in script}
    rule = TurnReplies([t.reply_ids for t in script], frozenset(stops))
    upstream = UpstreamStub(
        args.latency_s, 0, ruled=RuledReplies(rule, rule.stop_ids, lambda ids: texts[tuple(ids)])
    )
    flags = ["--log-requests" if args.log_requests else "--no-log-requests"]
    flags += ["--upstream-max-connections", str(max(64, 2 * args.concurrency))]
    if family is not None:
        flags += ["--tool-call-parser", family.tool_call_parser]
        if family.reasoning_parser:
            flags += ["--reasoning-parser", family.reasoning_parser]
    tools = family is not None
    with (
        serve_app(upstream, access_log=False) as upstream_url,
        proxy_process(work, upstream_url, *flags, tokenizer=directory) as (url, process),
    ):
        log = work / f"proxy-{url.rsplit(':', 1)[1]}.log"

        async def load() -> tuple[int, float, float]:
            connector = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(connector=connector) as http:

                def calibrate(turn: int) -> None:
                    rule.calibrating = turn

                for _ in range(args.warmup):  # one at a time: learns the turn counts; compiles templates
                    await run_session(http, url, script, tools, calibrate)
                rule.calibrating = None
                nonlocal offset
                offset = log.stat().st_size
                before, started = cpu_seconds(process), time.perf_counter()
                remaining = iter(range(args.sessions))

                async def worker() -> int:
                    return sum([await run_session(http, url, script, tools) for _ in remaining])

                served = sum(await asyncio.gather(*(worker() for _ in range(args.concurrency))))
                return served, cpu_seconds(process) - before, time.perf_counter() - started

        offset = 0
        turns, used, wall = asyncio.run(asyncio.wait_for(load(), args.timeout_s))
        time.sleep(0.2)  # the last log lines
        timings = request_timings(log, offset) if args.log_requests else {}
    if rule.unknown:
        raise Errors(f"{rule.unknown} prompts with an unknown turn")
    result = {
        "name": name,
        "vocabulary": len(tokenizer),
        "tool_call_parser": family.tool_call_parser if family else None,
        "reasoning_parser": family.reasoning_parser if family else None,
        "tools": tools,
        "sessions": args.sessions,
        "turns": turns,
        "proxy_cpu_s": round(used, 3),
        "proxy_cpu_ms_per_turn": round(used / turns * 1000, 3),
        "turns_per_s": round(turns / wall, 1),
        "proxy_cores_used": round(used / wall, 3),
        **timings,
    }
    progress(
        f"{name}: {result['proxy_cpu_ms_per_turn']} ms proxy CPU per turn over {turns} turns "
        f"({result['turns_per_s']} turns/s, {result['proxy_cores_used']} of a core); {timings}"
    )
    return result


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(names):
        mine = [r for r in runs if r["name"] == name]
        cpu = statistics.fmean(r["proxy_cpu_ms_per_turn"] for r in mine)
        tok = statistics.fmean(r.get("mean_tokenize_ms", 0) for r in mine)
        rec = statistics.fmean(r.get("mean_record_ms", 0) for r in mine)
        ax.bar(i, tok, color="tab:orange", label="tokenize_ms" if i == 0 else None)
        ax.bar(i, rec, bottom=tok, color="tab:green", label="record_ms" if i == 0 else None)
        ax.bar(
            i,
            cpu - tok - rec,
            bottom=tok + rec,
            color="tab:blue",
            label="rest (HTTP, JSON, upstream client, log, loop)" if i == 0 else None,
        )
        ax.scatter([i] * len(mine), [r["proxy_cpu_ms_per_turn"] for r in mine], color="k", s=12, zorder=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("proxy CPU per turn (ms)")
    ax.set_title("Proxy CPU per turn: 6-turn tool conversation (test tokenizer: plain turns)")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200, help="measured sessions per run (6 turns each)")
    parser.add_argument("--concurrency", type=int, default=16, help="sessions in flight at once")
    parser.add_argument("--latency-s", type=float, default=0.05, help="the stand-in's latency per reply")
    parser.add_argument("--warmup", type=int, default=5, help="sessions one at a time before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="every tokenizer this many times, interleaved")
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES))
    parser.add_argument("--no-log-requests", dest="log_requests", action="store_false")
    parser.add_argument("--timeout-s", type=float, default=300, help="limit of one run's load")
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    progress(f"1-minute load average at start: {load_average:.2f}")
    with tempfile.TemporaryDirectory(prefix="rf-bench-families-") as tmp:
        work = Path(tmp)
        runs = []
        for round_ in range(args.rounds):
            runs.append({"round": round_, **measure(work, PLAIN, tokenizer_dir(), None, args)})
            for name in args.families:
                family = FAMILIES[name]
                runs.append({"round": round_, **measure(work, name, family.build_cached(), family, args)})
    settings = {
        k: getattr(args, k) for k in ("sessions", "concurrency", "latency_s", "warmup", "log_requests")
    }
    save_result(
        "family_turns",
        {"load_average_1m_at_start": round(load_average, 2), "settings": settings, "runs": runs},
    )
    plot(runs, IMAGES / "family-turns.png")


if __name__ == "__main__":
    main()
