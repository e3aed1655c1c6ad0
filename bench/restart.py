"""Restart after a SIGKILL: time until a proxy is ready again, holding S sessions x T tokens.

The dump directory is written as a killed proxy leaves it: only the journal (no drain, no
compaction), with the exact record bytes the proxy writes (journal_records). Then a fresh proxy
process starts on it; measured: spawn to /readyz 200, and the restore alone (its log line). A
second case restores the same sessions from compacted snapshots in live/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from array import array
from pathlib import Path

from common import IMAGES, progress, proxy_args, save_figure, save_result
from rolloutfleet_proxy.ids import key_digest
from rolloutfleet_proxy.session import RecordedTurn
from rolloutfleet_proxy.storage import journal_records as jr
from rolloutfleet_proxy.storage.dumps import LIVE_AREA, write_session_dump
from rolloutfleet_proxy.storage.journal import journal_dir, segment_path
from rolloutfleet_proxy.storage.restore import recover
from rolloutfleet_testkit.processes import ServerProcess, free_port

ADMIN_KEY = "bench-admin-key"


def write_killed_journal(dump_dir: Path, sessions: int, tokens: int, turns: int) -> int:
    """The journal of S sessions of `turns` turns each (half prompt, half output); returns bytes."""
    directory = journal_dir(dump_dir)
    directory.mkdir(parents=True, exist_ok=True)
    per_side = tokens // (2 * turns)
    written = 0
    segment = 1
    out = open(segment_path(directory, segment), "wb")  # noqa: SIM115
    for s in range(sessions):
        sid = f"bench-session-{s:06d}"
        key = key_digest(sid)
        parts = [jr.create_record(sid, key, 1.0, {"task": s})]
        for t in range(turns):
            parts.append(
                jr.turn_record(
                    sid,
                    key,
                    t,
                    RecordedTurn(
                        array("i", range(1000 + t, 1000 + t + per_side)),
                        array("i", range(2000, 2000 + per_side)),
                        array("f", [-0.25] * per_side),
                        message_count=2 * (t + 1),
                        history_digest=bytes(32),
                        stopped=True,
                        stop_token=2000 + per_side - 1,
                        model_version=0,
                        version_changes=[],
                        temperature=1.0,
                        tempered=True,
                    ),
                )
            )
        data = b"".join(parts)
        out.write(data)
        written += len(data)
        if out.tell() > 256 * 1024 * 1024:
            out.close()
            segment += 1
            out = open(segment_path(directory, segment), "wb")  # noqa: SIM115
    out.close()
    return written


async def time_until_ready(dump_dir: Path, work: Path, label: str) -> dict:
    import httpx

    port = free_port()
    log = work / f"proxy-{label}.log"
    args = proxy_args(work, port, "http://127.0.0.1:1", "--no-log-requests")
    args[args.index("--dump-dir") + 1] = str(dump_dir)
    started = time.monotonic()
    process = ServerProcess(args, log, env={"ROLLOUTFLEET_PROXY_ADMIN_KEY": ADMIN_KEY})
    try:
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.process.poll() is not None:
                    raise RuntimeError(process.log_tail())
                await asyncio.sleep(0.02)
            ready_s = time.monotonic() - started
            stats = (await client.get(f"http://127.0.0.1:{port}/stats")).json()
    finally:
        process.process.kill()  # SIGKILL again: nothing is compacted or drained
        process.process.wait()
        process.terminate()
    restored = next(
        json.loads(line)
        for line in log.read_text().splitlines()
        if '"msg":"restored"' in line.replace(" ", "")
    )
    return {
        "case": label,
        "seconds_until_ready": round(ready_s, 3),
        "restore_seconds": restored["seconds"],
        "sessions_restored": stats["live_sessions"],
        "tokens_held": stats["tokens_held"],
        "rss_bytes_after_restore": stats["rss_bytes"],
        "lost": stats["sessions_lost"],
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for case, label in (
        ("journal-only", "after SIGKILL (journal replay)"),
        ("snapshots", "after compaction (snapshots)"),
    ):
        points = sorted(
            (r["sessions"], r["seconds_until_ready"], r["restore_seconds"]) for r in runs if r["case"] == case
        )
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", label=f"{label}: spawn to ready")
        ax.plot(xs, [p[2] for p in points], marker="x", linestyle="--", label=f"{label}: restore alone")
    ax.axhline(5.0, color="k", linestyle=":", linewidth=1, label="goal 5 s")
    ax.set_xlabel("sessions held (2,000 tokens each)")
    ax.set_ylabel("seconds")
    ax.set_title("Restart time")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1000, 2500, 5000])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    runs = []
    journal_sizes = {}
    for sessions in args.sessions:
        with tempfile.TemporaryDirectory(prefix="rf-bench-restart-") as tmp:
            work = Path(tmp)
            dumps = work / "dumps"
            progress(f"writing the journal of {sessions} sessions x {args.tokens} tokens")
            journal_bytes = write_killed_journal(dumps, sessions, args.tokens, args.turns)
            journal_sizes[sessions] = journal_bytes
            progress(f"journal: {journal_bytes / 2**20:.1f} MiB")
            runs.append({"sessions": sessions, **asyncio.run(time_until_ready(dumps, work, "journal-only"))})
            progress(f"journal only: ready after {runs[-1]['seconds_until_ready']} s")
            # Compacted as a running proxy would: snapshots in live/, segments retired.
            recovered = recover(dumps)
            for session in recovered.sessions.values():
                write_session_dump(dumps, LIVE_AREA, session.copied_record(), "snapshot")
            for path in journal_dir(dumps).iterdir():
                path.unlink()
            del recovered
            runs.append({"sessions": sessions, **asyncio.run(time_until_ready(dumps, work, "snapshots"))})
            progress(f"snapshots: ready after {runs[-1]['seconds_until_ready']} s")
    largest = max(args.sessions)
    save_result(
        "restart",
        {
            "tokens_per_session": args.tokens,
            "turns_per_session": args.turns,
            "journal_bytes": journal_sizes,
            "journal_bytes_per_token": round(journal_sizes[largest] / (largest * args.tokens), 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "runs": runs,
        },
    )
    plot(runs, IMAGES / "restart.png")


if __name__ == "__main__":
    main()
