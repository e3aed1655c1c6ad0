"""Polling the proxies' `GET /stats` for the memory watchdog: concurrent, bounded, never raising.

Each poll becomes a `watchdog.Sample`: the `rss_bytes` the proxy reported (see
`rolloutfleet_proxy.stats.build_stats`), or a `PollFailure` with a short reason for anything else
(refused, timed out, non-200, not JSON, no usable `rss_bytes`). The watchdog never restarts a
proxy on a failure, so turning every error into a failure sample is safe; only cancellation of
the whole poll propagates.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import aiohttp

from .watchdog import PollFailure, RssSample, Sample

RSS_FIELD = "rss_bytes"
# A /stats document is well under a kilobyte; anything near this is not a proxy answering.
MAX_STATS_BYTES = 1 << 20
_CHUNK_BYTES = 64 << 10
_MAX_REASON_CHARS = 160


def stats_url(pod_ip: str, port: int) -> str:
    """The URL of a proxy pod's /stats by its pod IP (IPv6 addresses get brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/stats"


async def poll_stats(
    targets: Iterable[tuple[str, str]],
    *,
    timeout_s: float,
    concurrency: int,
    session: aiohttp.ClientSession,
) -> dict[str, Sample]:
    """Poll every (pod name, /stats URL) target; returns pod name -> sample.

    At most `concurrency` requests are in flight at once; each gets `timeout_s` seconds from the
    moment it starts (waiting for a slot does not count) to the end of reading its answer. So the
    whole poll takes at most about ceil(len(targets) / concurrency) * timeout_s. The session's own
    timeouts and connection limit apply as well; reuse one session across cycles to keep
    connections alive.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    slots = asyncio.Semaphore(concurrency)

    async def poll_one(url: str) -> Sample:
        async with slots:
            try:
                async with asyncio.timeout(timeout_s):
                    return await _fetch_rss(session, url)
            except TimeoutError:
                return PollFailure(f"no answer within {timeout_s:g}s")
            except Exception as exc:  # any failure to poll is a failure sample, never an error
                return PollFailure(_short(f"{type(exc).__name__}: {exc}"))

    targets = list(targets)
    samples = await asyncio.gather(*(poll_one(url) for _, url in targets))
    return {pod: sample for (pod, _), sample in zip(targets, samples, strict=True)}


async def _fetch_rss(session: aiohttp.ClientSession, url: str) -> Sample:
    async with session.get(url, allow_redirects=False) as response:
        if response.status != 200:
            return PollFailure(f"HTTP {response.status}")
        too_large = PollFailure(f"answer larger than {MAX_STATS_BYTES} bytes")
        if (response.content_length or 0) > MAX_STATS_BYTES:
            return too_large
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            body += chunk
            if len(body) > MAX_STATS_BYTES:
                return too_large
    return parse_stats(bytes(body))


def parse_stats(body: bytes) -> Sample:
    """The sample in a /stats answer body: its `rss_bytes`, a non-negative integer."""
    try:
        document = json.loads(body)
    except ValueError:  # also UnicodeDecodeError
        return PollFailure("answer is not JSON")
    if not isinstance(document, dict):
        return PollFailure("answer is not a JSON object")
    rss = document.get(RSS_FIELD)
    # bool is an int in Python, but `true` is no byte count.
    if not isinstance(rss, int) or isinstance(rss, bool) or rss < 0:
        return PollFailure(f"answer has no non-negative integer {RSS_FIELD}")
    storage = document.get("storage")
    storage_error = None
    if isinstance(storage, dict) and storage.get("writable") is False:
        storage_error = _short(str(storage.get("reason") or "its dump volume refuses writes"))
    return RssSample(rss, storage_error)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."
