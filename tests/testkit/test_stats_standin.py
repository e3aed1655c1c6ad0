"""The /stats stand-in (a test stand-in for the proxy, for the memory watchdog's tests and benchmark),
served for real on loopback: in a thread for its routes, as its own process for the SIGTERM drain."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rolloutfleet_testkit.processes import ServerProcess, free_port, serve_app
from rolloutfleet_testkit.stats_standin import StatsStandin

MIB = 2**20


@pytest.fixture
def standin():
    app = StatsStandin(rss_bytes=100 * MIB)
    with serve_app(app) as url:
        yield app, url
        app.control({"stats": "ok"})  # releases hung requests before the server stops


def control(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/standin/control", json=body, timeout=5)


def test_routes_report_the_rss_it_is_told(standin):
    _, url = standin
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/readyz").status_code == 200
    stats = httpx.get(f"{url}/stats").json()
    assert stats["rss_bytes"] == 100 * MIB
    assert {"pid", "uptime_seconds", "live_sessions", "tokens_held", "draining"} <= set(stats)
    assert control(url, rss_bytes=300 * MIB).json()["rss_bytes"] == 300 * MIB
    assert httpx.get(f"{url}/stats").json()["rss_bytes"] == 300 * MIB
    real = control(url, rss_bytes=None).json()["reported_rss_bytes"]
    assert 0 < httpx.get(f"{url}/stats").json()["rss_bytes"] < real + 64 * MIB
    assert control(url, stats="sometimes").status_code == 400
    assert control(url, rss_bytes=-1).status_code == 400
    assert control(url, rss=1).status_code == 400
    assert httpx.post(f"{url}/standin/control", content=b"{", timeout=5).status_code == 400


def test_records_the_first_answer_over_the_threshold(standin):
    _, url = standin
    control(url, threshold_bytes=200 * MIB)
    httpx.get(f"{url}/stats")
    assert httpx.get(f"{url}/standin/state").json()["first_over_threshold_at"] is None
    control(url, rss_bytes=250 * MIB)
    before = time.time()
    httpx.get(f"{url}/stats")
    httpx.get(f"{url}/stats")
    state = httpx.get(f"{url}/standin/state").json()
    assert before <= state["first_over_threshold_at"] <= time.time()
    assert len(state["over_threshold_at"]) == 2
    assert state["stats_answers"] == 3
    control(url, threshold_bytes=300 * MIB)  # a new threshold starts a new record
    assert httpx.get(f"{url}/standin/state").json()["over_threshold_at"] == []


def test_stats_can_fail_or_hang(standin):
    app, url = standin
    control(url, stats="error")
    assert httpx.get(f"{url}/stats").status_code == 500
    control(url, stats="hang")
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{url}/stats", timeout=0.5)
    assert httpx.get(f"{url}/healthz", timeout=2).status_code == 200  # only /stats hangs
    state = httpx.get(f"{url}/standin/state").json()
    assert state["stats_requests"] == 2
    assert state["stats_answers"] == 0  # neither the failure nor the hung request answered a sample
    with httpx.Client(timeout=5) as client:
        # A hung request answers once the mode changes back.
        answers: list[int] = []
        waiter = threading.Thread(target=lambda: answers.append(client.get(f"{url}/stats").status_code))
        waiter.start()
        time.sleep(0.3)
        assert not answers
        app.control({"stats": "ok"})
        waiter.join(5)
        assert answers == [200]


def test_as_a_process_it_takes_the_proxy_command_line_and_drains_on_sigterm(tmp_path):
    port = free_port()
    # As the test kit's image runs it (TESTKIT_PROGRAM=stats-standin) with the proxy's arguments.
    args = [sys.executable, "-m", "rolloutfleet_testkit.image_entrypoint"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--upstream-url", "http://x", "--no-log-requests"]
    env = {"STANDIN_DRAIN_S": "1", "STANDIN_RSS_BYTES": str(42 * MIB), "TESTKIT_PROGRAM": "stats-standin"}
    with ServerProcess(args, tmp_path / "standin.log", env=env) as standin:
        url = f"http://127.0.0.1:{port}"
        standin.wait_ready(f"{url}/readyz", 30)
        stats = httpx.get(f"{url}/stats").json()
        assert stats["rss_bytes"] == 42 * MIB
        assert stats["real_rss_bytes"] < 64 * MIB, "64 of them run at once: no heavy imports"
        standin.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.2)
        assert httpx.get(f"{url}/readyz").status_code == 503
        assert httpx.get(f"{url}/healthz").status_code == 200  # still serving while draining
        code = standin.process.wait(10)
        waited = time.monotonic() - signalled
        assert code == 0, standin.log_tail()
        assert 0.9 <= waited < 5, waited


def test_imports_nothing_heavy():
    code = "import sys, rolloutfleet_testkit.stats_standin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
