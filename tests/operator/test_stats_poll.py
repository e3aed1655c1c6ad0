"""The watchdog's /stats poller against real HTTP servers on loopback sockets."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from fastapi import FastAPI, Response
from fastapi.responses import StreamingResponse
from rolloutfleet_operator.stats_poll import MAX_STATS_BYTES, parse_stats, poll_stats, stats_url
from rolloutfleet_operator.watchdog import PollFailure, RssSample
from rolloutfleet_proxy.stats import Counters, Gauges, build_stats
from rolloutfleet_testkit.processes import free_port, serve_app

SLOW_S = 0.3


def proxy_like_app() -> FastAPI:
    """Answers like proxies in various states, one per path prefix; /slow counts its concurrency."""
    app = FastAPI()
    # Per group of requests (a path segment), so that timed-out requests of other tests that are
    # still sleeping on the server do not count.
    app.state.in_flight = collections.Counter()
    app.state.max_in_flight = collections.Counter()

    @app.get("/ok/stats")
    async def ok() -> dict:
        # The real proxy's document, so the poller is held to the proxy's field names.
        return build_stats(Counters(), Gauges(), live_sessions=0, detached_sessions=0, tokens_held=0)

    @app.get("/fixed/{rss}/stats")
    async def fixed(rss: int) -> dict:
        return {"rss_bytes": rss}

    @app.get("/error/stats")
    async def error() -> Response:
        return Response("boom", status_code=500)

    @app.get("/garbage/stats")
    async def garbage() -> Response:
        return Response("<html>not json</html>", media_type="text/html")

    @app.get("/huge/stats")
    async def huge() -> Response:
        return Response(b" " * (MAX_STATS_BYTES + 10), media_type="application/json")

    @app.get("/huge-stream/stats")
    async def huge_stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(40):
                yield b" " * (64 << 10)

        # Streamed without a Content-Length: the poller must stop reading by itself.
        return StreamingResponse(chunks(), media_type="application/json")

    @app.get("/slow/{group}/{delay}/stats")
    async def slow(group: str, delay: float) -> dict:
        app.state.in_flight[group] += 1
        app.state.max_in_flight[group] = max(app.state.max_in_flight[group], app.state.in_flight[group])
        try:
            await asyncio.sleep(delay)
        finally:
            app.state.in_flight[group] -= 1
        return {"rss_bytes": 123}

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    app = proxy_like_app()
    with serve_app(app, timeout_graceful_shutdown=3) as url:
        yield url, app


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_every_kind_of_answer_becomes_a_sample(server, session):
    url, _ = server
    closed = f"http://127.0.0.1:{free_port()}/stats"
    targets = [
        ("ok", f"{url}/ok/stats"),
        ("fixed", f"{url}/fixed/5368709120/stats"),
        ("error", f"{url}/error/stats"),
        ("garbage", f"{url}/garbage/stats"),
        ("huge", f"{url}/huge/stats"),
        ("huge-stream", f"{url}/huge-stream/stats"),
        ("slow", f"{url}/slow/mixed/1.5/stats"),
        ("closed", closed),
        ("missing", f"{url}/nowhere"),
    ]
    started = time.perf_counter()
    samples = await poll_stats(targets, timeout_s=0.5, concurrency=8, session=session)
    elapsed = time.perf_counter() - started
    assert set(samples) == {name for name, _ in targets}
    assert isinstance(samples["ok"], RssSample) and samples["ok"].rss_bytes > 1 << 20  # a real process
    assert samples["fixed"] == RssSample(5 << 30)
    assert samples["error"] == PollFailure("HTTP 500")
    assert samples["missing"] == PollFailure("HTTP 404")
    assert samples["garbage"] == PollFailure("answer is not JSON")
    too_large = PollFailure(f"answer larger than {MAX_STATS_BYTES} bytes")
    assert samples["huge"] == too_large and samples["huge-stream"] == too_large
    assert samples["slow"] == PollFailure("no answer within 0.5s")
    closed_sample = samples["closed"]
    assert isinstance(closed_sample, PollFailure) and "Connect" in closed_sample.reason
    assert len(closed_sample.reason) <= 160
    # The slow target bounds the whole poll: one timeout, not its 1.5 s delay.
    assert 0.5 <= elapsed < 1.5


@pytest.mark.parametrize(("count", "concurrency"), [(6, 2), (7, 3), (4, 4), (3, 1)])
async def test_concurrency_is_bounded_and_waiting_for_a_slot_is_not_timed(
    server, session, count, concurrency
):
    url, app = server
    group = f"{count}-{concurrency}"
    targets = [(f"p{i}", f"{url}/slow/{group}/{SLOW_S}/stats") for i in range(count)]
    started = time.perf_counter()
    # Each call has 2 delays' time, the whole poll takes up to count delays: calls are timed
    # from the moment they get a slot.
    samples = await poll_stats(targets, timeout_s=2 * SLOW_S, concurrency=concurrency, session=session)
    elapsed = time.perf_counter() - started
    assert samples == {f"p{i}": RssSample(123) for i in range(count)}
    assert app.state.max_in_flight[group] == concurrency
    rounds = math.ceil(count / concurrency)
    assert rounds * SLOW_S <= elapsed < rounds * SLOW_S + 0.6


async def test_timeouts_cost_one_timeout_per_round(server, session):
    url, _ = server
    targets = [(f"p{i}", f"{url}/slow/timeouts/1.5/stats") for i in range(4)]
    started = time.perf_counter()
    samples = await poll_stats(targets, timeout_s=0.2, concurrency=2, session=session)
    elapsed = time.perf_counter() - started
    assert all(s == PollFailure("no answer within 0.2s") for s in samples.values())
    assert 0.4 <= elapsed < 1.0


async def test_no_targets_and_bad_concurrency(session):
    assert await poll_stats([], timeout_s=1, concurrency=1, session=session) == {}
    with pytest.raises(ValueError, match="concurrency"):
        await poll_stats([("p", "http://127.0.0.1:1/stats")], timeout_s=1, concurrency=0, session=session)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"rss_bytes": 736980992, "vms_bytes": 1}', RssSample(736980992)),
        (b'{"rss_bytes": 0}', RssSample(0)),
        (b'{"rss_bytes": -1}', None),
        (b'{"rss_bytes": "736980992"}', None),
        (b'{"rss_bytes": 1.5}', None),
        (b'{"rss_bytes": true}', None),
        (b'{"rss": 5}', None),
        (b"[1, 2]", PollFailure("answer is not a JSON object")),
        (b"", PollFailure("answer is not JSON")),
        (b"\xff\xfe", PollFailure("answer is not JSON")),
    ],
)
def test_parse_stats(body, expected):
    sample = parse_stats(body)
    if expected is None:
        assert sample == PollFailure("answer has no non-negative integer rss_bytes")
    else:
        assert sample == expected


def test_stats_url():
    assert stats_url("10.1.2.3", 8000) == "http://10.1.2.3:8000/stats"
    assert stats_url("fd00::5", 8000) == "http://[fd00::5]:8000/stats"


def test_a_proxy_that_cannot_persist_is_named_in_the_storage_condition():
    from rolloutfleet_operator.stats_poll import parse_stats
    from rolloutfleet_operator.watchdog import PollFailure, RssSample, storage_condition, storage_reports

    failing = parse_stats(
        b'{"rss_bytes": 5, "storage": {"writable": false, '
        b'"reason": "OSError: [Errno 30] Read-only file system"}}'
    )
    healthy = parse_stats(b'{"rss_bytes": 7, "storage": {"writable": true, "reason": ""}}')
    assert failing == RssSample(5, "OSError: [Errno 30] Read-only file system")
    assert healthy == RssSample(7, None)
    uids = {"f-proxy-0": "u0", "f-proxy-1": "u1", "f-proxy-2": "u2"}
    samples = {"f-proxy-1": failing, "f-proxy-0": healthy, "f-proxy-2": PollFailure("HTTP 503")}
    reports = storage_reports({}, samples, uids)
    condition = storage_condition(reports)
    assert (condition.type, condition.status, condition.reason) == (
        "StorageWritable",
        "False",
        "CannotPersist",
    )
    assert "f-proxy-1 (OSError: [Errno 30] Read-only file system)" in condition.message
    assert "f-proxy-0" not in condition.message
    assert storage_condition(storage_reports({}, {"f-proxy-0": healthy}, uids)).status == "True"
    assert (
        storage_condition(storage_reports({}, {"f-proxy-0": PollFailure("refused")}, uids)).status
        == "Unknown"
    )


def test_a_proxy_that_cannot_persist_stays_reported_until_it_is_replaced():
    """The unwritable proxy fails /readyz on purpose; a failed poll of it (busy, restarting) keeps
    its last report, and only a new pod under its name starts afresh."""
    from rolloutfleet_operator.watchdog import PollFailure, RssSample, storage_condition, storage_reports

    broken = RssSample(5, "OSError: [Errno 28] No space left on device")
    reports = storage_reports({}, {"f-proxy-0": broken}, {"f-proxy-0": "u0"})
    reports = storage_reports(reports, {"f-proxy-0": PollFailure("no answer within 5s")}, {"f-proxy-0": "u0"})
    assert storage_condition(reports).reason == "CannotPersist"
    replaced = storage_reports(reports, {}, {"f-proxy-0": "u1"})
    assert storage_condition(replaced).reason == "NotPolled"
    assert storage_reports(reports, {}, {}) == {}  # gone
    off = storage_condition(reports, enabled=False)
    assert (off.status, off.reason) == ("Unknown", "WatchdogOff")


def test_running_proxies_that_are_not_ready_are_polled_for_storage_only():
    from rolloutfleet_operator.memory_watchdog import poll_targets
    from rolloutfleet_operator.plan import proxy_pod_view

    def pod(name: str, ready: bool, phase: str = "Running", ip: str | None = "10.0.0.1", deleting=False):
        meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        return {"metadata": meta, "status": {"phase": phase, "podIP": ip, "conditions": conditions}}

    pods = [
        pod("f-proxy-0", True),
        pod("f-proxy-1", False),  # e.g. its volume refuses writes: fails /readyz, answers /stats
        pod("f-proxy-2", False, phase="Pending", ip=None),
        pod("f-proxy-3", True, deleting=True),
    ]
    views = {p["metadata"]["name"]: proxy_pod_view(p, i) for i, p in enumerate(pods)}
    assert [name for name, _ in poll_targets(pods, views, 8000)] == ["f-proxy-0"]
    assert [name for name, _ in poll_targets(pods, views, 8000, ready=False)] == ["f-proxy-1"]
