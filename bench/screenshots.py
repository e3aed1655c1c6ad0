"""Screenshot sessions: one computer-use style session of T turns, each adding a new 1280x720
screenshot and re-sending the whole history (every earlier screenshot too, as agents do), through the
proxy (its own process, a Qwen2.5-VL model directory with Qwen's vocabulary) in front of the SGLang
emulator (a stand-in for a GPU engine, which takes images as SGLang's Qwen-VL path does), on loopback.

Measured: the proxy's RSS sampled every 5 ms against the session's unique image bytes (goal, issue
#27: peak growth over the post-start baseline below 2 x unique image bytes + 64 MiB), the proxy's CPU
per turn and per image it received, the disk bytes per unique image (`images/` on the dump volume),
and the export of the finished session (batch size, RSS).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    ADMIN,
    RssSampler,
    cpu_seconds,
    progress,
    proxy_process,
    save_result,
    sglang_emulators,
)
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.screenshots import screenshot

MIB = 1024 * 1024


def directory_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=45)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--family", default="qwen25_vl", choices=sorted(VL_FAMILIES))
    args = parser.parse_args()
    model_dir = VL_FAMILIES[args.family].build_cached()
    progress(f"drawing {args.turns} screenshots of {args.width}x{args.height}")
    shots = [screenshot(args.width, args.height, seed=1000 + turn) for turn in range(args.turns)]
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(s).decode()}}
        for s in shots
    ]
    unique_bytes = sum(len(s) for s in shots)
    with tempfile.TemporaryDirectory(prefix="rf-bench-screenshots-") as tmp:
        work = Path(tmp)
        # Every screenshot's tokens stay in the prompt: the context must hold them all.
        context = 4096 + args.turns * 1300
        with (
            sglang_emulators(
                work,
                1,
                "--context-length",
                str(context),
                "--cache-capacity-tokens",
                str(4 * context),
                tokenizer=model_dir,
            ) as (engine,),
            proxy_process(
                work, engine, "--no-log-requests", "--cleanup-interval-s", "2", tokenizer=model_dir
            ) as (
                url,
                proxy,
            ),
            httpx.Client(base_url=url, timeout=600) as http,
        ):
            time.sleep(3)  # a cleanup cycle after start
            rss_baseline = proxy.memory_info().rss
            created = http.post("/v1/sessions", headers=ADMIN, json={}).json()
            chat = f"/v1/sessions/{created['session_id']}/chat/completions"
            auth = {"Authorization": f"Bearer {created['session_key']}", "content-type": "application/json"}
            messages: list[dict] = []
            turns: list[dict] = []
            with RssSampler(proxy) as sampler:
                for turn in range(args.turns):
                    messages.append(
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": f"Step {turn}: next?"}, parts[turn]],
                        }
                    )
                    body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()
                    cpu_before, started = cpu_seconds(proxy), time.perf_counter()
                    answer = http.post(chat, content=body, headers=auth)
                    seconds = time.perf_counter() - started
                    cpu = cpu_seconds(proxy) - cpu_before
                    if answer.status_code != 200:
                        raise SystemExit(f"turn {turn}: {answer.status_code} {answer.text[:500]}")
                    messages.append(answer.json()["choices"][0]["message"])
                    turns.append(
                        {
                            "turn": turn,
                            "images_sent": turn + 1,
                            "body_bytes": len(body),
                            "seconds": round(seconds, 4),
                            "proxy_cpu_s": round(cpu, 4),
                            "rss_peak_bytes": max(sampler.samples),
                        }
                    )
                    if turn % 5 == 0 or turn == args.turns - 1:
                        progress(
                            f"turn {turn}: body {len(body) / MIB:.1f} MiB, {seconds:.2f} s, proxy CPU "
                            f"{cpu * 1000:.0f} ms, RSS peak {max(sampler.samples) / MIB:.0f} MiB"
                        )
                rss_peak_session = max(sampler.samples)
                del body, messages
                files, disk_bytes = directory_bytes(work / f"dumps-{url.rsplit(':', 1)[1]}" / "images")
                # The finished session exported (with its images) and acknowledged.
                http.post(f"{chat.rsplit('/chat', 1)[0]}/finish", headers=auth).raise_for_status()
                cpu_before = cpu_seconds(proxy)
                exported = http.post("/v1/exports", headers=ADMIN, json={"max_trajectories": 1})
                export_cpu = cpu_seconds(proxy) - cpu_before
                exported.raise_for_status()
                batch_id = exported.headers["x-rolloutfleet-batch-id"]
                batch_bytes = len(exported.content)
                http.post(f"/v1/exports/{batch_id}/ack", headers=ADMIN).raise_for_status()
                rss_peak_export = max(sampler.samples)
            stats = http.get("/stats").json()
    growth = rss_peak_session - rss_baseline
    goal = 2 * unique_bytes + 64 * MIB
    cpu_per_turn = [t["proxy_cpu_s"] for t in turns]
    images_received = sum(t["images_sent"] for t in turns)
    result = {
        "family": args.family,
        "turns": args.turns,
        "screenshot": f"{args.width}x{args.height} PNG",
        "unique_images": len(shots),
        "unique_image_bytes": unique_bytes,
        "last_body_bytes": turns[-1]["body_bytes"],
        "rss_baseline_bytes": rss_baseline,
        "rss_peak_bytes": rss_peak_session,
        "rss_peak_growth_bytes": growth,
        "rss_goal_growth_bytes": goal,
        "rss_goal_met": growth <= goal,
        "rss_peak_with_export_bytes": rss_peak_export,
        "proxy_cpu_s_total": round(sum(cpu_per_turn), 3),
        "proxy_cpu_s_per_turn": {
            "first": cpu_per_turn[0],
            "median": round(statistics.median(cpu_per_turn), 4),
            "last": cpu_per_turn[-1],
        },
        "proxy_cpu_ms_per_image_received": round(1000 * sum(cpu_per_turn) / images_received, 3),
        "images_received": images_received,
        "images_stored": stats["totals"].get("images_stored"),
        "image_files": files,
        "image_disk_bytes": disk_bytes,
        "disk_bytes_per_unique_image": round(disk_bytes / max(1, files)),
        "png_bytes_per_unique_image": round(unique_bytes / len(shots)),
        "export_batch_bytes": batch_bytes,
        "export_proxy_cpu_s": round(export_cpu, 4),
        "turn_seconds_last": turns[-1]["seconds"],
        "per_turn": turns,
    }
    save_result("screenshots", result)
    progress(
        f"RSS baseline {rss_baseline / MIB:.0f} MiB, peak {rss_peak_session / MIB:.0f} MiB "
        f"(+{growth / MIB:.1f} MiB; goal +{goal / MIB:.1f} MiB: {'met' if growth <= goal else 'NOT met'}); "
        f"unique images {unique_bytes / MIB:.1f} MiB; CPU "
        f"{1000 * sum(cpu_per_turn) / images_received:.1f} ms per image received, last turn "
        f"{cpu_per_turn[-1] * 1000:.0f} ms; disk {disk_bytes / max(1, files):.0f} B per image ({files} files)"
    )


if __name__ == "__main__":
    main()
