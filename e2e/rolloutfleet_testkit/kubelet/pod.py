"""One pod on the harness: its sandbox (IP, volumes, credentials), containers and status (a thread).

The worker owns everything about its pod: it prepares volumes and the service-account kubeconfig
(retrying while e.g. a Secret is missing), runs init containers one by one and then the app
containers, patches the pod's status whenever it changes, and on graceful deletion stops the
containers within the grace period and removes the pod object (grace period 0) so it does not stay
Terminating.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from . import events, volumes
from . import process as proc
from .addresses import AddressPool
from .container import ContainerRunner
from .credentials import ApiServer, pod_kubeconfig, write_private
from .env import HOST_IP, PodFacts, resolve_env
from .expansion import expand_all
from .images import local_command
from .kube import STRATEGIC, Kube, pod_path
from .lookups import PodLookups
from .status import ContainerView, PodView, pod_status, status_patch, timestamp, waiting

log = logging.getLogger("rolloutfleet.kubelet")

SYNC_S = 0.2  # how often the worker looks at its containers and reports changes
SETUP_RETRY_S = 2.0
DEFAULT_GRACE_S = 30.0
SHUTDOWN_GRACE_S = 2.0  # when the harness itself stops


@dataclass
class NodeContext:
    """What every pod worker shares: API access, the state dir, the address pool."""

    kube: Kube
    state_dir: Path
    api_server: ApiServer
    addresses: AddressPool
    allocatable: Callable[[str], Mapping[str, str]]  # node name → allocatable resources
    forget: Callable[[str], None]  # called with the pod's uid when its worker is done
    hosts_file: Path | None = None  # cluster DNS (cluster_dns.py), bound over each pod's /etc/hosts

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.state_dir / "logs" / f"{namespace}_{pod}_{container}.log"


class PodWorker:
    def __init__(self, pod: dict, node: NodeContext):
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self._node = node
        self._spec: dict = pod["spec"]
        self.restart_policy: str = self._spec.get("restartPolicy") or "Always"
        self.grace_s = float(self._spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
        self.pod_dir = node.state_dir / "pods" / volumes.pod_dir_name(pod)
        # hostNetwork pods share the node's address, as on a real node.
        self._host_network = bool(self._spec.get("hostNetwork"))
        self.pod_ip = (
            HOST_IP if self._host_network else node.addresses.allocate((pod.get("status") or {}).get("podIP"))
        )
        self._lookups = PodLookups(node.kube, pod)
        self._events = events.EventRecorder(node.kube, pod)
        self._volume_paths: dict[str, Path] | None = None
        self._kubeconfig: Path | None = None
        self._start_time = (pod.get("status") or {}).get("startTime") or timestamp()
        self._reported: dict = dict(pod.get("status") or {})
        self._init: list[ContainerRunner] = []
        self._containers: list[ContainerRunner] = []
        self._deletion_grace: float | None = None
        self._gone = False
        self._shutdown = False
        self._wake = threading.Event()
        self._setup_error = ""
        self.thread = threading.Thread(
            target=self._run, name=f"pod-{self.namespace}-{self.pod_name}", daemon=True
        )

    # ---- called from the informer / the harness ------------------------------------------------

    def start(self) -> PodWorker:
        self.thread.start()
        return self

    def update(self, pod: dict) -> None:
        """A newer version of the pod object (readiness gates, deletion)."""
        self.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and self._deletion_grace is None:
            seconds = meta.get("deletionGracePeriodSeconds")
            self._deletion_grace = float(seconds if seconds is not None else self.grace_s)
            self._wake.set()

    def deleted(self) -> None:
        """The pod object is gone (force deletion, or its namespace went): kill at once."""
        self._gone = True
        self._wake.set()

    def shutdown(self) -> None:
        """The harness is stopping: end the processes, leave the pod object alone."""
        self._shutdown = True
        self._wake.set()
        self.thread.join(timeout=SHUTDOWN_GRACE_S + 5)
        if self.thread.is_alive():  # e.g. still inside a long grace period: no process may outlive us
            for runner in [*self._init, *self._containers]:
                runner.force_kill()

    # ---- PodRuntime, for the containers ---------------------------------------------------------

    def log_path(self, container_name: str) -> Path:
        return self._node.log_path(self.namespace, self.pod_name, container_name)

    def event(self, kind: str, reason: str, message: str) -> None:
        self._events.record(kind, reason, message)

    def launch_for(self, container: dict) -> proc.Launch:
        """The process for a container, resolved now (so a Secret created later is picked up)."""
        facts = PodFacts(self.pod_ip, HOST_IP, self._node.allocatable(self._spec.get("nodeName", "")))
        env = resolve_env(container, self.pod, facts, self._lookups)
        argv = local_command(
            container.get("image", ""),
            expand_all(container.get("command"), env),
            expand_all(container.get("args"), env),
        )
        mounts = volumes.container_mounts(container, self._volume_paths or {}, env)
        if self._node.hosts_file is not None:
            mounts.append(volumes.Mount(str(self._node.hosts_file), "/etc/hosts", read_only=True))
        extra = {"HOSTNAME": self.pod_name}
        if self._kubeconfig is not None:
            extra["KUBECONFIG"] = str(self._kubeconfig)
        # Without workingDir a container starts in its image's WORKDIR, "/" for most images.
        working_dir = container.get("workingDir") or "/"
        return proc.Launch(argv, proc.process_env(env, extra), working_dir, mounts)

    # ---- the worker's thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not (self._gone or self._shutdown or self._deletion_grace is not None):
                try:
                    self._step()
                except Exception:  # a harness bug: keep supervising what runs, report it
                    log.exception("pod %s/%s: sync failed", self.namespace, self.pod_name)
                self._wake.wait(SYNC_S)
                self._wake.clear()
            if self._gone or self._shutdown:
                self._stop_containers(0 if self._gone else SHUTDOWN_GRACE_S)
            else:
                self._terminate()
        except Exception:
            log.exception("pod %s/%s: worker failed; killing its containers", self.namespace, self.pod_name)
            self._stop_containers(0)
        finally:
            if not self._host_network:
                self._node.addresses.release(self.pod_ip)
            volumes.remove_tree(self.pod_dir)
            self._node.forget(self.uid)

    def _step(self) -> None:
        if self._volume_paths is None:
            self._setup()
        elif not self._init_done():
            pass
        elif not self._containers:
            self._containers = [
                ContainerRunner(spec, self, self.restart_policy).start() for spec in self._spec["containers"]
            ]
        elif self._lookups.tokens_due():
            self._refresh_tokens()
        self._sync_status()

    def _setup(self) -> None:
        """Volumes and credentials; retried every few seconds until they can be made."""
        facts = PodFacts(self.pod_ip, HOST_IP, self._node.allocatable(self._spec.get("nodeName", "")))
        try:
            paths = {
                volume["name"]: volumes.prepare_volume(
                    volume, self.pod, self.pod_dir, self._node.state_dir, facts, self._lookups
                )
                for volume in self._spec.get("volumes") or []
            }
            self._write_credentials()
        except Exception as exc:  # ContainerStartError, API or connection errors: retried
            message = getattr(exc, "message", None) or str(exc)
            if message != self._setup_error:
                self._setup_error = message
                self.event("Warning", "FailedMount", message)
            self._wake.wait(SETUP_RETRY_S)
            return
        self._volume_paths = paths

    def _refresh_tokens(self) -> None:
        """Tokens are renewed at 80% of their lifetime: rewrite the kubeconfig and projected tokens."""
        self._write_credentials()
        facts = PodFacts(self.pod_ip, HOST_IP, self._node.allocatable(self._spec.get("nodeName", "")))
        for volume in self._spec.get("volumes") or []:
            sources = (volume.get("projected") or {}).get("sources") or []
            if any("serviceAccountToken" in source for source in sources):
                volumes.prepare_volume(
                    volume, self.pod, self.pod_dir, self._node.state_dir, facts, self._lookups
                )

    def _write_credentials(self) -> None:
        if self._spec.get("automountServiceAccountToken") is False:
            return  # the pod opted out of API credentials
        token = self._lookups.token()
        path = self.pod_dir / "kubeconfig"
        write_private(path, pod_kubeconfig(self._node.api_server, token.token, self.namespace))
        self._kubeconfig = path

    def _init_done(self) -> bool:
        """Run init containers one at a time; True once all have succeeded."""
        specs = self._spec.get("initContainers") or []
        for runner in self._init:
            if not runner.succeeded:
                return False
        if len(self._init) < len(specs):
            self._init.append(
                ContainerRunner(specs[len(self._init)], self, self.restart_policy, init=True).start()
            )
            return False
        return True

    def _views(
        self, runners: list[ContainerRunner], specs: list[dict], reason: str
    ) -> tuple[ContainerView, ...]:
        started = {runner.name: runner.view() for runner in runners}
        return tuple(
            started.get(spec["name"]) or ContainerView(spec["name"], spec.get("image", ""), waiting(reason))
            for spec in specs
        )

    def _view(self, terminal: bool = False) -> PodView:
        sandbox = self._volume_paths is not None
        gates = {g["conditionType"]: "False" for g in self._spec.get("readinessGates") or []}
        for condition in (self.pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") in gates:
                gates[condition["type"]] = condition.get("status", "False")
        return PodView(
            restart_policy=self.restart_policy,
            host_ip=HOST_IP,
            pod_ip=self.pod_ip,
            start_time=self._start_time,
            sandbox_ready=sandbox,
            containers=self._views(
                self._containers,
                self._spec["containers"],
                "PodInitializing" if sandbox else "ContainerCreating",
            ),
            init=self._views(self._init, self._spec.get("initContainers") or [], "PodInitializing"),
            readiness_gates=gates,
            terminal=terminal,
        )

    def _sync_status(self, terminal: bool = False) -> None:
        status = pod_status(self._view(terminal), self._reported, timestamp())
        if status == {k: self._reported.get(k) for k in status}:
            return
        try:
            self._node.kube.core.patch_namespaced_pod_status(
                name=self.pod_name,
                namespace=self.namespace,
                body=status_patch(self.uid, status),
                _content_type=STRATEGIC,
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                self._gone = True  # deleted, or replaced by a newer pod of the same name
            else:
                log.warning("pod %s/%s: status patch failed: %s", self.namespace, self.pod_name, exc)
            return
        except Exception as exc:  # connection errors (urllib3's are not OSErrors): retried next sync
            log.warning("pod %s/%s: status patch failed: %s", self.namespace, self.pod_name, exc)
            return
        self._reported = {**self._reported, **status}

    def _stop_containers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        runners = [*self._init, *self._containers]
        threads = [threading.Thread(target=r.stop, args=(deadline,), daemon=True) for r in runners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _terminate(self) -> None:
        """Graceful deletion: stop containers within the grace period, report, remove the object."""
        grace = self._deletion_grace or 0.0
        self._stop_containers(grace)
        if self._gone:
            return
        self._sync_status(terminal=True)
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self._node.kube.delete(pod_path(self.namespace, self.pod_name), body)
        except ApiException as exc:
            if exc.status != 409:  # 409: a newer pod of that name; not ours to delete
                log.warning("pod %s/%s: final delete failed: %s", self.namespace, self.pod_name, exc)
