"""The memory watchdog end to end: the operator (installed by its chart, running as a pod) restarts
proxies that grew past their RSS budget, one at a time, and every session live at the restart goes
on on the replacement with all its turns; a proxy whose live set alone exceeds the budget ends in
backoff, not in a restart loop.

The proxies grow for real: sessions with long user messages (tens of thousands of tokens per turn)
leave both a live set and heap the allocator keeps. A replacement restores the live set only, so
its RSS is lower, which is what a restart is for. The engine is the fixed-latency upstream stand-in
(a test stand-in for SGLang), served on this machine as an external engine URL behind the real router.

The other tests run fleets of /stats stand-ins (the test kit image with TESTKIT_PROGRAM=stats-standin,
a test stand-in for the proxy image: rolloutfleet_testkit/stats_standin.py) whose reported RSS and
/stats behaviour the test sets: proxies whose polls fail are never restarted and show in the
MemoryPressure condition, dry run restarts nothing, and maxUnavailable bounds how many are down at once.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fleet_watch import FleetWatch, all_replaced_and_available, available, proxy_pods
from operator_install import installed_operator
from rolloutfleet_operator import watchdog
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.session_ledger import SessionLedger
from rolloutfleet_testkit.upstream_stub import create_app as create_upstream_stub
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "watchdog-e2e"
FLEET = "mem"
REPLICAS = 3
MIB = 2**20
SESSIONS_PER_PROXY = 10
TURNS = 3
WORDS_PER_MESSAGE = 20000


@pytest.fixture(scope="module")
def operator_namespace(cluster):
    with installed_operator(cluster, NAMESPACE, "wd"):
        yield NAMESPACE


def get(cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json").stdout)


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def proxies(cluster) -> dict[str, dict]:
    return proxy_pods(cluster, NAMESPACE, FLEET)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def urls(cluster) -> dict[str, str]:
    return {
        name: f"http://{pod['status']['podIP']}:8000"
        for name, pod in proxies(cluster).items()
        if available(pod)
    }


def resting_proxies(cluster) -> dict[str, str] | None:
    """Each proxy's pod uid while all of them are Ready and none is terminating, else None."""
    pods = proxies(cluster)
    if len(pods) != REPLICAS or not all(
        available(pod) and not pod["metadata"].get("deletionTimestamp") for pod in pods.values()
    ):
        return None
    return {name: pod["metadata"]["uid"] for name, pod in pods.items()}


def check_ledger(ledger: SessionLedger, cluster):
    """Every session and delivered turn, read while the fleet is at rest. Under a budget below the
    live set the watchdog restarts each proxy once more, one after another, so a read can meet a proxy
    being replaced (refused connections, no address, 503 draining): a read during which any proxy
    was replaced does not count, and is made again from the current pods once they rest."""

    def read_at_rest():
        before = resting_proxies(cluster)
        if before is None:
            return None
        try:
            losses = ledger.check(urls(cluster))
        except httpx.TransportError:
            return None
        return losses if resting_proxies(cluster) == before else None

    return wait_for(
        read_at_rest, timeout_s=240, what="every session read while no proxy restarts", interval_s=2
    )


def grow(ledger: SessionLedger, proxy: str, url: str) -> None:
    """Sessions with long user messages: a live set, and heap the allocator keeps."""
    for _ in range(SESSIONS_PER_PROXY):
        session = ledger.create(proxy, url)
        for _ in range(TURNS):
            ledger.turn(url, session, WORDS_PER_MESSAGE)


def one_more_turn_each(ledger: SessionLedger, current_urls: dict[str, str]) -> None:
    for proxy, sessions in ledger.sessions.items():
        for session in sessions:
            ledger.turn(current_urls[proxy], session, 8)


def set_budget(cluster, budget: int, cooldown_s: int = 20, max_cooldown_s: int = 80) -> None:
    memory = {"rssBudgetBytes": budget, "cooldownSeconds": cooldown_s, "maxCooldownSeconds": max_cooldown_s}
    patch = {"spec": {"proxy": {"memory": memory}}}
    cluster.kubectl("patch", "rf", FLEET, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))


def test_over_budget_proxies_are_replaced_one_at_a_time_without_losing_a_turn(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path
):
    with serve_app(create_upstream_stub(0.01, 8), host=cluster.host_ip) as engine_url:
        fleet = fleet_setup.external_fleet(
            FLEET,
            NAMESPACE,
            test_tokenizer_dir,
            engine_url,
            REPLICAS,
            dump={"hostPath": {"path": str(fleet_setup.pod_writable(tmp_path / "dumps"))}},
            drainGraceSeconds=10,
            terminationGracePeriodSeconds=30,
            # Off until the proxies have grown: the budget is set from what they report.
            memory={"rssBudgetBytes": 0, "checkIntervalSeconds": 2, "consecutiveSamples": 2},
        )
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(
            lambda: (
                condition(get(cluster, "rf", FLEET).get("status", {}), "Ready").get("status") == "True"
                and len(urls(cluster)) == REPLICAS
            ),
            timeout_s=180,
            what="the fleet Ready (proxies and gateway)",
            interval_s=1,
        )
        secret = get(cluster, "secret", f"{FLEET}-admin-key")
        ledger = SessionLedger(fleet_setup.admin_key(secret))
        started = {name: stats(url)["rss_bytes"] for name, url in urls(cluster).items()}
        for name, url in urls(cluster).items():
            grow(ledger, name, url)
        grown = {name: stats(url) for name, url in urls(cluster).items()}
        assert all(grown[n]["rss_bytes"] > started[n] + 16 * MIB for n in started), (
            f"the load should grow every proxy; started {[round(v / MIB) for v in started.values()]} MiB, "
            f"grown {[round(s['rss_bytes'] / MIB) for s in grown.values()]} MiB"
        )
        # Just below what every grown proxy holds. (In the proxy image the growth is nearly all live
        # set: the heap is trimmed, so a replacement restores to about what it replaced.)
        budget = min(s["rss_bytes"] for s in grown.values()) - 2 * MIB

        uids = {name: pod["metadata"]["uid"] for name, pod in proxies(cluster).items()}
        with FleetWatch(cluster, NAMESPACE, FLEET, REPLICAS) as watch:
            set_budget(cluster, budget, cooldown_s=60, max_cooldown_s=120)  # once each here
            wait_for(
                lambda: all_replaced_and_available(proxies(cluster), uids),
                timeout_s=240,
                what="every over-budget proxy replaced and Ready",
                interval_s=1,
            )
        assert not watch.oom_killed, watch.oom_killed
        assert max(watch.unavailable) == 1, "never more than maxUnavailable (1) proxies down at once"
        status = get(cluster, "rf", FLEET)["status"]
        assert status["memoryRestarts"]["total"] == REPLICAS
        restored = {name: stats(url) for name, url in urls(cluster).items()}
        rss = {n: (started[n], grown[n]["rss_bytes"], restored[n]["rss_bytes"]) for n in sorted(started)}
        print(
            "\nRSS started / grown / restored (MiB):",
            {n: [round(v / MIB) for v in r] for n, r in rss.items()},
        )
        assert all(restored[n]["tokens_held"] == grown[n]["tokens_held"] for n in restored)
        events = get(cluster, "events", "--field-selector", f"involvedObject.name={FLEET}")["items"]
        restart_events = [e for e in events if e["reason"] == "MemoryRestart"]
        assert sum(e.get("count", 1) for e in restart_events) == REPLICAS, "\n".join(
            f"{e.get('count')} {e['involvedObject']['kind']} {e['message'][:40]}" for e in restart_events
        )
        assert check_ledger(ledger, cluster).counts() == (0, 0)
        one_more_turn_each(ledger, urls(cluster))

        # A budget below what the live set alone needs: restarted once more each at most, then
        # held in backoff, not restarted in a loop.
        tight = min(s["rss_bytes"] for s in restored.values()) - 16 * MIB
        set_budget(cluster, tight, cooldown_s=30, max_cooldown_s=120)
        wait_for(
            lambda: (
                condition(get(cluster, "rf", FLEET)["status"], "MemoryPressure").get("reason") == "Backoff"
            ),
            timeout_s=120,
            what="the MemoryPressure condition to report Backoff",
            interval_s=1,
        )
        # Watched for less than the second cooldown (60 s): a pod replaced twice would be a loop.
        replacements = {name: set() for name in uids}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for name, pod in proxies(cluster).items():
                replacements[name].add(pod["metadata"]["uid"])
            time.sleep(0.5)
        assert all(len(seen) <= 2 for seen in replacements.values()), replacements
        reasons = [
            e["reason"]
            for e in get(cluster, "events", "--field-selector", f"involvedObject.name={FLEET}")["items"]
        ]
        assert "MemoryRestartBackoff" in reasons or "MemoryRestartCooldown" in reasons, reasons
        assert condition(get(cluster, "rf", FLEET)["status"], "MemoryPressure")["status"] == "True"
        assert check_ledger(ledger, cluster).counts() == (0, 0)
        cluster.kubectl("delete", "rf", FLEET, "-n", NAMESPACE)


# --- fleets of /stats stand-ins -------------------------------------------------------------------

STANDIN_RSS = 50 * MIB  # what a stand-in reports until told otherwise
STANDIN_BUDGET = 100 * MIB
OVER_BUDGET = 150 * MIB


def standin_urls(cluster, fleet: str) -> dict[str, str]:
    return {
        name: f"http://{pod['status']['podIP']}:8000"
        for name, pod in proxy_pods(cluster, NAMESPACE, fleet).items()
        if available(pod)
    }


def standin_control(url: str, **body) -> dict:
    answer = httpx.post(f"{url}/standin/control", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def standin_state(url: str) -> dict:
    return httpx.get(f"{url}/standin/state", timeout=10).json()


def uids(cluster, fleet: str) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in proxy_pods(cluster, NAMESPACE, fleet).items()}


def fleet_events(cluster, fleet: str) -> list[dict]:
    return get(cluster, "events", "--field-selector", f"involvedObject.name={fleet}")["items"]


def pressure(cluster, fleet: str) -> dict:
    return condition(get(cluster, "rf", fleet).get("status", {}), "MemoryPressure")


def start_standin_fleet(
    cluster, name: str, replicas: int, memory: dict, engine_url: str, tokenizer_dir, dump_dir
) -> dict[str, str]:
    """A fleet whose proxies are /stats stand-ins, with the watchdog on from the start (interval
    1 s, 2 samples); returns pod name -> URL once every proxy is available."""
    fleet = fleet_setup.standin_fleet(
        name,
        NAMESPACE,
        tokenizer_dir,
        engine_url,
        replicas,
        dump_dir,
        rss_bytes=STANDIN_RSS,
        drain_s=1,
        memory={
            "rssBudgetBytes": STANDIN_BUDGET,
            "checkIntervalSeconds": 1,
            "consecutiveSamples": 2,
            **memory,
        },
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
    return wait_for(
        lambda: len(found := standin_urls(cluster, name)) == replicas and found,
        timeout_s=120,
        what=f"{replicas} stand-in proxies of {name} available",
        interval_s=0.5,
    )


@pytest.fixture
def engine_url(cluster):
    with serve_app(create_upstream_stub(0.01, 8), host=cluster.host_ip) as url:
        yield url


def test_proxies_whose_stats_fail_are_never_restarted_and_show_in_the_condition(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path, engine_url
):
    name = "polls"
    urls_by_pod = start_standin_fleet(cluster, name, 3, {}, engine_url, test_tokenizer_dir, tmp_path)
    hung, failing, healthy = (f"{name}-proxy-{i}" for i in range(3))
    before = uids(cluster, name)
    # The two that cannot be polled would be over budget too, if the watchdog could see it.
    standin_control(urls_by_pod[hung], stats="hang", rss_bytes=OVER_BUDGET)
    standin_control(urls_by_pod[failing], stats="error", rss_bytes=OVER_BUDGET)
    standin_control(urls_by_pod[healthy], rss_bytes=OVER_BUDGET)
    # Polls answered before the switch were healthy ones; only later answers would be a mistake.
    answered = {pod: standin_state(urls_by_pod[pod])["stats_answers"] for pod in (hung, failing)}
    # The one that answers is restarted; its replacement reports STANDIN_RSS again.
    wait_for(
        lambda: (
            (pods := proxy_pods(cluster, NAMESPACE, name)).get(healthy, {}).get("metadata", {}).get("uid")
            not in (None, before[healthy])
            and available(pods[healthy])
        ),
        timeout_s=60,
        what=f"{healthy} restarted and Ready",
        interval_s=0.3,
    )
    # Then nothing is over budget that the watchdog can see: the condition reports the failures.
    reported = wait_for(
        lambda: (c := pressure(cluster, name)).get("reason") == "PollFailures" and c,
        timeout_s=30,
        what="MemoryPressure reason PollFailures",
        interval_s=0.5,
    )
    assert reported["status"] == "Unknown"
    assert hung in reported["message"] and failing in reported["message"], reported["message"]
    assert healthy not in reported["message"]
    time.sleep(3)  # a few more cycles
    after = uids(cluster, name)
    assert after[hung] == before[hung] and after[failing] == before[failing], "never restarted"
    for pod in (hung, failing):
        state = standin_state(urls_by_pod[pod])
        assert state["stats_requests"] >= watchdog.REPORTED_POLL_FAILURES + 3, state  # still polled
        assert state["stats_answers"] == answered[pod], state
    status = get(cluster, "rf", name)["status"]
    assert status["memoryRestarts"]["total"] == 1
    assert status["memoryRestarts"]["lastPod"] == healthy
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")


def test_dry_run_restarts_nothing_and_says_what_it_would_do(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path, engine_url
):
    name = "dry"
    urls_by_pod = start_standin_fleet(
        cluster, name, 2, {"dryRun": True}, engine_url, test_tokenizer_dir, tmp_path
    )
    over = f"{name}-proxy-0"
    before = uids(cluster, name)
    standin_control(urls_by_pod[over], rss_bytes=OVER_BUDGET, threshold_bytes=STANDIN_BUDGET)
    reported = wait_for(
        lambda: (c := pressure(cluster, name)).get("reason") == "OverBudget" and c,
        timeout_s=30,
        what="MemoryPressure reason OverBudget",
        interval_s=0.5,
    )
    assert reported["status"] == "True"
    assert "dry run" in reported["message"] and over in reported["message"], reported["message"]
    # Several cycles past the one that would have restarted it: nothing was deleted.
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        pods = proxy_pods(cluster, NAMESPACE, name)
        assert {n: p["metadata"]["uid"] for n, p in pods.items()} == before
        assert not any(p["metadata"].get("deletionTimestamp") for p in pods.values())
        time.sleep(0.5)
    assert len(standin_state(urls_by_pod[over])["over_threshold_at"]) >= 2 + 3  # polled all along
    reasons = [e["reason"] for e in fleet_events(cluster, name)]
    assert "MemoryRestartDryRun" in reasons, reasons
    assert "MemoryRestart" not in reasons, reasons
    assert not get(cluster, "rf", name)["status"].get("memoryRestarts")
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")


def test_max_unavailable_bounds_the_restarts_in_flight(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path, engine_url
):
    name = "maxun"
    replicas = 4
    urls_by_pod = start_standin_fleet(
        cluster, name, replicas, {"maxUnavailable": 2}, engine_url, test_tokenizer_dir, tmp_path
    )
    before = uids(cluster, name)
    with FleetWatch(cluster, NAMESPACE, name, replicas) as watch:
        for url in urls_by_pod.values():
            standin_control(url, rss_bytes=OVER_BUDGET)
        wait_for(
            lambda: all_replaced_and_available(proxy_pods(cluster, NAMESPACE, name), before),
            timeout_s=90,
            what="all 4 over-budget proxies replaced and Ready",
            interval_s=0.5,
        )
    samples = watch.unavailable
    assert max(samples) == 2, f"never more than maxUnavailable (2) down at once: {samples}"
    assert get(cluster, "rf", name)["status"]["memoryRestarts"]["total"] == replicas
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")
