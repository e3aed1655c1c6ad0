"""Starting a container's process, running commands beside it, and signalling it.

Each container is one process in its own session and process group (so signals reach everything
it spawned), with stdout and stderr appended to its log file. A container with volume mounts runs
in a private mount namespace: `unshare` + a small `sh` script that bind-mounts its volumes and
then `exec`s the command, so the container's PID is the program's own. Root is needed for the
mounts; run as another user, a user namespace mapping that user to root is added.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .volumes import Mount, mount_script

# Host variables a process needs to find programs and caches; everything else comes from the spec.
HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "HF_HOME", "HF_HUB_OFFLINE")


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    working_dir: str | None = None
    mounts: list[Mount] = field(default_factory=list)


class StartFailed(Exception):
    """The program could not be executed (like a runtime's StartError: exit code 128)."""


def process_env(container_env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """Host basics, then the harness's own (HOSTNAME, KUBECONFIG), then the spec's (which win)."""
    env = {name: os.environ[name] for name in HOST_ENV if name in os.environ}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return {**env, **extra, **container_env}


def harness_paths() -> list[str]:
    """Host paths this harness's programs run from: the checkout (editable installs point there) and
    the environments of this interpreter and of the proxy's (ROLLOUTFLEET_PROXY_PYTHON)."""
    import rolloutfleet_testkit

    paths = {str(Path(rolloutfleet_testkit.__file__).resolve().parents[2]), sys.prefix}
    proxy_python = os.environ.get("ROLLOUTFLEET_PROXY_PYTHON")
    if proxy_python:
        paths.add(str(Path(proxy_python).parent.parent))
    return sorted(paths)


def wrapped_argv(launch: Launch, euid: int | None = None) -> list[str]:
    if not launch.mounts:
        return list(launch.argv)
    unshare = shutil.which("unshare") or "unshare"
    namespace = ["--mount", "--propagation", "private"]
    if (os.geteuid() if euid is None else euid) != 0:
        namespace = ["--user", "--map-root-user", *namespace]
    script = mount_script(launch.mounts, launch.working_dir, harness_paths())
    return [unshare, *namespace, "--", "/bin/sh", "-c", script, "sh", *launch.argv]


def start(launch: Launch, log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cwd = None
    if launch.working_dir and not launch.mounts:  # with mounts, the script changes directory
        Path(launch.working_dir).mkdir(parents=True, exist_ok=True)
        cwd = launch.working_dir
    with open(log_path, "ab") as log:
        try:
            return subprocess.Popen(
                wrapped_argv(launch),
                env=launch.env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise StartFailed(f"failed to start {launch.argv[:1]}: {exc}") from exc


def exit_code(returncode: int) -> int:
    """A shell-style exit code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def run_beside(launch: Launch, pid: int | None, command: Sequence[str], timeout_s: float) -> int:
    """Run `command` as if inside the container (its env, its mounts via nsenter when it has any):
    exec probes and preStop hooks. Returns the exit code; raises TimeoutError."""
    if launch.mounts and pid is not None:
        argv = [shutil.which("nsenter") or "nsenter", "--target", str(pid), "--mount", "--wd", "--", *command]
        cwd = None
    else:
        argv, cwd = list(command), launch.working_dir
    try:
        completed = subprocess.run(
            argv,
            env=launch.env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{command[:1]} timed out after {timeout_s}s") from exc
    return exit_code(completed.returncode)


def terminate(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
    if process.poll() is None:
        signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=max(grace_s, 0))
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
    signal_group(process.pid, signal.SIGKILL)  # stragglers that left the leader behind
    return exit_code(process.returncode)
