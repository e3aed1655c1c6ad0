"""Two operator replicas from the chart (`replicaCount: 2`): one holds the Lease and acts, the other
waits as a healthy standby; when the leader is killed, another replica (the standby, or the
killed one's replacement) takes the Lease over once it expires and keeps the fleet true (a
scale-up after the kill is carried out); a leader stopped gracefully releases the Lease, and the
other replica takes it within seconds."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from operator_install import installed_operator
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.controlplane import audit
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e
NAMESPACE, RELEASE = "operator-ha", "rfha"
LEASE = f"{RELEASE}-rolloutfleet-operator"  # the chart names the Lease after the release


def get(cluster, *what: str, namespace: str = NAMESPACE) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout)


def operator_pods(cluster, namespace: str = NAMESPACE) -> dict[str, dict]:
    pods = get(cluster, "pods", "-l", "app.kubernetes.io/name=rolloutfleet-operator", namespace=namespace)
    return {p["metadata"]["name"]: p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")}


def lease_spec(cluster, namespace: str = NAMESPACE, lease: str = LEASE) -> dict:
    result = cluster.kubectl("get", "lease", lease, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout)["spec"] if result.returncode == 0 else {}


def holder(cluster, namespace: str = NAMESPACE, lease: str = LEASE) -> str | None:
    return lease_spec(cluster, namespace, lease).get("holderIdentity")


def parse_time(stamp: str) -> datetime.datetime:
    """A Lease's MicroTime (RFC 3339, UTC)."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def fleet_ready(cluster, replicas: int, name: str = "ha", namespace: str = NAMESPACE) -> bool:
    return fleet_setup.fleet_ready(get(cluster, "rf", name, namespace=namespace).get("status", {}), replicas)


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


STALL_NAMESPACE, STALL_RELEASE = "operator-stall", "rfst"
STALL_LEASE = f"{STALL_RELEASE}-rolloutfleet-operator"


def pod_process(pod: str) -> int:
    """The pid, on this machine, of the operator's process in pod `pod` (its hostname is the pod's)."""
    wanted = f"HOSTNAME={pod}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or a kernel thread
            continue
        if wanted in environ and b"rolloutfleet" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no operator process of pod {pod} on this machine")


def api_address(pid: int) -> tuple[str, str]:
    """The API server's address as the process's in-cluster configuration has it (the Service's)."""
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    return environ[b"KUBERNETES_SERVICE_HOST"].decode(), environ[b"KUBERNETES_SERVICE_PORT"].decode()


def drop_rule(action: str, netns: str, host: str, port: str) -> None:
    """Insert (-I) or delete (-D) a rule dropping the pod's packets to the API server, in its netns."""
    subprocess.run(
        [
            "nsenter",
            f"--net={netns}",
            "iptables",
            action,
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            host,
            "--dport",
            port,
            "-j",
            "DROP",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.mark.local_cluster(
    reason="stalls a pod's network on the local nodes and reads the local API server's audit log"
)
def test_a_stalled_leader_stops_before_the_standby_acts(cluster, test_tokenizer_dir):
    """The leader's traffic to the API server is dropped (an iptables rule in its pod's network
    namespace): it can no longer renew, so it exits two thirds into the Lease; the standby takes the
    Lease once it has seen it unchanged for its whole duration and carries out a scale-up the old
    leader never saw. Counted at the API server (its audit log, by client address): no write of the
    old leader is received after the new one's first, during the stall or after the traffic flows
    again."""
    namespace = STALL_NAMESPACE

    with (
        installed_operator(cluster, namespace, STALL_RELEASE, extra={"replicaCount": "2"}),
        serve_app(create_engine_app(str(test_tokenizer_dir), seed=0), host=cluster.host_ip) as engine_url,
    ):
        wait_for(
            lambda: holder(cluster, namespace, STALL_LEASE), timeout_s=60, what="a replica to hold the Lease"
        )
        fleet = fleet_setup.external_fleet("stall", namespace, test_tokenizer_dir, engine_url, replicas=1)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(
            lambda: fleet_ready(cluster, 1, "stall", namespace),
            timeout_s=120,
            what="the fleet Ready",
            interval_s=1,
        )
        # Read just before the stall: on a loaded machine the Lease may have changed hands since the
        # fleet was made (a replica that missed its renewal gives it up), and that is no fault. The
        # leader's term began at its acquireTime: the standby must not write from then until the stall.
        term = lease_spec(cluster, namespace, STALL_LEASE)
        leader, term_began = term["holderIdentity"], parse_time(term["acquireTime"])
        pods = operator_pods(cluster, namespace)
        (standby,) = set(pods) - {leader}
        leader_ip, standby_ip = pods[leader]["status"]["podIP"], pods[standby]["status"]["podIP"]

        pid = pod_process(leader)
        host, port = api_address(pid)
        # The namespace outlives the process (the pod's sandbox holds it); an open descriptor keeps a
        # path to it after the old leader's container has exited.
        netns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        netns = f"/proc/{os.getpid()}/fd/{netns_fd}"
        try:
            stalled_at = datetime.datetime.now(datetime.UTC)
            drop_rule("-I", netns, host, port)
            try:
                cluster.kubectl("scale", "rf/stall", "-n", namespace, "--replicas=2")
                successor = wait_for(
                    lambda: (name := holder(cluster, namespace, STALL_LEASE)) not in (None, leader) and name,
                    timeout_s=60,
                    what="the standby to take the Lease",
                    interval_s=0.5,
                )
                took_over_s = (datetime.datetime.now(datetime.UTC) - stalled_at).total_seconds()
                print(
                    f"[ha] {successor} holds the Lease {took_over_s:.1f}s after the leader's traffic stopped"
                )
                assert successor == standby
                wait_for(
                    lambda: fleet_ready(cluster, 2, "stall", namespace),
                    timeout_s=120,
                    what="the new leader to scale the fleet",
                    interval_s=1,
                )
                # The old leader exits when it cannot renew (its container restarts, as a standby).
                wait_for(
                    lambda: any(
                        s.get("restartCount", 0) >= 1
                        for s in get(cluster, "pod", leader, namespace=namespace)["status"].get(
                            "containerStatuses", []
                        )
                    ),
                    timeout_s=60,
                    what="the stalled leader to exit",
                )
            finally:
                drop_rule("-D", netns, host, port)
        finally:
            os.close(netns_fd)
        # Its traffic flows again: anything it had queued now reaches the API server.
        time.sleep(20)
        assert holder(cluster, namespace, STALL_LEASE) == successor
        previous = cluster.kubectl("logs", leader, "-n", namespace, "--previous", check=False).stdout
        assert "leadership lost" in previous, previous[-2000:]

    with cluster.audit_log.open() as lines:
        requests = [
            r for r in audit.parse_requests(lines) if r.user.startswith(f"system:serviceaccount:{namespace}:")
        ]
    # Lease requests are the election itself, not acting: a standby starting beside the leader tries
    # to create the Lease too (a POST to the collection, `/leases` without a name); it must have failed.
    standby_lease_writes = [
        r
        for r in requests
        if r.source_ip == standby_ip and r.write and "/leases" in r.uri
        if term_began <= r.received <= stalled_at
    ]
    assert all(r.code is not None and r.code >= 400 for r in standby_lease_writes), standby_lease_writes
    old_writes = [r for r in requests if r.source_ip == leader_ip and r.write and "/leases" not in r.uri]
    new_writes = [
        r
        for r in requests
        if r.source_ip == standby_ip and r.write and "/leases" not in r.uri and r.received >= term_began
    ]
    assert old_writes and new_writes  # both acted, each in its time: the fleet's pods, status, Events
    first_new = min(r.received for r in new_writes)
    assert first_new > stalled_at, (
        f"the standby ({standby}, {standby_ip}) wrote before the stall at {stalled_at:%H:%M:%S.%f}, in "
        f"{leader}'s term (from {term_began:%H:%M:%S.%f})",
        [(f"{r.received:%H:%M:%S.%f}", r.verb, r.uri) for r in new_writes if r.received <= stalled_at][:10],
    )
    late = [r for r in old_writes if r.received >= first_new]
    assert not late, (
        f"stalled at {stalled_at:%H:%M:%S.%f}, the new leader's first write at {first_new:%H:%M:%S.%f}",
        late,
    )
    old_after_stall = [
        r for r in requests if r.source_ip == leader_ip and r.received > stalled_at and r.write
    ]
    print(
        f"[ha] old leader: {len(old_writes)} writes, none after {first_new:%H:%M:%S.%f}; "
        f"{len(old_after_stall)} writes of any kind received after the stall began"
    )
