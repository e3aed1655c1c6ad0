"""Proxy CPU per turn with real tokenizers and chat templates: a 6-turn tool conversation per session.

For each model family of the test kit (real vocabularies: Qwen's 151k ranks, DeepSeek V3's 128k
tokenizer.json) the proxy runs as its own process with the family's SGLang tool-call and reasoning
parsers, in front of the scripted SGLang stand-in, which answers with replies written in the
family's own format (reasoning, tool calls, stop token). Sessions run the conversation of
`tests/test_family_turns.py` (tools in every request, tool results answering the calls); the proxy
process's CPU seconds over the turns it served give CPU per turn. The same is measured with the test
tokenizer (ChatML, 1,000 tokens) and plain replies: today's figure before real templates.

Sessions run one at a time (the stand-in answers in order); CPU per turn does not depend on
concurrency, and throughput under concurrency is `./dev bench overhead --family qwen3`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ADMIN, cpu_seconds, progress, proxy_process, save_result, tokenizer_dir
from rolloutfleet_testkit.model_families import FAMILIES, ModelFamily
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_family_turns import TOOLS, conversation

PLAIN = "test-tokenizer"


def measure(
    work: Path, name: str, directory: Path, family: ModelFamily | None, sessions: int, warmup: int
) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    stops = (
        [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
        if family
        else [tokenizer.eos_token_id]
    )
    upstream = ScriptedUpstream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stops)
    flags = ["--no-log-requests"]
    if family is not None:
        flags += ["--tool-call-parser", family.tool_call_parser]
        if family.reasoning_parser:
            flags += ["--reasoning-parser", family.reasoning_parser]
    script = conversation(family) if family else None
    with (
        serve_app(upstream) as upstream_url,
        proxy_process(work, upstream_url, *flags, tokenizer=directory) as (
            url,
            process,
        ),
    ):
        http = httpx.Client(timeout=60)

        def run_session() -> int:
            sid = http.post(f"{url}/v1/sessions", headers=ADMIN).json()
            auth = {"Authorization": f"Bearer {sid['session_key']}"}
            chat = f"{url}/v1/sessions/{sid['session_id']}/chat/completions"
            messages: list[dict] = []
            last_calls: list[dict] = []
            turns = 0
            for turn in range(6):
                if script is not None:
                    new, (reasoning, content, calls) = script[turn]
                    for message in new:
                        if message["role"] == "tool":
                            message = {**message, "tool_call_id": last_calls[0]["id"]}
                        messages.append(message)
                    reply = family.model_reply_text(reasoning, content, calls)
                    body = {"messages": messages, "tools": TOOLS, "max_tokens": 256}
                else:
                    messages.append({"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"})
                    reply = f"The answer is {2 * turn}, since {turn} plus {turn} makes {2 * turn}.<|im_end|>"
                    body = {"messages": messages, "max_tokens": 256}
                upstream.script(tokenizer.encode(reply, add_special_tokens=False))
                answer = http.post(chat, headers=auth, json=body)
                answer.raise_for_status()
                message = answer.json()["choices"][0]["message"]
                last_calls = message.get("tool_calls") or []
                messages.append(message)
                turns += 1
            http.post(f"{chat.removesuffix('/chat/completions')}/finish", headers=auth).raise_for_status()
            return turns

        for _ in range(warmup):  # first renders compile the template; imports settle
            run_session()
        before, started = cpu_seconds(process), time.perf_counter()
        turns = sum(run_session() for _ in range(sessions))
        used, wall = cpu_seconds(process) - before, time.perf_counter() - started
        http.close()
    result = {
        "name": name,
        "vocabulary": len(tokenizer),
        "tool_call_parser": family.tool_call_parser if family else None,
        "reasoning_parser": family.reasoning_parser if family else None,
        "sessions": sessions,
        "turns": turns,
        "proxy_cpu_s": round(used, 3),
        "proxy_cpu_ms_per_turn": round(used / turns * 1000, 3),
        "wall_ms_per_turn": round(wall / turns * 1000, 3),
    }
    progress(f"{name}: {result['proxy_cpu_ms_per_turn']} ms proxy CPU per turn over {turns} turns")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100, help="sessions per family (6 turns each)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-bench-families-") as tmp:
        work = Path(tmp)
        runs = [measure(work, PLAIN, tokenizer_dir(), None, args.sessions, args.warmup)]
        for name in args.families:
            family = FAMILIES[name]
            runs.append(measure(work, name, family.build_cached(), family, args.sessions, args.warmup))
    save_result("family_turns", {"runs": runs})
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
