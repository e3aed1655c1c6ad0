"""Watching a fleet's proxy pods while a test runs: how many are down at once, and whether the
kernel OOM-killed any container (sampled from the pods' container statuses)."""

from __future__ import annotations

import json
import threading
import time

from rolloutfleet_operator.plan import is_ready
from rolloutfleet_testkit.fleet_setup import oom_kills


def proxy_pods(cluster, namespace: str, fleet: str) -> dict[str, dict]:
    """The fleet's proxy pods by name (terminating ones included)."""
    listing = cluster.kubectl(
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        f"rolloutfleet.dev/fleet={fleet},app.kubernetes.io/component=proxy",
        "-o",
        "json",
    )
    return {pod["metadata"]["name"]: pod for pod in json.loads(listing.stdout)["items"]}


def available(pod: dict) -> bool:
    return is_ready(pod) and not pod["metadata"].get("deletionTimestamp")


class FleetWatch:
    """Samples the fleet's proxy pods every 0.3 s: how many of `replicas` are not available
    (missing, not Ready or terminating), and every OOM kill seen, by pod uid."""

    def __init__(self, cluster, namespace: str, fleet: str, replicas: int):
        self.cluster, self.namespace, self.fleet = cluster, namespace, fleet
        self.wanted = [f"{fleet}-proxy-{i}" for i in range(replicas)]
        self.unavailable: list[int] = []
        self.oom_killed: dict[str, list[dict]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pods = proxy_pods(self.cluster, self.namespace, self.fleet)
            self.unavailable.append(
                sum(1 for name in self.wanted if name not in pods or not available(pods[name]))
            )
            for pod in pods.values():
                if kills := oom_kills(pod):
                    self.oom_killed[pod["metadata"]["uid"]] = kills
            time.sleep(0.3)

    def __enter__(self) -> FleetWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
