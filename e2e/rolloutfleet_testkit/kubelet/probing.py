"""Performing one probe check (side effects: network connections, a subprocess for exec probes)."""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Callable, Sequence

from .probes import Probe

USER_AGENT = "kube-probe/process-kubelet"
# Runs an exec probe's command inside the container; returns the exit code (raises TimeoutError).
ExecRunner = Callable[[Sequence[str], float], int]


def http_ok(probe: Probe, pod_ip: str) -> bool:
    """2xx and 3xx count as success, as for a kubelet (redirects are not followed)."""
    host = probe.host or pod_ip
    if probe.scheme == "HTTPS":  # kubelets do not verify probe certificates either
        context = ssl._create_unverified_context()
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, int(probe.port or 0), timeout=probe.timeout_s, context=context
        )
    else:
        connection = http.client.HTTPConnection(host, int(probe.port or 0), timeout=probe.timeout_s)
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*", **dict(probe.headers)}
    try:
        connection.request("GET", probe.path, headers=headers)
        status = connection.getresponse().status
        return 200 <= status < 400
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def tcp_ok(probe: Probe, pod_ip: str) -> bool:
    try:
        with socket.create_connection((probe.host or pod_ip, int(probe.port or 0)), timeout=probe.timeout_s):
            return True
    except OSError:
        return False


def exec_ok(probe: Probe, run: ExecRunner) -> bool:
    try:
        return run(probe.command, probe.timeout_s) == 0
    except (TimeoutError, OSError):
        return False


def check(probe: Probe, pod_ip: str, run: ExecRunner) -> bool:
    if probe.kind == "httpGet":
        return http_ok(probe, pod_ip)
    if probe.kind in ("tcpSocket", "grpc"):
        return tcp_ok(probe, pod_ip)
    return exec_ok(probe, run)
