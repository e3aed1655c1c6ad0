"""The operator's API requests per fleet, at rest and during a roll, with 1, 10 and 50 fleets.

Counted at the API server: the local control plane writes an audit log of every request made by a
ServiceAccount outside kube-system (rolloutfleet_testkit.controlplane.audit), and this script
counts those of the operator's ServiceAccount. Everything is real except the proxies: the local
cluster (control plane, real kubelets with containerd, kube-proxy, CoreDNS), the operator installed
by its Helm chart and running as a pod (leader election on, as the chart installs it), the real
SGLang router as each fleet's gateway. Each fleet has one proxy, a /stats stand-in (the test kit
image with TESTKIT_PROGRAM=stats-standin, a TEST STAND-IN for the proxy that answers probes and
/stats, so the memory watchdog polls it every 15 s as it would a proxy), in front of the upstream
stand-in as its external engine.

For each number of fleets N (the fleets of the previous N deleted first):
1. Apply N fleets, wait until every one is Ready, then two resyncs (20 s) more.
2. At rest: count the operator's requests over --window-s seconds.
3. Roll: change every fleet's proxy template at once (an env value) and count from the change until
   every fleet reports its proxy updated and Ready.
Requests to the operator's leader-election Lease are the replica's, not any fleet's: reported apart.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common import progress, save_result, tokenizer_dir, upstream_stub
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.controlplane import audit
from rolloutfleet_testkit.images import ensure_images
from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.node import real_cluster
from rolloutfleet_testkit.node.config import BRIDGE_IP

NAMESPACE = "api-load-bench"
RELEASE = "al"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-rolloutfleet-operator"
RESYNC_S = 10


@dataclass
class Cluster:
    kubectl: Kubectl
    audit_log: Path


@contextlib.contextmanager
def local_cluster(work: Path) -> Iterator[Cluster]:
    with real_cluster(work / "cluster") as node:
        progress("importing the images into the nodes")
        ensure_images(("proxy", "operator", "testkit"), node.containerd_addresses)
        kubectl = Kubectl(node.bin_dir / "kubectl", node.kubeconfig, NAMESPACE)
        kubectl("apply", "-f", str(fleet_setup.CRDS))
        kubectl.wait_established("rolloutfleets.rolloutfleet.dev")
        kubectl("create", "namespace", NAMESPACE)
        progress("installing the operator with helm (it runs as a pod)")
        subprocess.run(
            [
                str(node.bin_dir / "helm"),
                "--kubeconfig",
                node.kubeconfig,
                *fleet_setup.helm_install_args(RELEASE, NAMESPACE, [NAMESPACE]),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        yield Cluster(kubectl, Path(node.kubeconfig).parent / audit.LOG_FILE)


def fleet_manifest(name: str, work: Path, engine: str) -> dict:
    return fleet_setup.external_fleet(
        name,
        NAMESPACE,
        tokenizer_dir(),  # required by the CRD; the stand-in reads neither it nor the dumps
        engine,
        1,
        image=fleet_setup.TESTKIT_IMAGE,
        dump={"hostPath": {"path": str(fleet_setup.pod_writable(work / "dumps"))}},
        env=[{"name": "TESTKIT_PROGRAM", "value": "stats-standin"}, {"name": "ROLL", "value": "0"}],
        memory={"rssBudgetBytes": 1 << 30},
    )


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def fleets_state(cluster: Cluster) -> list[dict]:
    return cluster.kubectl.json("rf")["items"]


def wait_fleets(cluster: Cluster, count: int, updated: bool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [
            f
            for f in fleets_state(cluster)
            if fleet_setup.fleet_ready(f.get("status") or {}, 1)
            and (not updated or (f.get("status") or {}).get("updatedReplicas") == 1)
        ]
        if len(done) == count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(done)} of {count} fleets ready after {timeout_s} s")
        time.sleep(1)


def count(cluster: Cluster, since: datetime.datetime, until: datetime.datetime) -> dict:
    return audit.tally(audit.requests_of(cluster.audit_log, OPERATOR_USER, since, until))


def measure(cluster: Cluster, fleets: int, window_s: float, work: Path, engine: str) -> dict:
    progress(f"{fleets} fleets: applying")
    manifests = [fleet_manifest(f"al{i}", work, engine) for i in range(fleets)]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
    wait_fleets(cluster, fleets, updated=False, timeout_s=120 + 10 * fleets)
    time.sleep(2 * RESYNC_S)
    progress(f"{fleets} fleets: at rest for {window_s:.0f} s")
    since = now()
    time.sleep(window_s)
    rest = count(cluster, since, now())
    minutes = window_s / 60
    rest |= {
        "window_s": window_s,
        "per_fleet_per_minute": round(rest["requests"] / fleets / minutes, 3),
        "per_fleet_per_resync": round(rest["requests"] / fleets / (window_s / RESYNC_S), 3),
        "writes_per_fleet_per_minute": round(rest["writes"] / fleets / minutes, 3),
    }
    progress(f"  at rest: {rest}")
    progress(f"{fleets} fleets: rolling every fleet's proxy")
    patch = json.dumps(
        {
            "spec": {
                "proxy": {
                    "env": [
                        {"name": "TESTKIT_PROGRAM", "value": "stats-standin"},
                        {"name": "ROLL", "value": "1"},
                    ]
                }
            }
        }
    )
    since = now()
    for i in range(fleets):
        cluster.kubectl("patch", "rf", f"al{i}", "-n", NAMESPACE, "--type=merge", "-p", patch)
    wait_fleets(cluster, fleets, updated=True, timeout_s=120 + 10 * fleets)
    until = now()
    roll = count(cluster, since, until)
    seconds = (until - since).total_seconds()
    roll |= {
        "seconds": round(seconds, 1),
        "per_fleet": round(roll["requests"] / fleets, 2),
        "per_fleet_per_minute": round(roll["requests"] / fleets / (seconds / 60), 2),
        "writes_per_fleet": round(roll["writes"] / fleets, 2),
    }
    progress(f"  roll: {roll}")
    cluster.kubectl("delete", "rf", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=300s")
    return {"fleets": fleets, "at_rest": rest, "roll": roll}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--window-s", type=float, default=120.0, help="the at-rest counting window")
    args = parser.parse_args()
    runs = []
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-api-load-") as tmp,
        local_cluster(Path(tmp)) as cluster,
        upstream_stub(Path(tmp), 0.01, 8, host=BRIDGE_IP) as (engine, _),
    ):
        for fleets in args.fleets:
            runs.append(measure(cluster, fleets, args.window_s, Path(tmp), engine))
    progress(f"done in {time.monotonic() - started:.0f}s")
    for r in runs:
        rest, roll = r["at_rest"], r["roll"]
        progress(
            f"N={r['fleets']:>3}: at rest {rest['per_fleet_per_resync']} requests per fleet per resync, "
            f"{rest['per_fleet_per_minute']} per minute, {rest['writes']} writes; roll {roll['per_fleet']} "
            f"per fleet in {roll['seconds']} s ({roll['per_fleet_per_minute']} per minute), "
            f"{roll['writes_per_fleet']} writes per fleet"
        )
    save_result("api_load", {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
