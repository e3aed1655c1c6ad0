"""Reading the local API server's audit log (rolloutfleet_testkit.controlplane.audit): one request per
auditID, a watch counted once although it is logged when it starts and when it ends."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from rolloutfleet_testkit.controlplane import audit
from rolloutfleet_testkit.controlplane.cluster import component_args
from rolloutfleet_testkit.controlplane.pki import Pki


def entry(
    audit_id: str,
    verb: str,
    stage: str,
    at: str,
    code: int | None = 200,
    user: str = "op",
    ip: str = "10.0.0.1",
) -> str:
    line = {
        "sourceIPs": [ip],
        "auditID": audit_id,
        "stage": stage,
        "verb": verb,
        "requestURI": f"/api/v1/{audit_id}",
        "user": {"username": user},
        "requestReceivedTimestamp": at,
    }
    if code is not None:
        line["responseStatus"] = {"code": code}
    return json.dumps(line)


def test_requests_are_counted_once_by_audit_id():
    lines = [
        entry("w", "watch", "ResponseStarted", "2026-01-01T00:00:01.000000Z", code=None),
        entry("p", "patch", "ResponseComplete", "2026-01-01T00:00:02.500000Z"),
        entry("w", "watch", "ResponseComplete", "2026-01-01T00:00:01.000000Z"),
        "",
        entry("g", "get", "ResponseComplete", "2026-01-01T00:00:00.000000Z", user="other"),
    ]
    requests = audit.parse_requests(lines)
    assert [(r.verb, r.code) for r in requests] == [("get", 200), ("watch", 200), ("patch", 200)]
    assert [r.write for r in requests] == [False, False, True]


def test_requests_carry_the_client_address():
    lines = [
        entry("a", "get", "ResponseComplete", "2026-01-01T00:00:00Z", ip="10.0.0.7"),
        json.dumps(
            {**json.loads(entry("b", "get", "ResponseComplete", "2026-01-01T00:00:01Z")), "sourceIPs": []}
        ),
    ]
    assert [r.source_ip for r in audit.parse_requests(lines)] == ["10.0.0.7", None]


def test_requests_of_one_user_in_a_window(tmp_path: Path):
    log = tmp_path / audit.LOG_FILE
    log.write_text(
        "\n".join(
            [
                entry("a", "get", "ResponseComplete", "2026-01-01T00:00:00.000000Z"),
                entry("b", "list", "ResponseComplete", "2026-01-01T00:00:05.000000Z"),
                entry("c", "get", "ResponseComplete", "2026-01-01T00:00:05.000000Z", user="other"),
                entry("d", "get", "ResponseComplete", "2026-01-01T00:00:10.000000Z"),
            ]
        )
    )
    since, until = (
        audit.parse_requests([entry("x", "get", "", t)])[0].received
        for t in ("2026-01-01T00:00:01Z", "2026-01-01T00:00:10Z")
    )
    assert [r.verb for r in audit.requests_of(log, "op", since, until)] == ["list"]


def test_the_api_server_writes_the_audit_log_beside_its_state(tmp_path: Path):
    args = component_args(
        "kube-apiserver", Path("/bin"), tmp_path, Pki(tmp_path / "pki"), {"etcd": 1, "kube-apiserver": 2}
    )
    assert f"--audit-log-path={tmp_path / audit.LOG_FILE}" in args
    assert f"--audit-policy-file={tmp_path / audit.POLICY_FILE}" in args
    audit.write_policy(tmp_path)
    assert "system:serviceaccounts" in (tmp_path / audit.POLICY_FILE).read_text()


def test_tally_counts_writes_and_resources_and_keeps_lease_requests_apart():
    def request(verb: str, uri: str) -> audit.AuditedRequest:
        return audit.AuditedRequest(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), "op", verb, uri, 200)

    counted = audit.tally(
        [
            request("get", "/api/v1/namespaces/ns/pods/f-proxy-0"),
            request("patch", "/api/v1/namespaces/ns/pods/f-proxy-0/status?fieldManager=x"),
            request("create", "/api/v1/namespaces/ns/pods"),
            request("watch", "/apis/rolloutfleet.dev/v1alpha1/namespaces/ns/rolloutfleets?watch=true"),
            request("update", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"),
            request("get", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"),
        ]
    )
    assert counted["requests"] == 4 and counted["writes"] == 2 and counted["lease_requests"] == 2
    assert counted["by_verb_and_resource"] == {
        "create pods": 1,
        "get pods": 1,
        "patch pods/status": 1,
        "watch rolloutfleets": 1,
    }
    assert audit.tally([]) == {"requests": 0, "writes": 0, "lease_requests": 0, "by_verb_and_resource": {}}
