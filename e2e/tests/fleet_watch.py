"""Watching a fleet's proxy pods while a test runs: how many are down at once, and whether the
kernel OOM-killed any container (from a watch of the pods: every change, with their container
statuses)."""

from __future__ import annotations

import json
import threading

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


def all_replaced_and_available(pods: dict[str, dict], before: dict[str, str]) -> bool:
    """Every pod named in `before` (name -> uid) exists again under a new uid and is available."""
    return all(
        name in pods and pods[name]["metadata"]["uid"] != uid and available(pods[name])
        for name, uid in before.items()
    )


class FleetWatch:
    """Follows the fleet's proxy pods through a watch (every change the API server makes, in order,
    not samples): after each event, how many of `replicas` are not available (missing, not Ready
    or terminating), and every OOM kill seen, by pod uid."""

    def __init__(self, cluster, namespace: str, fleet: str, replicas: int):
        self.cluster, self.namespace, self.fleet = cluster, namespace, fleet
        self.wanted = [f"{fleet}-proxy-{i}" for i in range(replicas)]
        self.unavailable: list[int] = []
        self.oom_killed: dict[str, list[dict]] = {}
        self.events = 0
        self._pods: dict[str, dict] = {}
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _count(self) -> None:
        pods = self._pods
        self.unavailable.append(
            sum(1 for name in self.wanted if name not in pods or not available(pods[name]))
        )

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # reported by __exit__: a watch that broke counted nothing
            self._error = exc
            self._started.set()

    def _follow(self) -> None:
        from kubernetes import client, config, watch

        api = client.CoreV1Api(config.new_client_from_config(config_file=self.cluster.kubeconfig))
        selector = f"rolloutfleet.dev/fleet={self.fleet},app.kubernetes.io/component=proxy"
        serialize = api.api_client.sanitize_for_serialization
        listing = serialize(api.list_namespaced_pod(self.namespace, label_selector=selector))
        self._pods = {pod["metadata"]["name"]: pod for pod in listing["items"]}
        self._count()
        version = listing["metadata"]["resourceVersion"]
        self._started.set()
        while not self._stop.is_set():
            stream = watch.Watch().stream(
                api.list_namespaced_pod,
                self.namespace,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=2,  # the server ends each watch soon, so a stop is seen
                allow_watch_bookmarks=True,  # keeps `version` recent while nothing changes
            )
            for event in stream:
                pod = serialize(event["object"])
                version = pod["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK":
                    continue
                name = pod["metadata"]["name"]
                if event["type"] == "DELETED":
                    self._pods.pop(name, None)
                else:
                    self._pods[name] = pod
                self.events += 1
                self._count()
                if kills := oom_kills(pod):
                    self.oom_killed[pod["metadata"]["uid"]] = kills

    def __enter__(self) -> FleetWatch:
        self._thread.start()
        self._started.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._error is not None:
            raise AssertionError(f"the pod watch broke: {self._error!r}") from self._error
