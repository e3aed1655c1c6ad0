"""Probe specs and their pass/fail bookkeeping (pure; `probing.py` performs the checks).

Semantics as a kubelet's: the first check runs `initialDelaySeconds` after the container starts, then
every `periodSeconds`; the result flips to success after `successThreshold` consecutive successes and
to failure after `failureThreshold` consecutive failures. Readiness starts failed, liveness and
startup start "unknown" (treated as passing for liveness). Readiness and liveness wait for the
startup probe to succeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Probe:
    kind: str  # "httpGet" | "tcpSocket" | "exec" | "grpc"
    port: int | str | None = None  # a number, or a container port's name until resolved
    host: str | None = None
    path: str = "/"
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    initial_delay_s: float = 0
    period_s: float = 10
    timeout_s: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3
    termination_grace_s: float | None = None  # probe-level override for liveness/startup kills


def resolve_port(port: int | str | None, container_ports: Sequence[Mapping]) -> int:
    """A probe port: a number (possibly as a string) or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if port is None:
        raise ValueError("probe has no port")
    if port.isdigit():
        return int(port)
    for entry in container_ports:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"probe port {port!r} is not a named port of the container")


def parse_probe(spec: Mapping | None, container_ports: Sequence[Mapping] = ()) -> Probe | None:
    """A Probe from a container's readinessProbe/livenessProbe/startupProbe (named ports resolved)."""
    if not spec:
        return None
    timing = {
        "initial_delay_s": float(spec.get("initialDelaySeconds") or 0),
        "period_s": float(spec.get("periodSeconds") or 10),
        "timeout_s": float(spec.get("timeoutSeconds") or 1),
        "success_threshold": int(spec.get("successThreshold") or 1),
        "failure_threshold": int(spec.get("failureThreshold") or 3),
        "termination_grace_s": spec.get("terminationGracePeriodSeconds"),
    }
    if "httpGet" in spec:
        http = spec["httpGet"]
        headers = tuple((h["name"], h.get("value", "")) for h in http.get("httpHeaders") or [])
        return Probe(
            "httpGet",
            port=resolve_port(http.get("port"), container_ports),
            host=http.get("host") or None,
            path=http.get("path") or "/",
            scheme=(http.get("scheme") or "HTTP").upper(),
            headers=headers,
            **timing,
        )
    if "tcpSocket" in spec:
        tcp = spec["tcpSocket"]
        port = resolve_port(tcp.get("port"), container_ports)
        return Probe("tcpSocket", port=port, host=tcp.get("host") or None, **timing)
    if "exec" in spec:
        return Probe("exec", command=tuple(spec["exec"].get("command") or ()), **timing)
    if "grpc" in spec:  # checked as a TCP connect: no gRPC health client in the harness
        return Probe("grpc", port=int(spec["grpc"]["port"]), **timing)
    raise ValueError(f"probe without a handler: {sorted(spec)}")


@dataclass
class ProbeTracker:
    """When a probe is due and what its current result is."""

    probe: Probe
    started_at: float  # monotonic time the container started
    result: bool | None = None  # None: not decided yet
    successes: int = 0
    failures: int = 0
    next_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_at = self.started_at + self.probe.initial_delay_s

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> bool | None:
        """Count one check's outcome; returns the (possibly changed) result."""
        self.next_at = now + self.probe.period_s
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.probe.success_threshold:
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.probe.failure_threshold:
                self.result = False
        return self.result
