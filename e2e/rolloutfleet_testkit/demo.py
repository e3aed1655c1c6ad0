"""`rolloutfleet-demo --local`: the proxy in front of the SGLang emulator, sessions through it, /stats.

Without --local, `rolloutfleet-demo` runs the same on the local Kubernetes cluster (cluster_demo.py).

Everything runs as real local processes on 127.0.0.1: the SGLang emulator (a test stand-in for a
GPU SGLang server), the proxy, and rollout sessions sent with the official `openai` client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from rolloutfleet_testkit.cache import project_cache
from rolloutfleet_testkit.processes import ServerProcess, free_ports, proxy_command, python_module
from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer

ADMIN_KEY = "demo-admin-key"
QUESTIONS = [
    ["What is two plus two?", "And times three?", "Explain it to a child."],
    ["Name a colour.", "Why that one?"],
    ["Write a short poem about rivers.", "Make it rhyme.", "Shorter, please.", "Thanks!"],
]


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


async def run_session(proxy_url: str, questions: list[str], index: int, admin_key: str = ADMIN_KEY) -> dict:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as admin:
        created = (
            await admin.post(
                "/v1/sessions",
                headers={"Authorization": f"Bearer {admin_key}"},
                json={"metadata": {"demo_rollout": index}},
            )
        ).json()
        sid, key = created["session_id"], created["session_key"]
        client = AsyncOpenAI(base_url=f"{proxy_url}/v1/sessions/{sid}", api_key=key, max_retries=0)
        messages: list[dict] = [{"role": "system", "content": "You are a terse assistant."}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            reply = await client.chat.completions.create(
                model="rolloutfleet", messages=messages, max_tokens=24, temperature=0.8, seed=index
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        auth = {"Authorization": f"Bearer {key}"}
        await admin.post(f"/v1/sessions/{sid}/reward", headers=auth, json={"reward": float(index)})
        await admin.post(f"/v1/sessions/{sid}/finish", headers=auth)
        summary = (await admin.get(f"/v1/sessions/{sid}", headers=auth, params={"tokens": "true"})).json()
        await client.close()
        return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="where logs and dumps go (default: temp)")
    parser.add_argument(
        "--local",
        action="store_true",
        help="plain local processes only, no cluster (the default runs on the local cluster)",
    )
    args = parser.parse_args(argv)
    if not args.local:
        from rolloutfleet_testkit.cluster_demo import main as cluster_main

        return cluster_main()
    cache = project_cache()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rolloutfleet-demo-"))
    work.mkdir(parents=True, exist_ok=True)

    step("building the local test tokenizer (no hub downloads)")
    tokenizer_dir = build_test_tokenizer(cache / "test-tokenizer")
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"

    step(f"starting the SGLang emulator (test stand-in for SGLang) on {engine_url}")
    with ServerProcess(
        python_module(
            "rolloutfleet_testkit.sglang_emulator.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(engine_port),
            "--tokenizer-path",
            str(tokenizer_dir),
        ),
        work / "engine.log",
    ) as engine:
        engine.wait_ready(f"{engine_url}/health", 120)
        step(f"starting the proxy on {proxy_url} (dumps in {work / 'dumps'})")
        proxy = ServerProcess(
            proxy_command(
                "--host",
                "127.0.0.1",
                "--port",
                str(proxy_port),
                "--upstream-url",
                engine_url,
                "--tokenizer-path",
                str(tokenizer_dir),
                "--dump-dir",
                str(work / "dumps"),
                "--public-url",
                proxy_url,
            ),
            work / "proxy.log",
            env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY},
        )
        try:
            proxy.wait_ready(f"{proxy_url}/readyz", 120)
            step(f"running {len(QUESTIONS)} multi-turn sessions concurrently with the openai client")

            async def all_sessions() -> list[dict]:
                return await asyncio.gather(*(run_session(proxy_url, q, i) for i, q in enumerate(QUESTIONS)))

            for summary in asyncio.run(all_sessions()):
                trajectory = summary["trajectory"]
                print(
                    f"    session {summary['session_id']}: {summary['num_turns']} turns, "
                    f"{summary['num_tokens']} tokens, {sum(trajectory['loss_mask'])} generated, "
                    f"reward {summary['reward']}, finished {summary['finished']}"
                )
            step("GET /stats")
            print(json.dumps(httpx.get(f"{proxy_url}/stats").json(), indent=2))
        finally:
            step("SIGTERM to the proxy: it drains and writes live sessions to the dump directory")
            code = proxy.terminate(60)
        live = sorted((work / "dumps" / "live").glob("*.safetensors"))
        print(f"    proxy exited with {code}; {len(live)} session files in {work / 'dumps' / 'live'}")
    step(f"done; logs in {work}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
