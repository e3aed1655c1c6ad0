"""Docker from Debian (docker.io, 20.10), started by hand (PID 1 here is not systemd) with the
runtime wrapper as its default runtime, and stopped by its PID."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from rolloutfleet_testkit.cache import project_cache
from rolloutfleet_testkit.controlplane.build import say

from .config import RUNTIME_NAME, runtime_wrapper

PACKAGES = ("docker.io",)
DOCKERD = "/usr/sbin/dockerd"


def state_dir() -> Path:
    path = project_cache() / "kind"
    path.mkdir(parents=True, exist_ok=True)
    return path


def install() -> None:
    if Path(DOCKERD).exists():
        return
    say("installing Docker from Debian (docker.io; ~20 s)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES, "jq"],
    ):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")


def start(timeout_s: float = 60) -> int:
    """dockerd with the runtime wrapper as its default runtime; returns its PID once it answers."""
    wrapper = state_dir() / "runc-nosysres"
    wrapper.write_text(runtime_wrapper())
    wrapper.chmod(0o755)
    log = (state_dir() / "dockerd.log").open("w")
    process = subprocess.Popen(
        [DOCKERD, "--add-runtime", f"{RUNTIME_NAME}={wrapper}", "--default-runtime", RUNTIME_NAME],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (state_dir() / "dockerd.pid").write_text(str(process.pid))
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not start; see {state_dir() / 'dockerd.log'}")
        time.sleep(0.5)
    return process.pid


def stop(timeout_s: float = 30) -> None:
    """Stop the dockerd `start` recorded (it stops its own containerd and their shims)."""
    pid_file = state_dir() / "dockerd.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.3)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink()
