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

from common import progress, proxy_args, save_result
from rolloutfleet_proxy import journal_records as jr
from rolloutfleet_proxy.ids import key_digest
from rolloutfleet_proxy.journal import journal_dir, segment_path
from rolloutfleet_proxy.recovery import recover
from rolloutfleet_proxy.settings import ProxySettings  # noqa: F401 (the proxy's settings load here too)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-bench-restart-") as tmp:
        work = Path(tmp)
        dumps = work / "dumps"
        progress(f"writing the journal of {args.sessions} sessions x {args.tokens} tokens")
        journal_bytes = write_killed_journal(dumps, args.sessions, args.tokens, args.turns)
        progress(f"journal: {journal_bytes / 2**20:.1f} MiB")
        results = [asyncio.run(time_until_ready(dumps, work, "journal-only"))]
        progress(f"journal only: ready after {results[-1]['seconds_until_ready']} s")
        # Compact it as a running proxy would (snapshots in live/, segments retired), then again.
        from rolloutfleet_proxy.dumps import LIVE_AREA, write_session_dump

        recovered = recover(dumps)
        for session in recovered.sessions.values():
            write_session_dump(dumps, LIVE_AREA, session.copied_record(), "snapshot")
        for path in journal_dir(dumps).iterdir():
            path.unlink()
        del recovered
        results.append(asyncio.run(time_until_ready(dumps, work, "snapshots")))
        progress(f"snapshots: ready after {results[-1]['seconds_until_ready']} s")
    save_result(
        "restart",
        {
            "sessions": args.sessions,
            "tokens_per_session": args.tokens,
            "turns_per_session": args.turns,
            "journal_bytes": journal_bytes,
            "journal_bytes_per_token": round(journal_bytes / (args.sessions * args.tokens), 2),
            "cpus": os.cpu_count(),
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
