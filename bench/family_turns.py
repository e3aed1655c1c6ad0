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

`--dialects` runs the same conversation in other dialects too (`messages`: Anthropic Messages;
`responses`: OpenAI Responses with the whole input each turn; `responses_previous`: with
`previous_response_id` and only the new items), each its own run, saved apart
(`family_turns_dialects`): per-turn proxy CPU of each dialect against chat's. Beside them, in this
process, the dialect's own work on the conversation's last turn (parsing the request into the chat
turn, rendering the answer and its stream), timed without HTTP or the turn itself.

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
import timeit
from array import array
from dataclasses import dataclass, field, replace
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
from rolloutfleet_proxy.anthropic_messages import MessagesDialect
from rolloutfleet_proxy.chat_dialect import ChatDialect
from rolloutfleet_proxy.dialects import Answered, RequestContext
from rolloutfleet_proxy.openai_responses import ResponsesDialect
from rolloutfleet_proxy.replies import Reply
from rolloutfleet_proxy.turns import Choice, TurnResult
from rolloutfleet_testkit.model_families import FAMILIES, ModelFamily
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import RuledReplies, UpstreamStub
from transformers import AutoTokenizer

# The conversation the tests drive, and the helpers it imports (tests/ and tests/proxy/).
for tests in ("tests", "tests/proxy"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / tests))
from test_dialect_turns import (  # noqa: E402 (needs the path above)
    ANTHROPIC_TOOLS,
    RESPONSES_TOOLS,
    anthropic_request,
    responses_input,
)
from test_family_turns import TOOLS, conversation  # noqa: E402

DIALECT_PATHS = {
    "chat": "/chat/completions",
    "messages": "/v1/messages",
    "responses": "/responses",
    "responses_previous": "/responses",
}

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


def dialect_work_us(dialect: str, family: ModelFamily | None, tokenizer) -> dict:
    """Microseconds the dialect's own code takes on the conversation's last turn (its whole history):
    parse the body into the chat turn; render the answer, and its stream (best of 5 x 200)."""
    dialects = {"chat": ChatDialect, "messages": MessagesDialect, "responses": ResponsesDialect}
    implementation = dialects[dialect.removesuffix("_previous")]()
    script = script_for(family, tokenizer)
    messages: list[dict] = []
    for index, turn in enumerate(script):
        for message in turn.new_messages:
            messages.append(
                {**message, "tool_call_id": f"call_{index - 1}"} if message["role"] == "tool" else message
            )
        if index < len(script) - 1:
            calls = [
                {"id": f"call_{index}", "type": "function", "function": {"name": n, "arguments": "{}"}}
                for n in turn.call_names
            ]
            messages.append(
                {"role": "assistant", "content": "An answer.", "tool_calls": calls}
                if calls
                else {"role": "assistant", "content": "An answer."}
            )
    tools = family is not None
    previous = ("resp_benchsession_9", len(messages) - 1) if dialect == "responses_previous" else None
    raw = json.dumps(dialect_body(dialect, messages, tools, previous))
    context = RequestContext("benchsession", 1024, {}, family.tool_call_parser if family else None, 16, None)
    parsed = implementation.parse(json.loads(raw), context)
    reply = Reply("The answer.", "Some reasoning." if family and family.reasoning_parser else None)
    ids = array("i", range(40))
    result = TurnResult(10, [Choice(10, reply, "stop", ids, array("f", [0.0] * 40))], 2000, 0.0)
    answered = Answered("benchsession", "m", 0, result, parsed, None)  # type: ignore[arg-type]

    def best(work) -> float:
        return round(min(timeit.repeat(work, number=200, repeat=5)) / 200 * 1e6, 1)

    streamed = replace(answered, parsed=replace(parsed, request=replace(parsed.request, stream=True)))
    return {
        "parse_us": best(lambda: implementation.parse(json.loads(raw), context)),
        "answer_us": best(lambda: implementation.answer(answered)),
        "stream_us": best(lambda: b"".join(implementation.answer(streamed))),
        "request_bytes": len(raw),
    }


def dialect_body(dialect: str, messages: list[dict], tools: bool, previous: tuple[str, int] | None) -> dict:
    """The turn's request in `dialect`, from the chat conversation so far (`previous`: the last
    response's id and the messages it covered, for `responses_previous`)."""
    if dialect == "chat":
        return {"model": "m", "messages": messages, "max_tokens": 256, **({"tools": TOOLS} if tools else {})}
    if dialect == "messages":
        request = anthropic_request(messages)
        body = {"model": "m", "max_tokens": 256, "messages": request["messages"]}
        if request["system"]:
            body["system"] = request["system"]
        return body | ({"tools": ANTHROPIC_TOOLS} if tools else {})
    body = {"model": "m", "max_output_tokens": 256, **({"tools": RESPONSES_TOOLS} if tools else {})}
    if dialect == "responses_previous" and previous is not None:
        return body | {"previous_response_id": previous[0], "input": responses_input(messages[previous[1] :])}
    return body | {"input": responses_input(messages)}


def chat_reply(dialect: str, answer: dict) -> dict:
    """The assistant message of an answer in `dialect`, in chat form."""
    if dialect == "chat":
        return answer["choices"][0]["message"]
    reasoning, content, calls = None, "", []
    if dialect == "messages":
        for block in answer["content"]:
            if block["type"] == "thinking":
                reasoning = block["thinking"]
            elif block["type"] == "text":
                content += block["text"]
            elif block["type"] == "tool_use":
                calls.append((block["id"], block["name"], json.dumps(block["input"])))
    else:
        for item in answer["output"]:
            if item["type"] == "reasoning":
                reasoning = item["content"][0]["text"]
            elif item["type"] == "message":
                content += item["content"][0]["text"]
            elif item["type"] == "function_call":
                calls.append((item["call_id"], item["name"], item["arguments"]))
    message: dict = {"role": "assistant", "content": content or None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    return message


async def run_session(
    http: aiohttp.ClientSession,
    url: str,
    script: list[Turn],
    tools: bool,
    on_turn=None,
    dialect: str = "chat",
) -> int:
    async with http.post(f"{url}/v1/sessions", headers=ADMIN, json={}) as response:
        created = await response.json()
    auth = {"Authorization": f"Bearer {created['session_key']}"}
    base = f"{url}/v1/sessions/{created['session_id']}"
    messages: list[dict] = []
    last_calls: list[dict] = []
    previous: tuple[str, int] | None = None
    for index, turn in enumerate(script):
        for message in turn.new_messages:
            if message["role"] == "tool":  # answers the call the proxy returned last turn
                message = {**message, "tool_call_id": last_calls[0]["id"]}
            messages.append(message)
        body = dialect_body(dialect, messages, tools, previous)
        if on_turn is not None:
            on_turn(index)
        async with http.post(base + DIALECT_PATHS[dialect], headers=auth, json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise Errors(f"turn {index}: HTTP {response.status}: {answer}")
        message = chat_reply(dialect, answer)
        if dialect.startswith("responses"):
            previous = (answer["id"], len(messages) + 1)
        last_calls = message.get("tool_calls") or []
        if [c["function"]["name"] for c in last_calls] != turn.call_names:
            raise Errors(f"turn {index}: tool calls {last_calls} instead of {turn.call_names}")
        messages.append(message)
    async with http.post(f"{base}/finish", headers=auth) as response:
        if response.status != 200:
            raise Errors(f"finish: HTTP {response.status}")
    return len(script)


def request_timings(log: Path, offset: int, path: str = "/chat/completions") -> dict:
    """Means of the proxy's per-request timings of the turns (to `path`) logged after `offset`."""
    fields: dict[str, list[float]] = {"tokenize_ms": [], "record_ms": [], "lock_wait_ms": []}
    with log.open("rb") as lines:
        lines.seek(offset)
        for raw in lines:
            if not raw.startswith(b"{"):
                continue
            line = json.loads(raw)
            if line.get("msg") == "request" and str(line.get("path", "")).endswith(path):
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
    dialect: str = "chat",
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
                    await run_session(http, url, script, tools, calibrate, dialect)
                rule.calibrating = None
                nonlocal offset
                offset = log.stat().st_size
                before, started = cpu_seconds(process), time.perf_counter()
                remaining = iter(range(args.sessions))

                async def worker() -> int:
                    return sum(
                        [await run_session(http, url, script, tools, None, dialect) for _ in remaining]
                    )

                served = sum(await asyncio.gather(*(worker() for _ in range(args.concurrency))))
                return served, cpu_seconds(process) - before, time.perf_counter() - started

        offset = 0
        turns, used, wall = asyncio.run(asyncio.wait_for(load(), args.timeout_s))
        time.sleep(0.2)  # the last log lines
        timings = request_timings(log, offset, DIALECT_PATHS[dialect]) if args.log_requests else {}
    if rule.unknown:
        raise Errors(f"{rule.unknown} prompts with an unknown turn")
    result = {
        "name": name,
        "dialect": dialect,
        "in_process": dialect_work_us(dialect, family, tokenizer),
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
        f"{name} ({dialect}): {result['proxy_cpu_ms_per_turn']} ms proxy CPU per turn over {turns} turns "
        f"({result['turns_per_s']} turns/s, {result['proxy_cores_used']} of a core); {timings}"
    )
    return result


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(run: dict) -> str:
        dialect = run.get("dialect", "chat")
        return run["name"] if dialect == "chat" and len(dialects) == 1 else f"{run['name']}\n{dialect}"

    dialects = {r.get("dialect", "chat") for r in runs}
    names = list(dict.fromkeys(label(r) for r in runs))
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4))
    for i, name in enumerate(names):
        mine = [r for r in runs if label(r) == name]
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
    parser.add_argument(
        "--dialects", nargs="+", default=["chat"], choices=sorted(DIALECT_PATHS), help="each its own run"
    )
    parser.add_argument("--no-log-requests", dest="log_requests", action="store_false")
    parser.add_argument("--timeout-s", type=float, default=300, help="limit of one run's load")
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    progress(f"1-minute load average at start: {load_average:.2f}")
    with tempfile.TemporaryDirectory(prefix="rf-bench-families-") as tmp:
        work = Path(tmp)
        runs = []
        for round_ in range(args.rounds):
            for dialect in args.dialects:
                runs.append({"round": round_, **measure(work, PLAIN, tokenizer_dir(), None, args, dialect)})
                for name in args.families:
                    family = FAMILIES[name]
                    run = measure(work, name, family.build_cached(), family, args, dialect)
                    runs.append({"round": round_, **run})
    keys = ("sessions", "concurrency", "latency_s", "warmup", "log_requests", "dialects")
    settings = {k: getattr(args, k) for k in keys}
    # Runs of several dialects are saved apart: the chat-only result stays what docs/benchmarks.md cites.
    name = "family_turns" if args.dialects == ["chat"] else "family_turns_dialects"
    save_result(
        name,
        {
            "command": " ".join(["./dev", "bench", "family_turns", *sys.argv[1:]]),  # the file's name
            "load_average_1m_at_start": round(load_average, 2),
            "settings": settings,
            "runs": runs,
        },
    )
    plot(runs, IMAGES / f"{name.replace('_', '-')}.png")


if __name__ == "__main__":
    main()
