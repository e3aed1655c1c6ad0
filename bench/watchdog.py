"""Memory watchdog: API requests per check cycle, and RSS breach → replacement Ready, by fleet size.

Everything is real except the proxies: the local cluster (control plane, real kubelets with
containerd, kube-proxy, CoreDNS: rolloutfleet_testkit.node), the operator installed by its Helm
chart and running as a pod, and the real SGLang router as the fleet's gateway. The proxies are
/stats stand-ins (the test kit image with TESTKIT_PROGRAM=stats-standin, a TEST STAND-IN for the
proxy: rolloutfleet_testkit/stats_standin.py), so 64 of them fit on one small machine and the RSS
each reports is set by this script; on SIGTERM a stand-in drains like a proxy (/readyz 503 for
--drain-s), then exits.

For each fleet size N (one fleet at a time):
1. Apply a RolloutFleet of N stand-ins (budget 100 MiB, every stand-in reporting 50 MiB) and wait
   until all N are Ready.
2. Steady state: for about --steady-cycles watchdog cycles nothing is over budget. The operator's
   /metrics (rolloutfleet_operator_watchdog_api_requests_total / _cycles_total) at the start and
   the end give the API requests per cycle; its process's CPU time gives the CPU per cycle (the
   whole operator: kopf, the fleet's 10 s resync pass and the watchdog).
3. --restarts times, one proxy at a time: the script tells a stand-in to report 150 MiB. The
   stand-in records the wall time of its first /stats answer above the budget (the watchdog's
   first over-budget sample); the script polls the pod every 0.2 s until a replacement under the
   same name is Ready. The operator's /metrics, scraped every 0.25 s meanwhile, give the requests of
   each cycle, so those of the cycles in which a restart happened.

Then (--real-proxies, default 4) a fleet of real proxies: the budget is lowered below what they
report, each is restarted once, and the script measures each pod's deletion → replacement Ready
(a real proxy does not record when it was sampled), the part a stand-in cannot show.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import IMAGES, progress, save_figure, save_result, tokenizer_dir, upstream_stub
from prometheus_client.parser import text_string_to_metric_families
from rolloutfleet_operator.kubeapi import KubeApi, load_configuration, resource_path
from rolloutfleet_operator.plan import is_ready
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.images import ensure_images
from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.node import real_cluster
from rolloutfleet_testkit.node.config import BRIDGE_IP

NAMESPACE = "watchdog-bench"
RELEASE = "wd"
OPERATOR_SELECTOR = "app.kubernetes.io/name=rolloutfleet-operator"
METRICS_PORT = 8080  # the chart's metricsPort
PROXY_PORT = 8000
STANDIN_IMAGE = fleet_setup.TESTKIT_IMAGE  # with TESTKIT_PROGRAM=stats-standin
MIB = 2**20
BUDGET = 100 * MIB
WITHIN = 50 * MIB
OVER = 150 * MIB
METRIC_PREFIX = "rolloutfleet_operator_"


# --- the cluster ---------------------------------------------------------------------------------


@dataclass
class Cluster:
    kubectl: Kubectl
    api: KubeApi  # the API server with the admin credentials (raw JSON, fast to poll)
    operator_ip: str

    def pod(self, name: str) -> dict | None:
        return self.api.get(resource_path("v1", "Pod", NAMESPACE, name))

    def fleet_pods(self, fleet: str) -> list[dict]:
        return self.api.list("v1", "Pod", NAMESPACE, fleet_setup.component_selector(fleet, "proxy"))


@contextlib.contextmanager
def local_cluster(work: Path) -> Iterator[Cluster]:
    """The local cluster (real nodes), the images, CRDs and the operator installed by its chart."""
    with real_cluster(work / "cluster") as node:
        progress("importing the images into the nodes")
        ensure_images(("proxy", "operator", "testkit"), node.containerd_addresses)
        kubectl = Kubectl(node.bin_dir / "kubectl", node.kubeconfig, NAMESPACE)
        kubectl("apply", "-f", str(fleet_setup.CRDS))
        kubectl("wait", "--for=condition=Established", "crd/rolloutfleets.rolloutfleet.dev", "--timeout=60s")
        kubectl("create", "namespace", NAMESPACE)
        progress("installing the operator with helm (it runs as a pod)")
        args = fleet_setup.helm_install_args(RELEASE, NAMESPACE, [NAMESPACE])
        subprocess.run(
            [str(node.bin_dir / "helm"), "--kubeconfig", node.kubeconfig, *args],
            check=True,
            capture_output=True,
            timeout=300,
        )
        pods = kubectl.json("pods", "-l", OPERATOR_SELECTOR)
        operator_ip = pods["items"][0]["status"]["podIP"]
        api = KubeApi(load_configuration(node.kubeconfig))
        try:
            yield Cluster(kubectl, api, operator_ip)
        finally:
            api.close()


def operator_process() -> psutil.Process | None:
    """The operator container's process (a process of this machine, in the pod's namespaces)."""
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = process.info["cmdline"] or []
            if "rolloutfleet_operator" in cmdline and "python" in (cmdline[0] if cmdline else ""):
                return process
    return None


def cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return float("nan")
    times = process.cpu_times()
    return times.user + times.system


# --- the operator's metrics ------------------------------------------------------------------------


def scrape(url: str, fleet: str) -> dict[str, float]:
    """The fleet's watchdog counters: cycles, api_requests, polls, restarts (OverBudget)."""
    text = httpx.get(url, timeout=5).text
    wanted = {
        "rolloutfleet_operator_watchdog_cycles": "cycles",
        "rolloutfleet_operator_watchdog_api_requests": "api_requests",
        "rolloutfleet_operator_watchdog_polls": "polls",
        "rolloutfleet_operator_memory_restarts": "restarts",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            if not sample.name.endswith("_total") or labels.get("fleet") != fleet:
                continue
            if key == "restarts" and labels.get("reason") != "OverBudget":
                continue
            found[key] += sample.value
    return found


@dataclass
class CycleLog:
    """Per-cycle API requests from the operator's counters, scraped every `period_s`.

    The request counter is incremented when a cycle ends, together with the cycle counter, so the
    difference between two scrapes that saw one more cycle is exactly that cycle's requests. The
    restart and poll counters move during a cycle; their increments go to the next cycle seen to
    end. While `paused`, nothing is scraped (the scrapes cost the operator CPU too).
    """

    url: str
    fleet: str
    period_s: float = 0.25
    phase: str = "start"
    paused: bool = False
    cycles: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, float] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _pending: dict[str, float] = field(default_factory=lambda: {"restarts": 0.0, "polls": 0.0})

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.paused:
                with contextlib.suppress(httpx.HTTPError):
                    self._record(scrape(self.url, self.fleet), time.time())
            self._stop.wait(self.period_s)

    def _record(self, now: dict[str, float], at: float) -> None:
        if self.last is not None:
            for key in self._pending:
                self._pending[key] += now[key] - self.last[key]
            ended = int(now["cycles"] - self.last["cycles"])
            if ended > 0:
                self.cycles.append(
                    {
                        "ended_at": at,
                        "phase": self.phase,
                        "cycles": ended,  # > 1 only if a scrape was late: the requests are their sum
                        "api_requests": now["api_requests"] - self.last["api_requests"],
                        **self._pending,
                    }
                )
                self._pending = dict.fromkeys(self._pending, 0.0)
        self.last = now

    def pause(self) -> None:
        self.paused = True
        time.sleep(self.period_s * 2)  # a scrape in progress ends

    def resume(self) -> None:
        self.last = None  # the cycles while paused are not attributed one by one
        self._pending = dict.fromkeys(self._pending, 0.0)
        self.paused = False

    def wait_cycles(self, count: int, timeout_s: float) -> None:
        """Until `count` more cycles have ended."""
        target = self.total() + count
        deadline = time.monotonic() + timeout_s
        while self.total() < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} watchdog cycles did not end within {timeout_s}s")
            time.sleep(0.1)

    def total(self) -> int:
        return int(self.last["cycles"]) if self.last else 0

    def __enter__(self) -> CycleLog:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# --- one fleet size --------------------------------------------------------------------------------


def fleet_manifest(name: str, replicas: int, args: argparse.Namespace, work: Path, engine: str) -> dict:
    return fleet_setup.external_fleet(
        name,
        NAMESPACE,
        tokenizer_dir(),  # required by the CRD; the stand-in reads neither it nor the dumps
        engine,
        replicas,
        image=STANDIN_IMAGE,
        dump={"hostPath": {"path": str(fleet_setup.pod_writable(work / "dumps"))}},
        env=[
            {"name": "TESTKIT_PROGRAM", "value": "stats-standin"},
            {"name": "STANDIN_DRAIN_S", "value": str(args.drain_s)},
            {"name": "STANDIN_RSS_BYTES", "value": str(WITHIN)},
            {"name": "STANDIN_RSS_THRESHOLD_BYTES", "value": str(BUDGET)},
        ],
        memory={
            "rssBudgetBytes": BUDGET,
            "checkIntervalSeconds": args.interval_s,
            "consecutiveSamples": args.consecutive_samples,
            "maxUnavailable": 1,
            "cooldownSeconds": 600,
        },
    )


def ready(pod: dict | None) -> bool:
    return bool(pod) and not pod["metadata"].get("deletionTimestamp") and is_ready(pod)


def ready_since(pod: dict) -> float | None:
    """The Ready condition's lastTransitionTime as epoch seconds (the API has 1 s resolution)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == "Ready" and c.get("lastTransitionTime"):
            stamp = c["lastTransitionTime"].replace("Z", "+00:00")
            return datetime.datetime.fromisoformat(stamp).timestamp()
    return None


def wait_all_ready(cluster: Cluster, fleet: str, replicas: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    last_count = -1
    while True:
        pods = [p for p in cluster.fleet_pods(fleet) if ready(p)]
        if len(pods) == replicas:
            return pods
        if len(pods) != last_count and len(pods) % 8 == 0:
            progress(f"  {len(pods)}/{replicas} proxies Ready")
        last_count = len(pods)
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(pods)} of {replicas} proxies Ready after {timeout_s}s")
        time.sleep(0.5)


def one_restart(cluster: Cluster, pod_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Make one stand-in report an RSS over the budget; follow it until its replacement is Ready."""
    old = cluster.pod(pod_name)
    assert old is not None and ready(old), pod_name
    old_uid = old["metadata"]["uid"]
    url = f"http://{old['status']['podIP']}:{PROXY_PORT}"
    answer = httpx.post(f"{url}/standin/control", json={"rss_bytes": OVER}, timeout=5)
    answer.raise_for_status()
    breached_at = time.time()
    state: dict | None = None
    seen: dict[str, float] = {}
    deadline = time.monotonic() + args.interval_s * (args.consecutive_samples + 2) + 90
    new: dict | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):  # until the old stand-in has exited
            state = httpx.get(f"{url}/standin/state", timeout=1).json()
        pod = cluster.pod(pod_name)
        now = time.time()  # after the read: what it saw was true by now
        if pod is not None and pod["metadata"]["uid"] == old_uid:
            if pod["metadata"].get("deletionTimestamp"):
                seen.setdefault("deleting", now)
        else:
            seen.setdefault("deleting", now)
            if pod is None:
                seen.setdefault("gone", now)
            else:
                seen.setdefault("gone", now)
                seen.setdefault("replacement_created", now)
                if ready(pod):
                    seen["replacement_ready"] = now
                    new = pod
                    break
        time.sleep(0.2)
    if new is None or state is None or not state["over_threshold_at"]:
        raise RuntimeError(f"{pod_name}: no replacement Ready in time (seen {seen}, stand-in state {state})")
    first = state["over_threshold_at"][0]
    decided = state["over_threshold_at"][min(args.consecutive_samples, len(state["over_threshold_at"])) - 1]
    ready_at = seen["replacement_ready"]
    record = {
        "pod": pod_name,
        "old_uid": old_uid,
        "new_uid": new["metadata"]["uid"],
        "breached_at": breached_at,
        "first_over_budget_sample_at": first,
        "deciding_sample_at": decided,
        "over_budget_samples": len(state["over_threshold_at"]),
        "seen": seen,
        "ready_condition_since": ready_since(new),
        "breach_to_first_sample_s": round(first - breached_at, 3),
        "first_sample_to_ready_s": round(ready_at - first, 3),
        "deciding_sample_to_ready_s": round(ready_at - decided, 3),
        "first_sample_to_deletion_seen_s": round(seen["deleting"] - first, 3),
        "deletion_to_replacement_created_s": round(seen["replacement_created"] - seen["deleting"], 3),
        "replacement_created_to_ready_s": round(ready_at - seen["replacement_created"], 3),
    }
    progress(
        f"  {pod_name}: first over-budget sample {record['breach_to_first_sample_s']:.1f}s after the breach; "
        f"replacement Ready {record['first_sample_to_ready_s']:.2f}s after it "
        f"(deletion seen +{record['first_sample_to_deletion_seen_s']:.2f}s, replacement created "
        f"+{record['deletion_to_replacement_created_s']:.2f}s later, Ready "
        f"+{record['replacement_created_to_ready_s']:.2f}s later)"
    )
    return record


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


def measure_size(
    cluster: Cluster, replicas: int, args: argparse.Namespace, work: Path, engine: str
) -> dict[str, Any]:
    name = f"wd-{replicas}"
    progress(f"fleet {name}: {replicas} stand-in proxies")
    applied = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet_manifest(name, replicas, args, work, engine)))
    wait_all_ready(cluster, name, replicas, timeout_s=120 + 3 * replicas)
    proxies_ready_s = time.monotonic() - applied
    progress(f"  all {replicas} Ready {proxies_ready_s:.1f}s after the fleet was applied")
    metrics_url = f"http://{cluster.operator_ip}:{METRICS_PORT}/metrics"
    operator = operator_process()
    cycle_timeout = args.interval_s * 4 + 30
    with CycleLog(metrics_url, name) as log:
        log.wait_cycles(2, cycle_timeout)  # past the first cycle (which also reads the fleet once)
        # Steady state, without the frequent scrapes: the counters and the operator's CPU time at
        # the start and the end of a window of about `steady_cycles` cycles.
        log.pause()
        first, cpu_before = scrape(metrics_url, name), cpu_seconds(operator)
        time.sleep(args.steady_cycles * args.interval_s)
        last, cpu_after = scrape(metrics_url, name), cpu_seconds(operator)
        log.resume()
        steady_cycles = last["cycles"] - first["cycles"]
        steady = {
            "cycles": steady_cycles,
            "api_requests_per_cycle": round(
                (last["api_requests"] - first["api_requests"]) / steady_cycles, 3
            ),
            "polls_per_cycle": round((last["polls"] - first["polls"]) / steady_cycles, 3),
            "restarts": last["restarts"] - first["restarts"],
            "operator_cpu_ms_per_cycle": round((cpu_after - cpu_before) / steady_cycles * 1000, 1),
        }
        progress(
            f"  steady state: {steady['api_requests_per_cycle']} API requests per cycle over "
            f"{int(steady_cycles)} cycles, {steady['polls_per_cycle']:.0f} polls, operator CPU "
            f"{steady['operator_cpu_ms_per_cycle']} ms per cycle"
        )
        log.phase = "restarts"
        restarts = []
        for i in range(args.restarts):
            pod = f"{name}-proxy-{(i * max(1, replicas // args.restarts)) % replicas}"
            restarts.append(one_restart(cluster, pod, args))
            log.wait_cycles(2, cycle_timeout)  # the status settles before the next one
        restart_cycles = [c for c in log.cycles if c["restarts"] > 0 and c["cycles"] == 1]
        other_cycles = [c for c in log.cycles if c["phase"] == "restarts" and c["restarts"] == 0]
        # Cycle period = check interval + the cycle's own duration (the interval is a pause between
        # cycles); from consecutive single cycles seen by the 0.25 s scrapes.
        timed = [c for c in log.cycles if c["phase"] == "restarts"]
        gaps = [
            b["ended_at"] - a["ended_at"]
            for a, b in itertools.pairwise(timed)
            if a["cycles"] == 1 and b["cycles"] == 1
        ]
        steady["cycle_period_s"] = round(statistics.fmean(gaps), 2) if gaps else None
    restarted = sum(c["restarts"] for c in log.cycles)
    status = cluster.kubectl.json("rf", name)["status"]
    progress(f"  deleting fleet {name}")
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--timeout=120s")
    deadline = time.monotonic() + 180
    while cluster.fleet_pods(name) and time.monotonic() < deadline:
        time.sleep(1)
    return {
        "replicas": replicas,
        "proxies_ready_after_apply_s": round(proxies_ready_s, 1),
        "steady": steady,
        "restart_cycles": {
            "api_requests": [c["api_requests"] for c in restart_cycles],
            "api_requests_per_cycle": summary([c["api_requests"] for c in restart_cycles]),
        },
        "other_cycles_during_restarts": {
            "api_requests": [c["api_requests"] / c["cycles"] for c in other_cycles],
        },
        "memory_restarts_counted": restarted,
        "memory_restarts_in_status": (status.get("memoryRestarts") or {}).get("total"),
        "restarts": restarts,
        "first_sample_to_ready_s": summary([r["first_sample_to_ready_s"] for r in restarts]),
        "deciding_sample_to_ready_s": summary([r["deciding_sample_to_ready_s"] for r in restarts]),
        "cycles": log.cycles,
    }


def measure_real_proxies(
    cluster: Cluster, replicas: int, args: argparse.Namespace, work: Path, engine: str
) -> dict[str, Any]:
    """Real proxies (the proxy image, on the real nodes):
    the budget is lowered below what every proxy reports, so each is restarted once, one at a
    time (the replacement, over budget as well, is then held in its cooldown). A real proxy does
    not record when it was sampled, so this measures the pod's deletion → its replacement Ready:
    the part a stand-in cannot show (a real drain, imports, tokenizer load, restore)."""
    name = f"wd-real-{replicas}"
    progress(f"fleet {name}: {replicas} real proxies")
    manifest = fleet_manifest(name, replicas, args, work, engine)
    proxy = manifest["spec"]["proxy"]
    del proxy["image"], proxy["env"]
    proxy["tokenizer"]["path"] = "/models/tokenizer"
    proxy["memory"]["rssBudgetBytes"] = 0  # off until the budget is set from what they report
    applied = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    pods = wait_all_ready(cluster, name, replicas, timeout_s=300)
    proxies_ready_s = time.monotonic() - applied
    rss = {
        p["metadata"]["name"]: httpx.get(
            f"http://{p['status']['podIP']}:{PROXY_PORT}/stats", timeout=10
        ).json()["rss_bytes"]
        for p in pods
    }
    budget = min(rss.values()) - 10 * MIB
    progress(
        f"  all {replicas} Ready {proxies_ready_s:.1f}s after the fleet was applied; RSS "
        f"{sorted(round(v / MIB) for v in rss.values())} MiB; setting the budget to {budget / MIB:.0f} MiB"
    )
    original = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    seen: dict[str, dict[str, float]] = {n: {} for n in original}
    patch = {"spec": {"proxy": {"memory": {"rssBudgetBytes": budget}}}}
    cluster.kubectl("patch", "rf", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))
    patched_at = time.time()
    deadline = time.monotonic() + 60 * replicas + 60
    while time.monotonic() < deadline and not all("replacement_ready" in v for v in seen.values()):
        current = {p["metadata"]["name"]: p for p in cluster.fleet_pods(name)}
        now = time.time()
        for pod_name, uid in original.items():
            pod = current.get(pod_name)
            if pod is not None and pod["metadata"]["uid"] == uid:
                if pod["metadata"].get("deletionTimestamp"):
                    seen[pod_name].setdefault("deleting", now)
                continue
            seen[pod_name].setdefault("deleting", now)
            if pod is not None:
                seen[pod_name].setdefault("replacement_created", now)
                if ready(pod) and "replacement_ready" not in seen[pod_name]:
                    seen[pod_name]["replacement_ready"] = now
                    progress(
                        f"  {pod_name}: replacement Ready "
                        f"{now - seen[pod_name]['deleting']:.2f}s after its deletion was seen"
                    )
        time.sleep(0.2)
    restarts = [
        {
            "pod": pod_name,
            **{k: round(v - patched_at, 3) for k, v in times.items()},
            "deletion_to_ready_s": round(times["replacement_ready"] - times["deleting"], 3),
            "deletion_to_replacement_created_s": round(times["replacement_created"] - times["deleting"], 3),
            "replacement_created_to_ready_s": round(
                times["replacement_ready"] - times["replacement_created"], 3
            ),
        }
        for pod_name, times in sorted(seen.items(), key=lambda item: item[1].get("deleting", 1e18))
        if "replacement_ready" in times
    ]
    progress(f"  deleting fleet {name}")
    cluster.kubectl("delete", "rf", name, "-n", NAMESPACE, "--timeout=120s")
    wait_deadline = time.monotonic() + 180
    while cluster.fleet_pods(name) and time.monotonic() < wait_deadline:
        time.sleep(1)
    return {
        "replicas": replicas,
        "proxies_ready_after_apply_s": round(proxies_ready_s, 1),
        "rss_bytes": rss,
        "budget_bytes": budget,
        "restarted": len(restarts),
        "budget_set_to_first_deletion_s": min((r["deleting"] for r in restarts), default=None),
        "restarts": restarts,
        "deletion_to_ready_s": summary([r["deletion_to_ready_s"] for r in restarts]),
    }


# --- output --------------------------------------------------------------------------------------


def plot(runs: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["replicas"] for r in runs]
    labels = [str(s) for s in sizes]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    steady = [r["steady"]["api_requests_per_cycle"] for r in runs]
    restart = [r["restart_cycles"]["api_requests_per_cycle"].get("mean", float("nan")) for r in runs]
    left.plot(labels, steady, "o-", label="steady-state cycle")
    left.plot(labels, restart, "s-", label="cycle with a restart")
    left.set_ylim(0, max(6, *(v + 1 for v in restart if v == v)))
    left.set_xlabel("proxies in the fleet")
    left.set_ylabel("Kubernetes API requests per cycle")
    left.set_title("API requests per watchdog cycle")
    left.legend(loc="lower right")

    middle.bar(labels, [r["steady"]["operator_cpu_ms_per_cycle"] for r in runs], color="C2")
    middle.set_xlabel("proxies in the fleet")
    middle.set_ylabel("ms of operator CPU per cycle")
    middle.set_title("Operator CPU per steady cycle (whole process)")

    parts = (
        ("first_sample_to_deletion_seen_s", "sample → pod deleting"),
        ("deletion_to_replacement_created_s", "deleting → replacement created (drain)"),
        ("replacement_created_to_ready_s", "created → Ready (start, probes)"),
    )
    bottom = [0.0] * len(runs)
    for key, label in parts:
        values = [statistics.fmean(x[key] for x in r["restarts"]) for r in runs]
        right.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(runs):
        values = [x["first_sample_to_ready_s"] for x in r["restarts"]]
        right.scatter([labels[i]] * len(values), values, color="k", s=12, zorder=3)
    goal = args.interval_s + args.drain_s
    right.axhline(goal, color="r", linestyle="--", label=f"goal: check interval + drain ({goal:g} s)")
    top = max(x["first_sample_to_ready_s"] for r in runs for x in r["restarts"])
    right.set_ylim(0, max(goal, top) * 1.45)
    right.set_xlabel("proxies in the fleet")
    right.set_ylabel("seconds (bars: mean; dots: each restart)")
    right.set_title("First over-budget sample → replacement Ready")
    right.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--interval-s", type=int, default=5, help="spec.proxy.memory.checkIntervalSeconds")
    parser.add_argument(
        "--consecutive-samples",
        type=int,
        default=1,
        help="spec.proxy.memory.consecutiveSamples (1: the first over-budget sample decides)",
    )
    parser.add_argument("--drain-s", type=float, default=1.0, help="the stand-ins' drain time")
    parser.add_argument("--steady-cycles", type=int, default=6)
    parser.add_argument("--restarts", type=int, default=4, help="per fleet size, one after another")
    parser.add_argument("--real-proxies", type=int, default=4, help="a fleet of real proxies too (0: none)")
    args = parser.parse_args()
    runs = []
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-watchdog-") as tmp,
        local_cluster(Path(tmp)) as cluster,
        upstream_stub(Path(tmp), 0.01, 8, host=BRIDGE_IP) as (engine, _),
    ):
        progress(f"operator pod at {cluster.operator_ip}; /metrics on port {METRICS_PORT}")
        for size in args.sizes:
            runs.append(measure_size(cluster, size, args, Path(tmp), engine))
        real = (
            measure_real_proxies(cluster, args.real_proxies, args, Path(tmp), engine)
            if args.real_proxies
            else None
        )
    progress(f"done in {time.monotonic() - started:.0f}s")
    for r in runs:
        to_ready = r["first_sample_to_ready_s"]
        progress(
            f"N={r['replicas']:>3}: {r['steady']['api_requests_per_cycle']} requests per steady cycle, "
            f"{r['restart_cycles']['api_requests']} in cycles with a restart; first over-budget sample → "
            f"Ready mean {to_ready['mean']} s (max {to_ready['max']} s)"
        )
    if real:
        progress(
            f"real proxies: {real['restarted']} of {real['replicas']} restarted; "
            f"deletion → replacement Ready mean {real['deletion_to_ready_s'].get('mean')} s"
        )
    plot(runs, args, IMAGES / "watchdog.png")
    save_result(
        "watchdog",
        {
            "args": vars(args),
            "setup": {
                "proxies": "the /stats stand-in (test stand-in for the proxy: /stats, probes, drain)",
                "operator": "installed with its Helm chart, running as a pod on a real kubelet (containerd)",
                "rss_budget_bytes": BUDGET,
                "reported_rss_within_bytes": WITHIN,
                "reported_rss_over_bytes": OVER,
                "goal_s": args.interval_s + args.drain_s,
            },
            "runs": runs,
            "real_proxies": real,
        },
    )


if __name__ == "__main__":
    main()
