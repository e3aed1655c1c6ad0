"""One container's life: start, watch, probe, restart with backoff, stop gracefully (a thread).

Restart backoff starts at 1 s and doubles up to 10 s (a real kubelet: 10 s up to 5 min; shortened
so tests see restarts quickly); it resets once a container has run for 20 s. The pod worker reads
`view()` to build the pod status and calls `stop()`/`kill()`; everything else happens in the
container's own thread.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from . import probing
from . import process as proc
from .errors import ContainerStartError
from .probes import Probe, ProbeTracker, parse_probe
from .status import ContainerView, running, terminated, timestamp, waiting

log = logging.getLogger("rolloutfleet.kubelet")

BACKOFF_START_S = 1.0
BACKOFF_CAP_S = 10.0
BACKOFF_RESET_S = 2 * BACKOFF_CAP_S
TICK_S = 0.1
CONFIG_RETRY_S = 2.0  # how often a container that cannot start yet (missing Secret, …) is retried


def backoff_delay(crashes: int) -> float:
    """Delay before restart number `crashes` (1-based) of a container that keeps exiting."""
    return min(BACKOFF_CAP_S, BACKOFF_START_S * 2 ** max(crashes - 1, 0))


def should_restart(restart_policy: str, code: int) -> bool:
    return restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0)


class PodRuntime(Protocol):
    """What a container needs from its pod (implemented by pod.PodWorker)."""

    pod_name: str
    pod_ip: str
    grace_s: float

    def launch_for(self, container: dict) -> proc.Launch: ...

    def log_path(self, container_name: str) -> Path: ...

    def event(self, kind: str, reason: str, message: str) -> None: ...


class ContainerRunner:
    def __init__(self, spec: dict, pod: PodRuntime, restart_policy: str, init: bool = False):
        self.spec = spec
        self.name: str = spec["name"]
        self.image: str = spec.get("image", "")
        self._pod = pod
        self._init = init
        # Init containers are re-run only on failure (and not at all under restartPolicy Never).
        self._policy = ("Never" if restart_policy == "Never" else "OnFailure") if init else restart_policy
        self._lock = threading.Lock()
        self._state: dict = waiting("ContainerCreating")
        self._last_state: dict = {}
        self._runs = 0
        self._ready = False
        self._started = False
        self._container_id: str | None = None
        self._process: subprocess.Popen | None = None
        self._launch: proc.Launch | None = None
        self._started_at = ""
        self._started_mono = 0.0
        self._crashes = 0
        self._next_start = 0.0
        self._finished = False  # exited and will not be restarted
        self._probes: dict[str, ProbeTracker] = {}
        self._last_config_error = ""
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"container-{pod.pod_name}-{self.name}", daemon=True
        )

    # ---- read by the pod worker ---------------------------------------------------------------

    def view(self) -> ContainerView:
        with self._lock:
            return ContainerView(
                name=self.name,
                image=self.image,
                state=dict(self._state),
                last_state=dict(self._last_state),
                restart_count=max(self._runs - 1, 0),
                ready=self._ready,
                started=self._started,
                container_id=self._container_id,
            )

    @property
    def succeeded(self) -> bool:
        return self.view().exit_code == 0

    @property
    def finished(self) -> bool:
        return self._finished

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ContainerRunner:
        self.thread.start()
        return self

    def stop(self, deadline: float) -> None:
        """Graceful stop: preStop hook, SIGTERM, SIGKILL at `deadline` (monotonic). Called from the
        pod worker; the container's own thread is ended first so only one thread owns the process."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._run_pre_stop(deadline)
            self._pod.event("Normal", "Killing", f"Stopping container {self.name}")
        code = proc.terminate(process, deadline - time.monotonic())
        self._record_exit(code)

    def kill(self) -> None:
        self.stop(time.monotonic())

    def force_kill(self) -> None:
        """SIGKILL the process group from any thread: the last resort when the harness stops."""
        process = self._process
        if process is not None:
            proc.signal_group(process.pid, signal.SIGKILL)

    # ---- the container's thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a harness bug must not leave the process unsupervised silently
                log.exception("container %s/%s: unexpected error", self._pod.pod_name, self.name)
            self._stop.wait(TICK_S)

    def _step(self) -> None:
        process = self._process
        if process is None:
            if not self._finished and time.monotonic() >= self._next_start:
                self._start()
            return
        code = process.poll()
        if code is not None:
            self._after_exit(proc.exit_code(code))
        elif not self._init:
            self._probe(process)

    def _start(self) -> None:
        try:
            launch = self._pod.launch_for(self.spec)
        except ContainerStartError as exc:
            return self._blocked(exc)
        try:
            probes = self._parse_probes()
        except ValueError as exc:  # e.g. a probe naming a port the container does not declare
            return self._blocked(ContainerStartError("CreateContainerConfigError", str(exc)))
        self._launch = launch
        now = time.monotonic()
        with self._lock:
            self._runs += 1
            self._started_at = timestamp()
            self._started_mono = now
        try:
            process = proc.start(launch, self._pod.log_path(self.name))
        except proc.StartFailed as exc:
            self._after_exit(128, reason="StartError", message=str(exc))
            return
        self._process = process
        self._probes = {kind: ProbeTracker(probe, now) for kind, probe in probes.items()}
        with self._lock:
            self._container_id = f"process://{process.pid}"
            self._state = running(self._started_at)
            self._started = "startupProbe" not in self._probes
            self._ready = self._started and "readinessProbe" not in self._probes
        self._pod.event("Normal", "Started", f"Started container {self.name}")

    def _parse_probes(self) -> dict[str, Probe]:
        if self._init:
            return {}  # init containers run to completion unprobed
        probes = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = parse_probe(self.spec.get(kind), self.spec.get("ports") or [])
            if probe is not None:
                probes[kind] = probe
        return probes

    def _blocked(self, exc: ContainerStartError) -> None:
        """The container cannot start yet: say why in its waiting state and retry a little later."""
        with self._lock:
            self._state = waiting(exc.reason, exc.message)
        if exc.message != self._last_config_error:
            self._last_config_error = exc.message
            self._pod.event("Warning", "Failed", f"Error: {exc.message}")
        self._next_start = time.monotonic() + CONFIG_RETRY_S

    def _record_exit(self, code: int, reason: str | None = None, message: str | None = None) -> dict:
        self._process = None
        state = terminated(code, self._started_at, timestamp(), self._container_id, reason, message)
        with self._lock:
            self._state = state
            self._ready = self._init and code == 0  # a completed init container reports ready
            self._started = False
        return state

    def _after_exit(self, code: int, reason: str | None = None, message: str | None = None) -> None:
        state = self._record_exit(code, reason, message)
        now = time.monotonic()
        if not should_restart(self._policy, code):
            self._finished = True
            return
        if now - self._started_mono >= BACKOFF_RESET_S:
            self._crashes = 0
        self._crashes += 1
        delay = backoff_delay(self._crashes)
        self._next_start = now + delay
        message = f"back-off {delay:g}s restarting failed container={self.name} pod={self._pod.pod_name}"
        with self._lock:
            self._last_state = state
            self._state = waiting("CrashLoopBackOff", message)
        self._pod.event("Warning", "BackOff", f"Back-off restarting failed container {self.name}")

    # ---- probes -------------------------------------------------------------------------------

    def _exec(self, process: subprocess.Popen) -> Callable[[list[str] | tuple[str, ...], float], int]:
        launch = self._launch
        assert launch is not None
        return lambda command, timeout: proc.run_beside(launch, process.pid, command, timeout)

    def _check(self, kind: str, process: subprocess.Popen) -> bool | None:
        tracker = self._probes.get(kind)
        now = time.monotonic()
        if tracker is None or not tracker.due(now):
            return tracker.result if tracker else None
        ok = probing.check(tracker.probe, self._pod.pod_ip, self._exec(process))
        before = tracker.result
        result = tracker.record(ok, time.monotonic())
        if not ok:
            what = {"startupProbe": "Startup", "livenessProbe": "Liveness", "readinessProbe": "Readiness"}[
                kind
            ]
            self._pod.event("Warning", "Unhealthy", f"{what} probe failed")
        if result is not before:
            log.debug("%s/%s %s: %s", self._pod.pod_name, self.name, kind, result)
        return result

    def _probe(self, process: subprocess.Popen) -> None:
        if not self._started:
            result = self._check("startupProbe", process)
            if result is False:
                return self._kill_unhealthy(process, "startupProbe", "failed startup probe")
            if result is True:
                with self._lock:
                    self._started = True
                    self._ready = "readinessProbe" not in self._probes
            return
        if self._check("livenessProbe", process) is False:
            return self._kill_unhealthy(process, "livenessProbe", "failed liveness probe")
        readiness = self._check("readinessProbe", process)
        if "readinessProbe" in self._probes:
            with self._lock:
                self._ready = readiness is True

    def _kill_unhealthy(self, process: subprocess.Popen, kind: str, why: str) -> None:
        """Restart a container whose liveness/startup probe failed (SIGTERM, grace, SIGKILL)."""
        grace = self._probes[kind].probe.termination_grace_s
        grace_s = float(grace) if grace is not None else self._pod.grace_s
        self._pod.event("Normal", "Killing", f"Container {self.name} {why}, will be restarted")
        with self._lock:
            self._ready = False
        code = proc.terminate(process, grace_s)
        self._after_exit(code)

    def _run_pre_stop(self, deadline: float) -> None:
        hook = ((self.spec.get("lifecycle") or {}).get("preStop")) or {}
        launch, process = self._launch, self._process
        remaining = deadline - time.monotonic()
        if not hook or launch is None or process is None or remaining <= 0:
            return
        try:
            if "exec" in hook:
                proc.run_beside(launch, process.pid, hook["exec"].get("command") or [], remaining)
            elif "httpGet" in hook:
                probe = parse_probe(
                    {"httpGet": hook["httpGet"], "timeoutSeconds": remaining}, self.spec.get("ports") or []
                )
                if probe is not None:
                    probing.http_ok(probe, self._pod.pod_ip)
            elif "sleep" in hook:
                time.sleep(min(float(hook["sleep"].get("seconds") or 0), remaining))
        except (TimeoutError, OSError, ValueError) as exc:
            self._pod.event("Warning", "FailedPreStopHook", f"PreStopHook failed: {exc}")
