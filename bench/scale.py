"""Scale: many RolloutFleets at once on KWOK's simulated nodes (default 100 fleets of 16 proxies).

The control plane is the local one (etcd, kube-apiserver, controller manager, scheduler, built from
the Go module proxy); the nodes are simulated by KWOK's controller (rolloutfleet_testkit.controlplane
.kwok): pods are scheduled, become Running and Ready and are deleted as on a real cluster, but no
kubelet and no container runs. The operator is the real one, `python -m rolloutfleet_operator` on
this machine, with leader election as the chart runs it, under the chart's own ServiceAccount and
RBAC (installed with replicaCount 0), so that the API server's audit log counts its requests.

1. Apply every fleet in one `kubectl apply` and time until each fleet's status says Ready with all
   its proxies (from the fleets' status, polled every 2 s): when the first, the median and the last
   fleet got there; the operator's requests meanwhile.
2. Once the operator has written nothing for --settle-s (the creations' Events drain after all are
   Ready, at the operator's client-side rate limit), count its requests over --window-s at rest.
3. Throughout, sample the operator process's RSS and CPU (psutil) every second.

Fleets use external engines (no engine pods) and the memory watchdog is off (rssBudgetBytes 0):
simulated pods have addresses nothing answers at, so /stats polls could only fail. The watchdog's
costs with real pods are `./dev bench watchdog`'s. Progress lines come every 5 s; every wait is
bounded (--timeout-s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml
from common import IMAGES, cpu_seconds, percentile, progress, save_figure, save_result
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.controlplane import audit, kwok
from rolloutfleet_testkit.processes import ServerProcess, free_ports, python_module

NAMESPACE = "scale-bench"
RELEASE = "sc"
OPERATOR_SA = f"{RELEASE}-rolloutfleet-operator"  # the chart's ServiceAccount and Lease name
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SA}"
ENGINE_URL = "http://engine.invalid:30000"  # external engines: no router runs to ask them
DUMP = {"hostPath": {"path": "/var/lib/rolloutfleet-scale"}}  # never mounted: no kubelet
PODS_PER_NODE = 250  # kwok.fake_node's capacity
POLL_S = 2.0
SAMPLE_S = 1.0
PROGRESS_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, default=100)
    parser.add_argument("--proxies", type=int, default=16, help="proxies per fleet")
    parser.add_argument("--nodes", type=int, default=20, help="simulated nodes")
    parser.add_argument("--window-s", type=float, default=120.0, help="the at-rest counting window")
    parser.add_argument("--settle-s", type=float, default=30.0, help="wait after all Ready before counting")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="bound on apply -> all Ready")
    parser.add_argument("--api-qps", type=float, default=None, help="the operator's --api-qps (its default)")
    parser.add_argument(
        "--api-burst", type=int, default=None, help="the operator's --api-burst (its default)"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip docs/img/scale.png (smoke runs)")
    args = parser.parse_args(argv)
    for name in ("fleets", "proxies", "nodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.window_s <= 0 or args.timeout_s <= 0 or args.settle_s < 0:
        parser.error("--window-s and --timeout-s must be positive, --settle-s not negative")
    pods = args.fleets * (args.proxies + 1)  # each fleet's proxies and its gateway
    if pods > args.nodes * PODS_PER_NODE:
        parser.error(f"{pods} pods do not fit on {args.nodes} nodes of {PODS_PER_NODE} pods")
    return args


def fleet_name(i: int) -> str:
    return f"sc{i:03d}"


def fleet_manifest(name: str, proxies: int) -> dict:
    return fleet_setup.external_fleet(
        name,
        NAMESPACE,
        "/models/tokenizer",  # required by the CRD; nothing mounts it on a simulated node
        ENGINE_URL,
        proxies,
        dump=DUMP,
        memory={"rssBudgetBytes": 0},  # the watchdog off: nothing answers /stats (module docstring)
    )


def ready_fleets(items: list[dict], proxies: int) -> set[str]:
    """Names of the fleets whose status says Ready with all `proxies` updated and ready (pure)."""
    return {f["metadata"]["name"] for f in items if fleet_setup.fleet_ready(f.get("status") or {}, proxies)}


def ready_proxies(items: list[dict]) -> int:
    return sum((f.get("status") or {}).get("readyReplicas") or 0 for f in items)


def ready_summary(ready_at: dict[str, float], fleets: int) -> dict:
    """Seconds from apply to the first, median, 90th percentile and last fleet Ready (pure)."""
    times = sorted(ready_at.values())
    return {
        "fleets_ready": len(times),
        "first_s": round(times[0], 1) if times else None,
        "median_s": round(statistics.median(times), 1) if times else None,
        "p90_s": round(percentile(times, 90), 1) if times else None,
        "all_ready_s": round(times[-1], 1) if len(times) == fleets else None,
    }


def per_minute(count: int, seconds: float) -> float:
    return round(count / (seconds / 60), 2)


def token_kubeconfig(admin_kubeconfig: str, token: str) -> str:
    """The admin kubeconfig's cluster with a bearer token as its only user (pure)."""
    config = yaml.safe_load(admin_kubeconfig)
    for user in config["users"]:
        user["user"] = {"token": token}
    return json.dumps(config)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# --- the operator process and its samples -----------------------------------------------------------


@dataclass
class Samples:
    """(seconds since start, RSS bytes, CPU seconds) of the operator, every SAMPLE_S."""

    process: psutil.Process
    started: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, int, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.take()

    def take(self) -> tuple[float, int, float]:
        with self.process.oneshot():
            row = (time.monotonic() - self.started, self.process.memory_info().rss, cpu_seconds(self.process))
        self.rows.append(row)
        return row

    def between(self, start: float, end: float) -> list[tuple[float, int, float]]:
        return [r for r in self.rows if start <= r[0] <= end]

    def stop(self) -> None:
        self._stop.set()


def usage(rows: list[tuple[float, int, float]]) -> dict:
    """RSS (peak, last) and CPU (cores: CPU seconds per second) over a stretch of samples (pure)."""
    if len(rows) < 2:
        return {}
    seconds = rows[-1][0] - rows[0][0]
    return {
        "seconds": round(seconds, 1),
        "rss_peak_mib": round(max(r[1] for r in rows) / 2**20, 1),
        "rss_last_mib": round(rows[-1][1] / 2**20, 1),
        "cpu_cores": round((rows[-1][2] - rows[0][2]) / seconds, 3),
        "cpu_seconds": round(rows[-1][2] - rows[0][2], 2),
    }


@contextlib.contextmanager
def operator(cluster: kwok.SimulatedCluster, work: Path, args: argparse.Namespace) -> Iterator[Samples]:
    """The chart's RBAC (no Deployment), a token of its ServiceAccount, and the operator run here
    under it; yields its samples, sampled in a thread."""
    kubectl = cluster.kubectl(NAMESPACE)
    kubectl("apply", "-f", str(fleet_setup.CRDS))
    kubectl.wait_established("rolloutfleets.rolloutfleet.dev")
    kubectl("create", "namespace", NAMESPACE)
    progress("installing the chart's RBAC (replicaCount 0: the operator runs here, under its account)")
    install = fleet_setup.helm_install_args(RELEASE, NAMESPACE, [NAMESPACE], {"replicaCount": "0"})
    subprocess.run(
        [str(cluster.bin_dir / "helm"), "--kubeconfig", cluster.kubeconfig, *install],
        check=True,
        capture_output=True,
        timeout=300,
    )
    token = kubectl("create", "token", OPERATOR_SA, "-n", NAMESPACE, "--duration=24h").strip()
    config = work / "operator.kubeconfig"
    config.write_text(token_kubeconfig(Path(cluster.kubeconfig).read_text(), token))
    metrics_port, health_port = free_ports(2)
    command = python_module(
        "rolloutfleet_operator",
        "--namespace",
        NAMESPACE,
        "--leader-election",
        "--leader-election-namespace",
        NAMESPACE,
        "--leader-election-id",
        OPERATOR_SA,
        "--bind-address",
        "127.0.0.1",
        "--metrics-port",
        str(metrics_port),
        "--health-port",
        str(health_port),
        *(["--api-qps", str(args.api_qps)] if args.api_qps is not None else []),
        *(["--api-burst", str(args.api_burst)] if args.api_burst is not None else []),
    )
    env = {"KUBECONFIG": str(config), "POD_NAME": "scale-bench-operator"}
    with ServerProcess(command, work / "operator.log", env=env) as process:
        process.wait_ready(f"http://127.0.0.1:{health_port}/healthz", 120)
        samples = Samples(psutil.Process(process.pid))
        thread = threading.Thread(target=samples.run, name="operator-samples", daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            samples.stop()
            thread.join()
            if process.process.poll() is not None:
                raise RuntimeError(f"the operator exited:\n{process.log_tail()}")


# --- the run ------------------------------------------------------------------------------------------


def wait_all_ready(
    cluster: kwok.SimulatedCluster, samples: Samples, args: argparse.Namespace, applied: float
) -> tuple[dict[str, float], list[tuple[float, int, int]]]:
    """Each fleet's seconds from apply to Ready, and the timeline (seconds, fleets Ready, proxies Ready)."""
    kubectl = cluster.kubectl(NAMESPACE)
    ready_at: dict[str, float] = {}
    timeline: list[tuple[float, int, int]] = []
    last_progress = 0.0
    total_proxies = args.fleets * args.proxies
    while True:
        items = kubectl.json("rf")["items"]
        elapsed = time.monotonic() - applied
        for name in ready_fleets(items, args.proxies) - ready_at.keys():
            ready_at[name] = elapsed
        timeline.append((elapsed, len(ready_at), ready_proxies(items)))
        if elapsed - last_progress >= PROGRESS_S or len(ready_at) == args.fleets:
            last_progress = elapsed
            _, rss, _ = samples.rows[-1] if samples.rows else (0, 0, 0)
            progress(
                f"  {elapsed:6.1f}s after apply: {len(ready_at)}/{args.fleets} fleets Ready, "
                f"{timeline[-1][2]}/{total_proxies} proxies ready, operator RSS {rss / 2**20:.0f} MiB"
            )
        if len(ready_at) == args.fleets:
            return ready_at, timeline
        if elapsed > args.timeout_s:
            raise TimeoutError(f"{len(ready_at)} of {args.fleets} fleets Ready after {args.timeout_s} s")
        time.sleep(POLL_S)


def run(cluster: kwok.SimulatedCluster, work: Path, args: argparse.Namespace) -> dict:
    with operator(cluster, work, args) as samples:
        time.sleep(3)  # the operator's watches established, its resting footprint sampled
        idle = usage(samples.rows)
        manifests = [fleet_manifest(fleet_name(i), args.proxies) for i in range(args.fleets)]
        progress(f"applying {args.fleets} fleets x {args.proxies} proxies in one kubectl apply")
        since = now()
        applied = time.monotonic()
        applied_at = applied - samples.started
        cluster.kubectl(NAMESPACE)("apply", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
        ready_at, timeline = wait_all_ready(cluster, samples, args, applied)
        all_ready_at = time.monotonic() - samples.started
        rollout_requests = audit.tally(audit.requests_of(cluster.audit_log, OPERATOR_USER, since, now()))
        rollout = {
            **ready_summary(ready_at, args.fleets),
            **{k: rollout_requests[k] for k in ("requests", "writes", "lease_requests")},
            "requests_per_fleet": round(rollout_requests["requests"] / args.fleets, 1),
            "by_verb_and_resource": rollout_requests["by_verb_and_resource"],
            "operator": usage(samples.between(applied_at, all_ready_at)),
        }
        progress(f"all {args.fleets} fleets Ready {rollout['all_ready_s']} s after apply: {rollout}")
        # The operator is at rest once it has written nothing for --settle-s: at scale the Events of
        # the creations (rate-limited by its --api-qps) are still being posted after all are Ready.
        settle, window = f"{args.settle_s:.0f} s", f"{args.window_s:.0f} s"
        progress(f"waiting for {settle} without a write, then counting at rest for {window}")
        drain_from = now()
        drained = drain(cluster, args.settle_s, args.timeout_s)
        backlog = audit.tally(audit.requests_of(cluster.audit_log, OPERATOR_USER, drain_from, now()))
        rollout["after_ready"] = {
            "seconds_until_no_write_for_settle_s": drained,
            "writes": backlog["writes"],
            "by_verb_and_resource": backlog["by_verb_and_resource"],
        }
        progress(f"quiet {drained:.0f} s after all Ready: {rollout['after_ready']}")
        since = now()
        rest_from = time.monotonic() - samples.started
        time.sleep(args.window_s)
        rest_to = time.monotonic() - samples.started
        counted = audit.tally(audit.requests_of(cluster.audit_log, OPERATOR_USER, since, now()))
        at_rest = {
            **counted,
            "window_s": args.window_s,
            "per_minute": per_minute(counted["requests"], args.window_s),
            "writes_per_minute": per_minute(counted["writes"], args.window_s),
            "lease_requests_per_minute": per_minute(counted["lease_requests"], args.window_s),
            "per_fleet_per_minute": round(counted["requests"] / args.fleets / (args.window_s / 60), 3),
            "operator": usage(samples.between(rest_from, rest_to)),
        }
        progress(f"at rest: {at_rest}")
        return {
            "operator_idle": idle,
            "apply_to_ready": rollout,
            "at_rest": at_rest,
            "timeline": [[round(t, 1), f, p] for t, f, p in timeline],
            "operator_samples": [
                [round(t - applied_at, 1), round(rss / 2**20, 1), round(cpu, 2)]
                for t, rss, cpu in samples.rows
            ],
            "at_rest_window": [round(rest_from - applied_at, 1), round(rest_to - applied_at, 1)],
        }


def plot(result: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    timeline = result["timeline"]
    top.plot([t for t, _, _ in timeline], [f for _, f, _ in timeline], label="fleets Ready")
    top.set_ylabel(f"fleets Ready (of {args.fleets})")
    twin = top.twinx()
    twin.plot([t for t, _, _ in timeline], [p for _, _, p in timeline], color="tab:orange", label="proxies")
    twin.set_ylabel(f"proxies ready (of {args.fleets * args.proxies})")
    top.set_title(f"{args.fleets} fleets x {args.proxies} proxies on {args.nodes} KWOK nodes")
    samples = [s for s in result["operator_samples"] if s[0] >= -5]
    bottom.plot([s[0] for s in samples], [s[1] for s in samples], label="operator RSS (MiB)")
    bottom.set_ylabel("operator RSS (MiB)")
    cores = bottom.twinx()
    window = 5  # CPU over 5-sample spans: one sample's difference is too coarse
    cpu = [
        (samples[i][0], (samples[i][2] - samples[i - window][2]) / (samples[i][0] - samples[i - window][0]))
        for i in range(window, len(samples))
    ]
    cores.plot([t for t, _ in cpu], [c for _, c in cpu], color="tab:red", linewidth=0.8)
    cores.set_ylabel("operator CPU (cores)")
    start, end = result["at_rest_window"]
    bottom.axvspan(start, end, alpha=0.15, label="at-rest window")
    bottom.set_xlabel("seconds after kubectl apply")
    bottom.legend(loc="upper left")
    save_figure(fig, IMAGES / "scale.png")


def drain(cluster, quiet_s: float, timeout_s: float) -> float:
    """Seconds until the operator has made no write (Lease renewals apart) for `quiet_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        recent = now() - datetime.timedelta(seconds=quiet_s)
        requests = audit.requests_of(cluster.audit_log, OPERATOR_USER, recent, now())
        writes = [r for r in requests if r.write and audit.LEASES not in r.uri]
        if time.monotonic() - started >= quiet_s and not writes:
            return round(time.monotonic() - started, 1)
        time.sleep(5)
    raise TimeoutError(f"the operator kept writing for {timeout_s:.0f} s after all fleets were Ready")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()
    progress(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-scale-") as tmp,
        kwok.simulated_cluster(Path(tmp), nodes=args.nodes) as cluster,
    ):
        result = run(cluster, Path(tmp), args)
    progress(f"done in {time.monotonic() - started:.0f}s")
    ready, rest = result["apply_to_ready"], result["at_rest"]
    progress(
        f"{args.fleets} x {args.proxies}: all Ready {ready['all_ready_s']} s after apply "
        f"(median fleet {ready['median_s']} s), {ready['requests_per_fleet']} requests per fleet meanwhile; "
        f"at rest {rest['per_minute']} requests/min ({rest['writes']} writes, "
        f"{rest['lease_requests_per_minute']} Lease requests/min apart); operator RSS "
        f"{rest['operator'].get('rss_last_mib')} MiB, CPU {rest['operator'].get('cpu_cores')} cores at rest, "
        f"{ready['operator'].get('cpu_cores')} cores while applying"
    )
    if not args.no_plot:
        plot(result, args)
    save_result(
        "scale",
        {"args": vars(args), "load_average_at_start": [round(x, 2) for x in load], **result},
    )


if __name__ == "__main__":
    main()
