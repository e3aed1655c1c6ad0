"""Cluster DNS for the process kubelet's pods, as one hosts file bound over each pod's /etc/hosts.

The harness has no CoreDNS and no kube-proxy, yet the operator wires pods together by Service name
(`http://<fleet>-gateway.<ns>.svc:30080`) and per-pod DNS (`<pod>.<headless>.<ns>.svc`). This
thread lists Services and Pods once a second and writes a hosts file mapping
- every Service's names (`name.ns`, `name.ns.svc`, `name.ns.svc.cluster.local`) to ONE ready
  endpoint's pod IP (the lowest: no load balancing, and no port translation, so this only works
  for Services whose port equals the target port, as the operator's all do), and
- every ready pod with a hostname and a subdomain naming a headless Service to its own IP:
  `hostname.subdomain.ns.svc[.cluster.local]`.

glibc reads /etc/hosts on every lookup, so a rewritten file is seen at once. It is rewritten in
place (same inode) because each pod's /etc/hosts is a bind mount of this very file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from rolloutfleet_operator.plan import is_ready

from .kube import Kube

log = logging.getLogger("rolloutfleet.kubelet")

CLUSTER_DOMAIN = "cluster.local"
HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
POLL_S = 1.0


def _service_names(name: str, namespace: str) -> list[str]:
    return [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def _endpoint_ip(pod: Mapping, publish_not_ready: bool) -> str | None:
    """The pod's IP when it is an endpoint: Ready (or any state, for publishNotReadyAddresses) and
    not terminating."""
    terminating = bool(pod["metadata"].get("deletionTimestamp"))
    usable = (is_ready(pod) or publish_not_ready) and not terminating
    return (pod.get("status") or {}).get("podIP") if usable else None


def _selects(selector: Mapping[str, str], pod: Mapping) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def hosts_file(services: Iterable[Mapping], pods: Iterable[Mapping]) -> str:
    """The hosts file for these Services and Pods (pure; sorted, so stable).

    Endpoints are computed here from selectors and pod readiness, as the endpoint-slice controller
    would: that controller refuses loopback addresses, and every harness pod IP is one."""
    pods = list(pods)
    service_lines: list[str] = []
    pod_names: dict[str, list[str]] = {}
    for svc in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        namespace, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName":
            continue
        publish = bool(spec.get("publishNotReadyAddresses"))
        endpoints = [
            (pod, ip)
            for pod in pods
            if pod["metadata"]["namespace"] == namespace
            and _selects(spec.get("selector") or {}, pod)
            and (ip := _endpoint_ip(pod, publish))
        ]
        if endpoints:
            lowest = min((ip for _, ip in endpoints), key=_ip_key)
            service_lines.append(f"{lowest}\t{' '.join(_service_names(name, namespace))}\n")
        if spec.get("clusterIP") == "None":
            for pod, ip in endpoints:
                pod_spec = pod.get("spec") or {}
                if pod_spec.get("hostname") and pod_spec.get("subdomain") == name:
                    fqdn = f"{pod_spec['hostname']}.{name}"
                    pod_names.setdefault(ip, []).extend(_service_names(fqdn, namespace)[1:])
    pod_lines = [
        f"{ip}\t{' '.join(names)}\n" for ip, names in sorted(pod_names.items(), key=lambda i: _ip_key(i[0]))
    ]
    return "".join([HEADER, *service_lines, *pod_lines])


def _ip_key(ip: str) -> tuple[int, ...]:
    return tuple(int(part) for part in ip.split("."))


def write_in_place(path: Path, content: str) -> None:
    """Replace the file's content keeping its inode (bind mounts of it see the change)."""
    with open(path, "r+" if path.exists() else "w") as handle:
        handle.seek(0)
        handle.write(content)
        handle.truncate()


class ClusterDns:
    """Keeps `path` current. Two list requests per second."""

    def __init__(self, kube: Kube, path: Path):
        self.path = path
        self._kube = kube
        self._stop = threading.Event()
        self._content = ""
        self._thread = threading.Thread(target=self._run, name="cluster-dns", daemon=True)

    def start(self) -> ClusterDns:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_in_place(self.path, HEADER)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def refresh(self) -> None:
        services = self._kube.request("GET", "/api/v1/services").get("items", [])
        pods = self._kube.request("GET", "/api/v1/pods").get("items", [])
        content = hosts_file(services, pods)
        if content != self._content:
            write_in_place(self.path, content)
            self._content = content

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # API server restarting: keep the last file, try again
                log.debug("cluster DNS refresh failed: %s", exc)
            self._stop.wait(POLL_S)
