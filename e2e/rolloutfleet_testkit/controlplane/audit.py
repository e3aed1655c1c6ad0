"""The API server's audit log, for counting what a client asks of it (the operator's requests per
fleet). The local control plane writes one JSON line per request of a ServiceAccount outside
kube-system (the operator, the routers' service discovery), at the Metadata level: who, what verb,
which URI, when; no bodies. Each request appears at ResponseComplete, and a watch also when its
response starts, so requests are told apart by their auditID.
"""

from __future__ import annotations

import datetime
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

POLICY_FILE = "audit-policy.yaml"
LOG_FILE = "audit.log"

# First matching rule wins. Controllers run as kube-system ServiceAccounts
# (--use-service-account-credentials): left out, they would be most of the log.
POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# Leader election's Lease requests belong to an operator replica, not to any fleet: counted apart.
LEASES = "/apis/coordination.k8s.io/"


def write_policy(root: Path) -> None:
    (root / POLICY_FILE).write_text(POLICY)


def apiserver_args(root: Path) -> list[str]:
    """The API server's audit flags (the policy file is `write_policy`'s)."""
    return [f"--audit-policy-file={root / POLICY_FILE}", f"--audit-log-path={root / LOG_FILE}"]


@dataclass(frozen=True)
class AuditedRequest:
    received: datetime.datetime
    user: str
    verb: str  # get, list, watch, create, update, patch, delete, ...
    uri: str
    code: int | None  # None while a watch still runs
    source_ip: str | None = None  # the client's address (tells two replicas of one ServiceAccount apart)

    @property
    def write(self) -> bool:
        return self.verb in WRITE_VERBS


def parse_requests(lines: Iterable[str]) -> list[AuditedRequest]:
    """One entry per request (by auditID), in the order they were received."""
    found: dict[str, AuditedRequest] = {}
    for line in lines:
        if not line.strip():
            continue
        entry = json.loads(line)
        received = datetime.datetime.fromisoformat(entry["requestReceivedTimestamp"].replace("Z", "+00:00"))
        code = (entry.get("responseStatus") or {}).get("code")
        request = AuditedRequest(
            received,
            entry["user"]["username"],
            entry["verb"],
            entry["requestURI"],
            code,
            (entry.get("sourceIPs") or [None])[0],
        )
        if entry["auditID"] not in found or code is not None:
            found[entry["auditID"]] = request
    return sorted(found.values(), key=lambda r: r.received)


def requests_of(
    log: Path, user: str, since: datetime.datetime, until: datetime.datetime
) -> list[AuditedRequest]:
    """The requests `user` made that the API server received in [since, until)."""
    with log.open() as lines:
        return [r for r in parse_requests(lines) if r.user == user and since <= r.received < until]


def resource_of(uri: str) -> str:
    """The collection a request went to (".../namespaces/ns/pods/name?x" -> "pods",
    ".../pods/name/status" -> "pods/status")."""
    parts = uri.split("?")[0].strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        return "/".join(parts[parts.index("namespaces") + 2 :][::2])
    return parts[-1]


def tally(requests: Iterable[AuditedRequest]) -> dict:
    """What a client asked in a window: its requests and writes (Lease requests apart) and how many
    of each verb and resource."""
    requests = list(requests)
    work = [r for r in requests if LEASES not in r.uri]
    by_kind = Counter(f"{r.verb} {resource_of(r.uri)}" for r in work)
    return {
        "requests": len(work),
        "writes": sum(r.write for r in work),
        "lease_requests": len(requests) - len(work),
        "by_verb_and_resource": dict(sorted(by_kind.items())),
    }
