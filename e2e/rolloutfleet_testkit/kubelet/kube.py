"""API access for the harness: the official synchronous client, with plain JSON dicts in and out.

The client's typed models are bypassed on purpose: manifests and status patches are built as dicts
(status.py, nodes.py) and a round trip through models would reshape them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

# The generic JSON API lives with the operator (product code); the harness adds CoreV1 for informers.
from rolloutfleet_operator.kubeapi import MERGE, STRATEGIC, KubeApi, load_configuration  # noqa: F401

log = logging.getLogger("rolloutfleet.kubelet")


class Kube(KubeApi):
    """The operator's JSON API plus the typed CoreV1 client the informers list and watch with."""

    def __init__(self, configuration: client.Configuration):
        super().__init__(configuration)
        self.core = client.CoreV1Api(self.api)


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


class Informer:
    """List, then watch from the list's resourceVersion; list again when the watch expires.

    `on_event(kind, obj)` gets ADDED/MODIFIED/DELETED; after every (re)list, objects that vanished in
    between are reported as DELETED. Runs in its own thread with its own connection.
    """

    def __init__(
        self,
        configuration: client.Configuration,
        list_call: Callable[[client.CoreV1Api], Callable[..., Any]],
        on_event: Callable[[str, dict], None],
        name: str,
        **selectors: str,
    ):
        self._configuration = configuration
        self._list_call = list_call
        self._on_event = on_event
        self._selectors = selectors
        self._stop = threading.Event()
        self._response: Any = None
        self._known: dict[str, dict] = {}
        self._synced = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def start(self) -> Informer:
        self.thread.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()  # unblocks the read in the informer's thread
        self.thread.join(timeout=10)

    def _dispatch(self, kind: str, obj: dict) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self._known.pop(uid, None)
        else:
            self._known[uid] = obj
        try:
            self._on_event(kind, obj)
        except Exception:  # one bad object must not stop the watch
            log.exception("handling %s %s failed", kind, obj["metadata"].get("name"))

    def _run(self) -> None:
        api_client = client.ApiClient(self._configuration)
        list_fn = self._list_call(client.CoreV1Api(api_client))
        while not self._stop.is_set():
            try:
                response = list_fn(_preload_content=False, **self._selectors)
                listing = json.loads(response.data)
                items = {item["metadata"]["uid"]: item for item in listing["items"]}
                for uid in set(self._known) - set(items):
                    self._dispatch("DELETED", self._known[uid])
                for item in items.values():
                    self._dispatch("MODIFIED" if item["metadata"]["uid"] in self._known else "ADDED", item)
                self._synced.set()
                self._watch_from(list_fn, listing["metadata"]["resourceVersion"])
            except Exception as exc:  # API server restarting, network blip: list again shortly
                if not self._stop.is_set():
                    log.warning("watch error (%s); listing again", exc)
                    self._stop.wait(1)
        api_client.close()

    def _watch_from(self, list_fn: Callable[..., Any], resource_version: str) -> None:
        # Streamed by hand (not kubernetes.watch.Watch): raw dicts, and stop() can cut the stream.
        while not self._stop.is_set():
            response = list_fn(
                watch=True,
                resource_version=resource_version,
                timeout_seconds=30,
                allow_watch_bookmarks=True,
                _preload_content=False,
                **self._selectors,
            )
            self._response = response
            try:
                for line in iter_resp_lines(response):
                    if self._stop.is_set():
                        return
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            return  # expired: list again
                        raise RuntimeError(f"watch error: {obj}")
                    resource_version = obj["metadata"]["resourceVersion"]
                    if kind != "BOOKMARK":
                        self._dispatch(kind, obj)
            finally:
                self._response = None
                response.release_conn()
