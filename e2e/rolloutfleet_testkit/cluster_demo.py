"""The main job on the local cluster: the operator and the GPU sample fleet, end to end.

Brings up a real local Kubernetes (the control plane and two real kubelets with containerd, a CPU
node and a GPU node, kube-proxy and CoreDNS; binaries built on the first run, with progress), builds
the project's images from its Dockerfiles and imports them into the nodes, installs the CRD and the
operator's Helm chart, and applies `operator/samples/gpu.yaml` adapted to this machine
(fleet_setup.local_fleet: the SGLang emulator, a test stand-in for SGLang, runs for the engine
image). Once the fleet is Ready it sends multi-turn sessions through its proxies with the official
openai client, prints `kubectl get`, the fleet's conditions and Events, a proxy's /stats and the
operator's /metrics; then it deletes a proxy pod and shows the replacement restoring a live session,
scales the fleet with `kubectl scale`, and drives one proxy past its memory budget to show the
watchdog replacing it before the kernel's OOM killer would (the proxies run under a cgroup memory
limit), with every delivered turn restored. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.cache import project_cache
from rolloutfleet_testkit.demo import QUESTIONS, run_session, step
from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.node import real_cluster
from rolloutfleet_testkit.node.config import BRIDGE_IP
from rolloutfleet_testkit.processes import serve_app, wait_until_routed
from rolloutfleet_testkit.session_ledger import SessionLedger
from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer
from rolloutfleet_testkit.upstream_stub import create_app as create_upstream_stub
from rolloutfleet_testkit.waiting import wait_for

NAMESPACE = "rolloutfleet-demo"
RELEASE = "rolloutfleet"
FLEET = "gpu-fleet"  # the sample's own name
PROXIES, ENGINES, SCALED = 2, 2, 3
READY_TIMEOUT_S = 420  # first start of torch engines on two shared cores
REPAIR_TIMEOUT_S = 180
MIB = 2**20
MEMORY_FLEET, MEMORY_PROXY = "memory-demo", "memory-demo-proxy-0"
PROXY_MEMORY_LIMIT_MIB = (
    208  # its cgroup memory limit: the kernel OOM-kills above it (e2e/tests/test_oom_kill.py)
)
BUDGET_ABOVE_REST_MIB = 40
GROWTH_WORDS_PER_TURN = 20000  # turns with long user messages grow a proxy (live set and heap)
GROWTH_TURNS_PER_SESSION = 3
GROWTH_TIMEOUT_S = 180


class Clock:
    """Progress lines with the time since the demo started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.1f}s"

    def step(self, message: str) -> None:
        step(f"[{self.elapsed()}] {message}")


def wait_until(clock: Clock, what: str, probe: Callable[[], tuple[Any, str]], timeout_s: float) -> Any:
    """Poll `probe` (→ result when done else a falsy value, and a progress line) once a second,
    printing the line whenever it changes; the result, or TimeoutError after `timeout_s`."""
    shown: list[str | None] = [None]

    def check() -> Any:
        done, line = probe()
        if line != shown[0]:
            print(f"    [{clock.elapsed()}] {line}", flush=True)
            shown[0] = line
        return done

    return wait_for(check, timeout_s, what, 1, detail=lambda: f" (last: {shown[0]})")


def fleet_status(kubectl: Kubectl) -> dict[str, Any]:
    return kubectl.json("rf", FLEET).get("status", {})


def status_line(status: dict[str, Any], replicas: int) -> str:
    """readyReplicas and every condition's status; Progressing's reason, ReplicaFailure's message."""

    def show(c: dict[str, Any]) -> str:
        text = f"{c['type']}={c['status']}"
        if c["type"] == "Progressing":
            text += f" ({c.get('reason')})"
        elif c["type"] == "ReplicaFailure" and c["status"] == "True":
            text += f" ({c.get('message')})"
        return text

    conditions = ", ".join(show(c) for c in status.get("conditions", []))
    return f"readyReplicas {status.get('readyReplicas', 0)}/{replicas}; {conditions or 'no status yet'}"


def wait_fleet_ready(clock: Clock, kubectl: Kubectl, replicas: int, timeout_s: float) -> dict[str, Any]:
    def probe() -> tuple[Any, str]:
        status = fleet_status(kubectl)
        return fleet_setup.fleet_ready(status, replicas) and status, status_line(status, replicas)

    return wait_until(clock, f"{FLEET} Ready with {replicas} proxies", probe, timeout_s)


def pod_urls(kubectl: Kubectl, component: str, port: int) -> dict[str, str]:
    pods = kubectl.json("pods", "-l", fleet_setup.component_selector(FLEET, component))
    return dict(sorted(fleet_setup.pod_urls(pods, port).items()))


def install_operator(clock: Clock, kubectl: Kubectl, helm: Path) -> None:
    clock.step("kubectl apply -f crds/ (the RolloutFleet CRD), waiting until it is Established")
    print(kubectl("apply", "-f", str(fleet_setup.CRDS)).rstrip())
    kubectl.wait_established("rolloutfleets.rolloutfleet.dev")
    kubectl("create", "namespace", NAMESPACE)
    clock.step(f"helm upgrade --install {RELEASE} charts/rolloutfleet-operator (watching {NAMESPACE})")
    args = fleet_setup.helm_install_args(RELEASE, NAMESPACE, [NAMESPACE])
    result = subprocess.run(
        [str(helm), "--kubeconfig", kubectl.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=fleet_setup.HELM_WAIT_S + 60,
    )
    if result.returncode != 0:
        raise RuntimeError(f"helm install failed: {result.stderr.strip()}")
    print(textwrap.indent("\n".join(result.stdout.strip().splitlines()[:6]), "    "))


def apply_fleet(clock: Clock, kubectl: Kubectl, tokenizer_dir: Path, work: Path) -> dict[str, Any]:
    fleet = fleet_setup.local_fleet(
        FLEET,
        NAMESPACE,
        tokenizer_dir,
        fleet_setup.pod_writable(work / "dumps"),
        proxies=PROXIES,
        engines=ENGINES,
    )
    clock.step(
        f"applying operator/samples/gpu.yaml as {FLEET}: {PROXIES} proxies, the SGLang router, "
        f"{ENGINES} engines on the GPU node; waiting for Ready"
    )
    print(kubectl("apply", "-f", "-", input=json.dumps(fleet)).rstrip())
    status = wait_fleet_ready(clock, kubectl, PROXIES, READY_TIMEOUT_S)
    clock.step("fleet Ready; waiting until the router has discovered an engine")
    wait_until_routed(next(iter(pod_urls(kubectl, "gateway", fleet_setup.GATEWAY_PORT).values())))
    return status


def run_sessions(clock: Clock, urls: dict[str, str], key: str) -> None:
    targets = [list(urls)[i % len(urls)] for i in range(len(QUESTIONS))]  # round robin
    clock.step(f"{len(QUESTIONS)} multi-turn sessions with the openai client, spread over {', '.join(urls)}")

    async def all_sessions() -> list[dict]:
        sessions = (run_session(urls[targets[i]], q, i, admin_key=key) for i, q in enumerate(QUESTIONS))
        return await asyncio.gather(*sessions)

    for target, summary in zip(targets, asyncio.run(all_sessions()), strict=True):
        print(
            f"    {target}: session {summary['session_id']}: {summary['num_turns']} turns, "
            f"{summary['num_tokens']} tokens, {sum(summary['trajectory']['loss_mask'])} generated, "
            f"reward {summary['reward']}"
        )


def conditions_table(status: dict[str, Any]) -> str:
    rows = [("TYPE", "STATUS", "REASON", "MESSAGE")] + [
        (c["type"], c["status"], c.get("reason", ""), textwrap.shorten(c.get("message", ""), 60))
        for c in status.get("conditions", [])
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "    " + "".join(cell.ljust(width + 2) for cell, width in zip(row[:3], widths, strict=True)) + row[3]
        for row in rows
    )


def fleet_events(kubectl: Kubectl) -> list[dict[str, Any]]:
    """The fleet's Events, oldest first."""
    selector = f"involvedObject.kind=RolloutFleet,involvedObject.name={FLEET}"
    items = kubectl.json("events", "--field-selector", selector)["items"]
    return sorted(items, key=lambda e: (e["metadata"]["creationTimestamp"], e["metadata"]["name"]))


def event_lines(events: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"    {e['metadata']['creationTimestamp'][11:19]}  {e.get('type', ''):7} {e.get('reason', ''):10} "
        f"{e.get('message', '')}"
        for e in events
    )


def compact_stats(stats: dict[str, Any], width: int = 104) -> str:
    """Top-level numbers as key=value, then each nested group's non-zero entries, wrapped."""

    def wrap(text: str) -> str:
        return textwrap.fill(text, width, initial_indent="    ", subsequent_indent="      ")

    scalars = " ".join(f"{k}={v}" for k, v in stats.items() if not isinstance(v, dict))
    groups = [
        f"{name} (non-zero): " + " ".join(f"{k}={v}" for k, v in group.items() if v not in (0, None, False))
        for name, group in stats.items()
        if isinstance(group, dict)
    ]
    return "\n".join(wrap(line) for line in [scalars, *groups])


def operator_metrics(kubectl: Kubectl, limit: int = 14) -> list[str]:
    pods = kubectl.json("pods", "-l", fleet_setup.OPERATOR_LABEL)
    url = next(iter(fleet_setup.pod_urls(pods, fleet_setup.OPERATOR_METRICS_PORT).values()))
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("rolloutfleet_operator_") and "_bucket{" not in line and "_created{" not in line
    ]
    return [f"    ({url}/metrics)"] + [f"    {line}" for line in lines[:limit]]


def show_fleet(clock: Clock, kubectl: Kubectl, urls: dict[str, str]) -> list[dict[str, Any]]:
    """Prints the fleet's state; returns the Events shown."""
    clock.step("kubectl get rf,pods -o wide")
    print(kubectl("get", "rf,pods", "-n", NAMESPACE, "-o", "wide").rstrip())
    clock.step(f"{FLEET}'s status conditions")
    print(conditions_table(fleet_status(kubectl)))
    clock.step(f"kubectl get events for {FLEET} (posted by the operator)")
    events = fleet_events(kubectl)
    print(event_lines(events))
    name, url = next(iter(urls.items()))
    clock.step(f"{name}'s /stats")
    print(compact_stats(httpx.get(f"{url}/stats", timeout=10).json()))
    clock.step("the operator's /metrics (rolloutfleet_operator_*, histogram buckets left out)")
    print("\n".join(operator_metrics(kubectl)))
    return events


def live_session(url: str, key: str) -> tuple[str, str, dict[str, Any]]:
    """A live (unfinished) session with one turn on the proxy at `url`: id, key, recorded state."""
    sid, session_key = fleet_setup.create_session(url, key)
    messages = [{"role": "user", "content": "Remember the number 42."}]
    fleet_setup.one_turn(url, sid, session_key, messages)
    return sid, session_key, fleet_setup.session_tokens(url, sid, session_key)


def repair(clock: Clock, kubectl: Kubectl, urls: dict[str, str], key: str) -> None:
    name = list(urls)[-1]
    sid, session_key, before = live_session(urls[name], key)
    clock.step(
        f"a live session {sid} on {name} holds {before['num_tokens']} tokens; kubectl delete pod {name}"
    )
    uid = kubectl.json("pod", name)["metadata"]["uid"]
    kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")

    def probe() -> tuple[Any, str]:
        pod = kubectl.json("pod", name, missing_ok=True)
        status = fleet_status(kubectl)
        replaced = bool(pod) and pod["metadata"]["uid"] != uid
        if not pod:
            state = "gone"
        elif not replaced:
            state = "terminating (draining, dumping its sessions)"
        else:
            phase = pod.get("status", {}).get("phase", "Pending")
            state = f"replacement {phase}, ready={fleet_setup.pod_ready(pod)}"
        done = replaced and fleet_setup.pod_ready(pod) and fleet_setup.fleet_ready(status, PROXIES)
        return done, f"{name}: {state}; {status_line(status, PROXIES)}"

    wait_until(clock, f"{name} to come back", probe, REPAIR_TIMEOUT_S)
    url = pod_urls(kubectl, "proxy", fleet_setup.PROXY_PORT)[name]
    after = fleet_setup.session_tokens(url, sid, session_key)
    same = after["trajectory"] == before["trajectory"]
    clock.step(
        f"{name} is back at {url}: session {sid} restored with {after['num_tokens']} tokens "
        f"(before: {before['num_tokens']}; token ids and logprobs {'identical' if same else 'DIFFERENT'})"
    )
    if not same or after["num_tokens"] != before["num_tokens"]:
        raise RuntimeError(f"session {sid} was not restored intact on the replacement {name}")


def scale(clock: Clock, kubectl: Kubectl) -> None:
    clock.step(f"kubectl scale rf/{FLEET} --replicas={SCALED}")
    print(kubectl("scale", f"rf/{FLEET}", "-n", NAMESPACE, f"--replicas={SCALED}").rstrip())
    wait_fleet_ready(clock, kubectl, SCALED, REPAIR_TIMEOUT_S)
    print(kubectl("get", "rf", "-n", NAMESPACE).rstrip())
    print(
        kubectl("get", "pods", "-n", NAMESPACE, "-l", fleet_setup.component_selector(FLEET, "proxy")).rstrip()
    )


def proxy_rss(url: str) -> int:
    return httpx.get(f"{url}/stats", timeout=10).json()["rss_bytes"]


def guarded_proxy(kubectl: Kubectl) -> tuple[dict[str, Any] | None, str | None]:
    pods = kubectl.json("pods", "-l", fleet_setup.component_selector(MEMORY_FLEET, "proxy"))["items"]
    pod = next((p for p in pods if p["metadata"]["name"] == MEMORY_PROXY), None)
    ready = pod is not None and fleet_setup.pod_ready(pod) and not pod["metadata"].get("deletionTimestamp")
    return pod, (f"http://{pod['status']['podIP']}:{fleet_setup.PROXY_PORT}" if ready else None)


def watchdog_before_the_kernel(clock: Clock, kubectl: Kubectl, tokenizer_dir: Path, work: Path) -> None:
    """A one-proxy fleet under a cgroup memory limit grows past its RSS budget (below the limit);
    the watchdog replaces the proxy gracefully before the kernel would OOM-kill it, the replacement
    restores every turn, and near the budget new sessions are held back (503) instead. Its engine is
    the fixed-latency upstream stand-in on this machine: long turns, which the emulated engines'
    context would refuse."""
    stub = create_upstream_stub(0.01, 8)
    with serve_app(stub, host=BRIDGE_IP) as engine_url:
        fleet = fleet_setup.external_fleet(
            MEMORY_FLEET,
            NAMESPACE,
            tokenizer_dir,
            engine_url,
            1,
            dump={"hostPath": {"path": str(fleet_setup.pod_writable(work / "memory-dumps"))}},
            resources={"requests": {"memory": "128Mi"}, "limits": {"memory": f"{PROXY_MEMORY_LIMIT_MIB}Mi"}},
            memory={"rssBudgetBytes": 0, "checkIntervalSeconds": 1, "consecutiveSamples": 1},
        )
        clock.step(
            f"memory watchdog: fleet {MEMORY_FLEET}, one proxy, cgroup limit {PROXY_MEMORY_LIMIT_MIB} MiB"
        )
        kubectl("apply", "-f", "-", input=json.dumps(fleet))
        pod, url = wait_until(
            clock,
            f"{MEMORY_PROXY} Ready",
            lambda: ((found := guarded_proxy(kubectl))[1] and found, f"{MEMORY_PROXY} starting"),
            REPAIR_TIMEOUT_S,
        )
        resting = proxy_rss(url)
        budget = resting + BUDGET_ABOVE_REST_MIB * MIB
        memory = {"rssBudgetBytes": budget, "refuseNewSessionsPercent": 100, "cooldownSeconds": 30}
        kubectl(
            "patch", "rf", MEMORY_FLEET, "-n", NAMESPACE, "--type=merge", "-p",
            json.dumps({"spec": {"proxy": {"memory": memory}}}),
        )  # fmt: skip
        clock.step(
            f"{MEMORY_PROXY} rests at {resting / MIB:.0f} MiB; spec.proxy.memory.rssBudgetBytes = "
            f"{budget / MIB:.0f} MiB; growing it with sessions of {GROWTH_TURNS_PER_SESSION} turns of "
            f"{GROWTH_WORDS_PER_TURN} words (the kernel would kill it at {PROXY_MEMORY_LIMIT_MIB} MiB)"
        )
        key = fleet_setup.admin_key(kubectl.json("secret", f"{MEMORY_FLEET}-admin-key"))
        ledger = SessionLedger(key)
        uid = pod["metadata"]["uid"]
        session = None
        deadline = time.monotonic() + GROWTH_TIMEOUT_S
        while time.monotonic() < deadline:
            pod, url = guarded_proxy(kubectl)
            if pod is None or pod["metadata"]["uid"] != uid or url is None:
                break  # the watchdog is replacing it
            if session is None or len(session.delivered) >= GROWTH_TURNS_PER_SESSION:
                session = ledger.try_create(MEMORY_PROXY, url) or session
            if session is not None and ledger.try_turn(url, session, GROWTH_WORDS_PER_TURN):
                print(
                    f"    [{clock.elapsed()}] {ledger.delivered_turns()} turns delivered; RSS "
                    f"{proxy_rss(url) / MIB:.0f} MiB (budget {budget / MIB:.0f}, "
                    f"limit {PROXY_MEMORY_LIMIT_MIB})",
                    flush=True,
                )
        else:
            raise TimeoutError(f"{MEMORY_PROXY} was not replaced within {GROWTH_TIMEOUT_S}s")

        def probe() -> tuple[Any, str]:
            pod, url = guarded_proxy(kubectl)
            replaced = pod is not None and pod["metadata"]["uid"] != uid
            state = "replacement Ready, sessions restored" if replaced and url else "draining / starting"
            return (replaced and url), f"{MEMORY_PROXY}: {state}"

        url = wait_until(clock, f"{MEMORY_PROXY}'s replacement", probe, REPAIR_TIMEOUT_S)
        losses = ledger.check({MEMORY_PROXY: url})
        killed = fleet_setup.oom_kills(guarded_proxy(kubectl)[0] or {})
        clock.step(
            f"{MEMORY_PROXY} replaced by the watchdog before the kernel acted: "
            f"{len(ledger.sessions.get(MEMORY_PROXY, []))} sessions, {ledger.delivered_turns()} delivered "
            f"turns; on the replacement {losses.sessions} sessions and {losses.turns} turns missing or "
            f"different (checked token by token); RSS now {proxy_rss(url) / MIB:.0f} MiB; OOM-killed: "
            f"{killed or 'none'}"
        )
        status = kubectl.json("rf", MEMORY_FLEET).get("status", {})
        clock.step(f"status.memoryRestarts of {MEMORY_FLEET}: {json.dumps(status.get('memoryRestarts', {}))}")
        selector = f"involvedObject.kind=RolloutFleet,involvedObject.name={MEMORY_FLEET}"
        events = kubectl.json("events", "--field-selector", selector)["items"]
        print(event_lines(sorted(events, key=lambda e: e["metadata"]["creationTimestamp"])))
        kubectl("delete", "rf", MEMORY_FLEET, "-n", NAMESPACE)
        if losses.counts() != (0, 0) or killed:
            raise RuntimeError(f"the replacement of {MEMORY_PROXY} lost {losses} (OOM-killed: {killed})")


def show_fleet_and_repair(clock: Clock, kubectl: Kubectl, tokenizer_dir: Path, work: Path) -> None:
    apply_fleet(clock, kubectl, tokenizer_dir, work)
    key = fleet_setup.admin_key(kubectl.json("secret", f"{FLEET}-admin-key"))
    urls = pod_urls(kubectl, "proxy", fleet_setup.PROXY_PORT)
    run_sessions(clock, urls, key)
    seen = show_fleet(clock, kubectl, urls)
    repair(clock, kubectl, urls, key)
    scale(clock, kubectl)
    watchdog_before_the_kernel(clock, kubectl, tokenizer_dir, work)
    clock.step(f"{FLEET}'s Events since the first listing")
    seen_uids = {e["metadata"]["uid"] for e in seen}
    print(event_lines([e for e in fleet_events(kubectl) if e["metadata"]["uid"] not in seen_uids]))


def main(argv: list[str] | None = None) -> int:
    clock = Clock()
    cache = project_cache()
    work = Path(tempfile.mkdtemp(prefix="rolloutfleet-demo-"))
    tokenizer_dir = build_test_tokenizer(cache / "test-tokenizer")
    clock.step(
        "a real local Kubernetes (control plane, two kubelets with containerd, kube-proxy, CoreDNS) and"
        " the project's images, built from its Dockerfiles (cached by content), imported into the nodes"
    )
    images = ("proxy", "operator", "sglang-router", "testkit")
    with real_cluster(work / "cluster", images=images, gpu_images=("sglang-emulator",)) as node:
        kubectl = Kubectl(node.bin_dir / "kubectl", node.kubeconfig, NAMESPACE)
        print(kubectl("get", "nodes", "-o", "wide").rstrip())
        install_operator(clock, kubectl, node.bin_dir / "helm")
        show_fleet_and_repair(clock, kubectl, tokenizer_dir, work)
        clock.step("stopping the nodes (pods end) and the control plane")
    step(f"proxy dumps in {work / 'dumps'}")
    clock.step("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
