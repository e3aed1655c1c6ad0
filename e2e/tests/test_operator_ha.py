"""Two operator replicas from the chart (`replicaCount: 2`): one holds the Lease and acts, the other
waits as a healthy standby; when the leader is killed, another replica (the standby, or the
killed one's replacement) takes the Lease over once it expires and keeps the fleet true (a
scale-up after the kill is carried out); a leader stopped gracefully releases the Lease, and the
other replica takes it within seconds."""

from __future__ import annotations

import json
import time

import pytest
from operator_install import installed_operator
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e
NAMESPACE, RELEASE = "operator-ha", "rfha"
LEASE = f"{RELEASE}-rolloutfleet-operator"  # the chart names the Lease after the release


def get(cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json").stdout)


def operator_pods(cluster) -> dict[str, dict]:
    pods = get(cluster, "pods", "-l", "app.kubernetes.io/name=rolloutfleet-operator")["items"]
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def holder(cluster) -> str | None:
    result = cluster.kubectl("get", "lease", LEASE, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout)["spec"].get("holderIdentity") if result.returncode == 0 else None


def fleet_ready(cluster, replicas: int) -> bool:
    return fleet_setup.fleet_ready(get(cluster, "rf", "ha").get("status", {}), replicas)


def test_the_standby_takes_over_when_the_leader_is_killed(cluster, test_tokenizer_dir):
    with (
        installed_operator(cluster, NAMESPACE, RELEASE, extra={"replicaCount": "2"}),
        serve_app(create_engine_app(str(test_tokenizer_dir), seed=0), host=cluster.host_ip) as engine_url,
    ):
        pods = operator_pods(cluster)
        assert len(pods) == 2  # helm --wait: both Ready, the standby too
        leader = wait_for(lambda: holder(cluster), timeout_s=60, what="a replica to hold the Lease")
        assert leader in pods
        fleet = fleet_setup.external_fleet("ha", NAMESPACE, test_tokenizer_dir, engine_url, replicas=1)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(lambda: fleet_ready(cluster, 1), timeout_s=120, what="the fleet Ready", interval_s=1)

        killed_at = time.monotonic()
        cluster.kubectl("delete", "pod", leader, "-n", NAMESPACE, "--force", "--grace-period=0")
        # The standby, or the pod the Deployment starts in the killed one's place: whichever tries
        # first once the Lease has expired.
        successor = wait_for(
            lambda: (name := holder(cluster)) not in (None, leader) and name,
            timeout_s=60,
            what="another replica to take the Lease",
            interval_s=0.5,
        )
        takeover_s = time.monotonic() - killed_at
        print(f"[ha] {successor} holds the Lease {takeover_s:.1f}s after the leader was killed")
        assert takeover_s <= 30  # the Lease lasts 15 s; retried every 2 s
        assert successor in operator_pods(cluster)

        cluster.kubectl("scale", "rf/ha", "-n", NAMESPACE, "--replicas=2")
        wait_for(
            lambda: fleet_ready(cluster, 2),
            timeout_s=120,
            what="the new leader to scale the fleet",
            interval_s=1,
        )
        lease = json.loads(cluster.kubectl("get", "lease", LEASE, "-n", NAMESPACE, "-o", "json").stdout)[
            "spec"
        ]
        assert lease["leaseTransitions"] >= 1 and lease["holderIdentity"] == successor

        # A graceful stop (SIGTERM, as a rollout or a drain sends) releases the Lease on the way out:
        # the other replica takes it at its next try (every 2 s), not after the Lease's 15 s.
        wait_for(lambda: len(operator_pods(cluster)) == 2, timeout_s=120, what="two replicas again")
        stopped_at = time.monotonic()
        cluster.kubectl("delete", "pod", successor, "-n", NAMESPACE, "--wait=false")
        third = wait_for(
            lambda: (name := holder(cluster)) not in (None, successor) and name,
            timeout_s=60,
            what="a replica to take the released Lease",
            interval_s=0.2,
        )
        handover_s = time.monotonic() - stopped_at
        print(f"[ha] {third} holds the Lease {handover_s:.1f}s after the leader was stopped gracefully")
        assert handover_s < 10, handover_s
