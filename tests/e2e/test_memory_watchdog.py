"""The memory watchdog end to end: the operator (installed by its chart, running as a pod) restarts
proxies that grew past their RSS budget, one at a time, and every session live at the restart goes
on on the replacement with all its turns; a proxy whose live set alone exceeds the budget ends in
backoff, not in a restart loop.

The proxies grow for real: sessions with long user messages (tens of thousands of tokens per turn)
leave both a live set and heap the allocator keeps. A replacement restores the live set only, so
its RSS is lower, which is what a restart is for. The engine is the fixed-latency upstream stand-in
(a test stand-in for SGLang), served on 127.0.0.1 as an external engine URL behind the real router.

The other tests run fleets of /stats stand-ins (`rolloutfleet-stats-standin`, a test stand-in for
the proxy image: rolloutfleet_testkit/stats_standin.py) whose reported RSS and /stats behaviour the
test sets: proxies whose polls fail are never restarted and show in the MemoryPressure condition,
dry run restarts nothing, and maxUnavailable bounds how many are down at once.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from operator_install import installed_operator
from rolloutfleet_operator import watchdog
from rolloutfleet_operator.plan import is_ready
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.upstream_stub import create_app as create_upstream_stub
from waiting import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "watchdog-e2e"
FLEET = "mem"
REPLICAS = 3
MIB = 2**20
SESSIONS_PER_PROXY = 10
TURNS = 3
WORDS_PER_MESSAGE = 20000
# Bytes a restored proxy holds per token (ids, mask, logprobs and bookkeeping), generously rounded
# up from the memory benchmark's 10.6 (docs/benchmarks.md).
BYTES_PER_TOKEN = 12


@pytest.fixture(scope="module")
def operator_namespace(cluster):
    with installed_operator(cluster, NAMESPACE, "wd"):
        yield NAMESPACE


def get(cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json").stdout)


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def proxies(cluster) -> dict[str, dict]:
    """Proxy pods by name (terminating ones included)."""
    pods = get(cluster, "pods", "-l", f"rolloutfleet.dev/fleet={FLEET},app.kubernetes.io/component=proxy")
    return {pod["metadata"]["name"]: pod for pod in pods["items"]}


def available(pod: dict) -> bool:
    return is_ready(pod) and not pod["metadata"].get("deletionTimestamp")


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def urls(cluster) -> dict[str, str]:
    return {
        name: f"http://{pod['status']['podIP']}:8000"
        for name, pod in proxies(cluster).items()
        if available(pod)
    }


class Rollouts:
    """The sessions the test started, per proxy, with the turns each has had: the ledger the
    no-loss check counts against."""

    def __init__(self, admin_key: str):
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.sessions: dict[str, list[dict]] = {}
        self.words = [f"w{i}" for i in range(5000)]
        self.random = random.Random(7)

    def turn(self, url: str, session: dict, words: int = WORDS_PER_MESSAGE) -> None:
        content = " ".join(self.random.choices(self.words, k=words))
        session["messages"].append({"role": "user", "content": content})
        reply = httpx.post(
            f"{url}/v1/sessions/{session['id']}/chat/completions",
            headers={"Authorization": f"Bearer {session['key']}"},
            json={"messages": session["messages"], "max_tokens": 8},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        session["messages"].append(
            {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]}
        )
        session["turns"] += 1

    def load(self, proxy: str, url: str) -> None:
        for _ in range(SESSIONS_PER_PROXY):
            created = httpx.post(f"{url}/v1/sessions", headers=self.admin, json={}, timeout=30)
            assert created.status_code == 201, created.text
            body = created.json()
            session = {"id": body["session_id"], "key": body["session_key"], "messages": [], "turns": 0}
            self.sessions.setdefault(proxy, []).append(session)
            for _ in range(TURNS):
                self.turn(url, session)

    def check_all(self, current_urls: dict[str, str], one_more_turn: bool) -> tuple[int, int]:
        """(sessions lost, turns lost) across the fleet; with one_more_turn, each session also
        takes another (short) turn on the proxy that holds it now."""
        lost_sessions = lost_turns = 0
        for proxy, sessions in self.sessions.items():
            for session in sessions:
                answer = httpx.get(
                    f"{current_urls[proxy]}/v1/sessions/{session['id']}",
                    headers={"Authorization": f"Bearer {session['key']}"},
                    timeout=30,
                )
                if answer.status_code != 200:
                    lost_sessions += 1
                    lost_turns += session["turns"]
                    continue
                lost_turns += session["turns"] - answer.json()["num_turns"]
                if one_more_turn:
                    self.turn(current_urls[proxy], session, words=8)
        return lost_sessions, lost_turns


class Unavailability:
    """Samples, every 0.3 s, how many wanted proxies are not available (missing, not Ready or
    terminating)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        wanted = [f"{FLEET}-proxy-{i}" for i in range(REPLICAS)]
        while not self._stop.is_set():
            pods = proxies(self.cluster)
            self.samples.append(sum(1 for name in wanted if name not in pods or not available(pods[name])))
            time.sleep(0.3)

    def __enter__(self) -> Unavailability:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def set_budget(cluster, budget: int, cooldown_s: int = 20, max_cooldown_s: int = 80) -> None:
    memory = {"rssBudgetBytes": budget, "cooldownSeconds": cooldown_s, "maxCooldownSeconds": max_cooldown_s}
    patch = {"spec": {"proxy": {"memory": memory}}}
    cluster.kubectl("patch", "rf", FLEET, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))


def test_over_budget_proxies_are_replaced_one_at_a_time_without_losing_a_turn(
    cluster, operator_namespace, test_tokenizer_dir, tmp_path
):
    with serve_app(create_upstream_stub(0.01, 8)) as engine_url:
        fleet = fleet_setup.external_fleet(
            FLEET,
            NAMESPACE,
            test_tokenizer_dir,
            engine_url,
            REPLICAS,
            dump={"hostPath": {"path": str(tmp_path / "dumps")}},
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
        rollouts = Rollouts(fleet_setup.admin_key(secret))
        started = {name: stats(url)["rss_bytes"] for name, url in urls(cluster).items()}
        for name, url in urls(cluster).items():
            rollouts.load(name, url)
        grown = {name: stats(url) for name, url in urls(cluster).items()}
        live_bytes = {name: s["tokens_held"] * BYTES_PER_TOKEN for name, s in grown.items()}
        # Between what a replacement will hold (baseline + live set) and what the grown ones hold.
        budget = max(started[n] + live_bytes[n] for n in started) + 8 * MIB
        smallest = min(s["rss_bytes"] for s in grown.values())
        assert budget < smallest, (
            f"the load should grow every proxy past {budget / MIB:.0f} MiB; "
            f"started {[round(v / MIB) for v in started.values()]} MiB, "
            f"grown {[round(s['rss_bytes'] / MIB) for s in grown.values()]} MiB"
        )

        uids = {name: pod["metadata"]["uid"] for name, pod in proxies(cluster).items()}
        with Unavailability(cluster) as watch:
            set_budget(cluster, budget)
            wait_for(
                lambda: (
                    (pods := proxies(cluster))
                    and all(n in pods and pods[n]["metadata"]["uid"] != uids[n] for n in uids)
                    and all(available(pods[n]) for n in uids)
                ),
                timeout_s=240,
                what="every over-budget proxy replaced and Ready",
                interval_s=1,
            )
        assert max(watch.samples) == 1, "never more than maxUnavailable (1) proxies down at once"
        status = get(cluster, "rf", FLEET)["status"]
        assert status["memoryRestarts"]["total"] == REPLICAS
        restored = {name: stats(url) for name, url in urls(cluster).items()}
        assert all(restored[n]["rss_bytes"] < budget for n in restored), (
            "a replacement holds the live set only"
        )
        assert all(restored[n]["tokens_held"] == grown[n]["tokens_held"] for n in restored)
        events = get(cluster, "events", "--field-selector", f"involvedObject.name={FLEET}")["items"]
        restart_events = [e for e in events if e["reason"] == "MemoryRestart"]
        assert sum(e.get("count", 1) for e in restart_events) == REPLICAS, "\n".join(
            f"{e.get('count')} {e['involvedObject']['kind']} {e['message'][:40]}" for e in restart_events
        )
        assert rollouts.check_all(urls(cluster), one_more_turn=True) == (0, 0)

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
        assert rollouts.check_all(urls(cluster), one_more_turn=False) == (0, 0)
        cluster.kubectl("delete", "rf", FLEET, "-n", NAMESPACE)


# --- fleets of /stats stand-ins -------------------------------------------------------------------

STANDIN_IMAGE = "rolloutfleet-stats-standin:latest"
STANDIN_RSS = 50 * MIB  # what a stand-in reports until told otherwise
STANDIN_BUDGET = 100 * MIB
OVER_BUDGET = 150 * MIB


def fleet_pods(cluster, fleet: str) -> dict[str, dict]:
    """The fleet's proxy pods by name (terminating ones included)."""
    pods = get(cluster, "pods", "-l", f"rolloutfleet.dev/fleet={fleet},app.kubernetes.io/component=proxy")
    return {pod["metadata"]["name"]: pod for pod in pods["items"]}


def standin_urls(cluster, fleet: str) -> dict[str, str]:
    return {
        name: f"http://{pod['status']['podIP']}:8000"
        for name, pod in fleet_pods(cluster, fleet).items()
        if available(pod)
    }


def standin_control(url: str, **body) -> dict:
    answer = httpx.post(f"{url}/standin/control", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def standin_state(url: str) -> dict:
    return httpx.get(f"{url}/standin/state", timeout=10).json()


def uids(cluster, fleet: str) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in fleet_pods(cluster, fleet).items()}


def fleet_events(cluster, fleet: str) -> list[dict]:
    return get(cluster, "events", "--field-selector", f"involvedObject.name={fleet}")["items"]


def pressure(cluster, fleet: str) -> dict:
    return condition(get(cluster, "rf", fleet).get("status", {}), "MemoryPressure")


def start_standin_fleet(
    cluster, name: str, replicas: int, memory: dict, engine_url: str, tokenizer_dir, dump_dir
) -> dict[str, str]:
    """A fleet whose proxies are /stats stand-ins, with the watchdog on from the start (interval
    1 s, 2 samples); returns pod name -> URL once every proxy is available."""
    fleet = fleet_setup.external_fleet(
        name,
        NAMESPACE,
        tokenizer_dir,  # required by the CRD; the stand-in reads neither it nor the dumps
        engine_url,
        replicas,
        image=STANDIN_IMAGE,
        dump={"hostPath": {"path": str(dump_dir)}},
        env=[
            {"name": "STANDIN_DRAIN_S", "value": "1"},
            {"name": "STANDIN_RSS_BYTES", "value": str(STANDIN_RSS)},
        ],
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
def engine_url():
    with serve_app(create_upstream_stub(0.01, 8)) as url:
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
            (pods := fleet_pods(cluster, name)).get(healthy, {}).get("metadata", {}).get("uid")
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
        pods = fleet_pods(cluster, name)
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
    wanted = sorted(before)
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pods = fleet_pods(cluster, name)
            samples.append(sum(1 for n in wanted if n not in pods or not available(pods[n])))
            time.sleep(0.3)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for url in urls_by_pod.values():
            standin_control(url, rss_bytes=OVER_BUDGET)
        wait_for(
            lambda: (
                (pods := fleet_pods(cluster, name))
                and all(n in pods and pods[n]["metadata"]["uid"] != before[n] for n in wanted)
                and all(available(pods[n]) for n in wanted)
            ),
            timeout_s=90,
            what="all 4 over-budget proxies replaced and Ready",
            interval_s=0.5,
        )
    finally:
        stop.set()
        sampler.join()
    assert max(samples) == 2, f"never more than maxUnavailable (2) down at once: {samples}"
    assert get(cluster, "rf", name)["status"]["memoryRestarts"]["total"] == replicas
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--wait=false")
