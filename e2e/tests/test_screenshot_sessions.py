"""Computer-use rollouts on the real node: 16 sessions of 10 turns (30 when asked), each turn a new 1280x720
screenshot with every earlier one of the session sent again (as browser and computer-use agents
send their history), through the GPU sample fleet whose proxies run under a cgroup memory limit.

The fleet is the sample as users apply it (operator/samples/gpu.yaml, adapted by
`fleet_setup.local_fleet`): two proxies with a Qwen2.5-VL model directory (Qwen's vocabulary,
`preprocessor_config.json`), the real sglang-router as the gateway, and one engine pod on the GPU node
running the SGLang emulator (a test stand-in for SGLang, taking images as SGLang's Qwen-VL path
does). Sixteen client threads, one per session as rollout workers run them, eight sessions a proxy.

Checked: no proxy container is OOM-killed or restarted; every delivered turn is in the proxy's
record with the logprobs the client got, its prompt expanded to every image's token count; each
distinct screenshot is stored once. Printed (docs/benchmarks.md): each proxy's peak RSS (sampled)
against its sessions' unique image bytes, and the run's time.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import shutil
import threading
import time

import httpx
import pytest
from fleet_watch import FleetWatch, proxy_pods
from operator_install import installed_operator
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.model_families.vision import IMAGE_PAD, VISION_TOKEN_IDS
from rolloutfleet_testkit.screenshots import screenshot
from rolloutfleet_testkit.session_ledger import SessionLedger
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "screens-e2e"
FLEET = "screens"
# The run is 16 sessions of 30 turns (`ROLLOUTFLEET_SCREENSHOT_TURNS=30`): about 10 minutes
# on this 2-core machine, too long for every CI run; CI runs the same sessions 10 turns deep.
PROXIES, SESSIONS, TURNS = 2, 16, int(os.environ.get("ROLLOUTFLEET_SCREENSHOT_TURNS", "10"))
WIDTH, HEIGHT = 1280, 720
MIB = 2**20
# docs/deploying.md's sizing for a proxy of screenshot sessions: its resting RSS (about 170 MiB with
# a VL model directory), the sessions' tokens (8 x 37k tokens x 11 B: 3 MiB), ~100 MiB of headroom,
# and twice max_request_bytes_in_flight (64 MiB) for the requests in flight; rounded up.
LIMIT_MIB = 448
CONTEXT_TOKENS = 40960  # up to 30 screenshots of 1,196 tokens and the text around them
TURN_DEADLINE_S = 1200  # for all sessions: bounds the load
RETRIES = 60  # 503s with Retry-After a turn may meet (requests in flight over the proxy's bound)


@pytest.fixture(scope="module")
def operator_namespace(cluster):
    with installed_operator(cluster, NAMESPACE, "screens"):
        yield NAMESPACE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The Qwen2.5-VL test model directory, copied where the pods (non-root) can read it."""
    copy = tmp_path_factory.mktemp("vl-model") / "qwen25_vl"
    shutil.copytree(VL_FAMILIES["qwen25_vl"].build_cached(), copy)
    return fleet_setup.pod_readable(copy)


def tokens_per_screenshot(model_dir) -> int:
    """What the engine's processor makes of one screenshot (transformers' image processor)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil", local_files_only=True)
    patches = processor.get_number_of_image_patches(HEIGHT, WIDTH, {})
    return int(patches) // processor.merge_size**2


class Session:
    """One computer-use rollout: its screenshots (a new one a turn) and what the client was given."""

    def __init__(self, index: int, proxy: str, url: str, ledger: SessionLedger):
        self.index, self.proxy, self.url = index, proxy, url
        # Its messages and each delivered turn's output logprobs, which the ledger checks at the end.
        self.record = ledger.create(proxy, url)
        self.image_bytes = 0
        self.retried = 0

    def run(self, deadline: float) -> None:
        with httpx.Client(timeout=300) as http:
            for turn in range(TURNS):
                shot = screenshot(WIDTH, HEIGHT, seed=1000 * self.index + turn)
                self.image_bytes += len(shot)
                uri = "data:image/png;base64," + base64.b64encode(shot).decode()
                self.record.messages.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": f"Step {turn}: where do I click?"},
                            {"type": "image_url", "image_url": {"url": uri}},
                        ],
                    }
                )
                choice = self._turn(http, deadline)
                self.record.messages.append({"role": "assistant", "content": choice["message"]["content"]})
                self.record.delivered.append([entry["logprob"] for entry in choice["logprobs"]["content"]])

    def _turn(self, http: httpx.Client, deadline: float) -> dict:
        body = json.dumps(
            {"messages": self.record.messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
        )
        for _ in range(RETRIES):
            assert time.monotonic() < deadline, (
                f"session {self.index}: out of time at turn {len(self.record.delivered)}"
            )
            reply = http.post(
                f"{self.url}/v1/sessions/{self.record.session_id}/chat/completions",
                content=body,
                headers={**self.record.auth, "content-type": "application/json"},
            )
            if reply.status_code == 503 and "retry-after" in reply.headers:  # held back, not refused
                self.retried += 1
                time.sleep(float(reply.headers["retry-after"]))
                continue
            assert reply.status_code == 200, f"session {self.index}: {reply.status_code} {reply.text[:400]}"
            return reply.json()["choices"][0]
        raise AssertionError(f"session {self.index}: still held back after {RETRIES} tries")


class RssSampler:
    """The proxies' RSS as their /stats report it, every 0.25 s: a sample, not the cgroup's peak."""

    def __init__(self, urls: dict[str, str]):
        self.urls, self.peak = urls, dict.fromkeys(urls, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(0.25):
                for name, url in self.urls.items():
                    try:
                        rss = http.get(f"{url}/stats").json()["rss_bytes"]
                    except (httpx.HTTPError, KeyError, ValueError):
                        continue
                    self.peak[name] = max(self.peak[name], rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.timeout(1500)
def test_screenshot_sessions_stay_within_the_proxies_memory_limit_and_every_turn_is_recorded(
    cluster, operator_namespace, model_dir, tmp_path
):
    fleet = fleet_setup.local_fleet(
        FLEET, NAMESPACE, model_dir, fleet_setup.pod_writable(tmp_path / "dumps"), proxies=PROXIES, engines=1
    )
    fleet["spec"]["proxy"]["resources"] = {
        "requests": {"cpu": "100m", "memory": f"{LIMIT_MIB}Mi"},
        "limits": {"memory": f"{LIMIT_MIB}Mi"},
    }
    # SGLang's flags: a context for 30 screenshots, and a KV pool (the prefix cache) for all sessions.
    engine = fleet["spec"]["engines"]
    engine["args"] = [
        *engine.get("args", []),
        "--context-length",
        str(CONTEXT_TOKENS),
        "--max-total-tokens",
        "800000",
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
    wait_for(
        lambda: fleet_setup.fleet_ready(
            json.loads(cluster.kubectl("get", "rf", FLEET, "-n", NAMESPACE, "-o", "json").stdout).get(
                "status", {}
            ),
            PROXIES,
        ),
        timeout_s=300,
        interval_s=1,
        what="the screenshot fleet Ready",
    )
    pods = proxy_pods(cluster, NAMESPACE, FLEET)
    urls = fleet_setup.pod_urls({"items": list(pods.values())}, fleet_setup.PROXY_PORT)
    secret = json.loads(
        cluster.kubectl("get", "secret", f"{FLEET}-admin-key", "-n", NAMESPACE, "-o", "json").stdout
    )
    ledger = SessionLedger(fleet_setup.admin_key(secret))
    resting = {name: httpx.get(f"{url}/stats", timeout=10).json()["rss_bytes"] for name, url in urls.items()}
    names = sorted(urls)
    sessions = [Session(i, names[i % PROXIES], urls[names[i % PROXIES]], ledger) for i in range(SESSIONS)]

    started = time.monotonic()
    deadline = started + TURN_DEADLINE_S
    with (
        FleetWatch(cluster, NAMESPACE, FLEET, PROXIES) as watch,
        RssSampler(urls) as rss,
        concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool,
    ):
        running = [pool.submit(s.run, deadline) for s in sessions]
        while not all(future.done() for future in running):  # progress, for whoever watches the run
            concurrent.futures.wait(running, timeout=30, return_when=concurrent.futures.FIRST_EXCEPTION)
            delivered = ledger.delivered_turns()
            print(
                f"[screenshots] {time.monotonic() - started:.0f} s: {delivered} of {SESSIONS * TURNS} turns",
                flush=True,
            )
            if any(f.done() and f.exception() for f in running):
                break
        for future in running:
            future.result()
    took = time.monotonic() - started

    # Every delivered turn is in the record, with the logprobs the client got, and its prompt holds
    # every screenshot so far, each expanded to what the engine's processor makes of it.
    losses = ledger.check(urls)
    assert losses.checked_turns == SESSIONS * TURNS == ledger.delivered_turns()
    assert losses.counts() == (0, 0), losses
    per_image = tokens_per_screenshot(model_dir)
    pad = VISION_TOKEN_IDS[IMAGE_PAD]
    for session in sessions:
        record = httpx.get(
            f"{session.url}/v1/sessions/{session.record.session_id}",
            params={"tokens": "true"},
            headers=session.record.auth,
            timeout=60,
        )
        assert record.status_code == 200, record.text
        trajectory = record.json()["trajectory"]
        assert len(trajectory["turns"]) == TURNS
        assert trajectory["input_ids"].count(pad) == TURNS * per_image
    stats = {name: httpx.get(f"{url}/stats", timeout=10).json() for name, url in urls.items()}
    final = proxy_pods(cluster, NAMESPACE, FLEET)
    restarts = {n: sum(c["restartCount"] for c in p["status"]["containerStatuses"]) for n, p in final.items()}

    unique = {name: sum(s.image_bytes for s in sessions if s.proxy == name) for name in names}
    lines = [
        f"{name}: resting {resting[name] / MIB:.0f} MiB, peak {rss.peak[name] / MIB:.0f} MiB "
        f"(+{(rss.peak[name] - resting[name]) / MIB:.0f} MiB) for {unique[name] / MIB:.1f} MiB of unique "
        f"screenshots, {stats[name]['totals'].get('images_stored')} images stored"
        for name in names
    ]
    print(
        f"\n{SESSIONS} sessions x {TURNS} turns of {WIDTH}x{HEIGHT} screenshots ({per_image} tokens each) "
        f"in {took:.0f} s, proxies limited to {LIMIT_MIB} MiB, {sum(s.retried for s in sessions)} turns held "
        "back (503) and retried:\n  " + "\n  ".join(lines)
    )
    assert not watch.oom_killed, watch.oom_killed
    assert restarts == dict.fromkeys(names, 0), restarts
    for name in names:
        assert stats[name]["totals"].get("images_stored") == SESSIONS // PROXIES * TURNS
        assert rss.peak[name] < LIMIT_MIB * MIB
    cluster.kubectl("delete", "rf", FLEET, "-n", NAMESPACE)
