"""The images built here without Docker run under a real containerd: the proxy image, built from
images/proxy/Dockerfile on the local base, imports into a containerd of its own (Debian's 1.6, on a
private socket, root and state directory) under the name the kubelet asks for, runs `rolloutfleet-proxy
--help` as uid 65532, and holds no test kit. Needs root, containerd, runc and debootstrap (as the
local cluster does); no Kubernetes."""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rolloutfleet_testkit.images.catalog import build_image, version
from rolloutfleet_testkit.images.oci import import_archive, imported_names, normalized, write_image_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # a cold build downloads the proxy's wheels

CONFIG = """version = 2
root = "{d}/root"
state = "{d}/state"
# Images and containers only: no CRI (no kubelet here), no snapshotters this machine lacks.
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
"""


def ctr(address: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ctr", "--address", address, "-n", "k8s.io", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def containerd() -> Iterator[str]:
    """A containerd of this test's own; stopped by its PID, its mounts and directories removed."""
    if not shutil.which("containerd") or not shutil.which("runc"):
        pytest.fail("containerd and runc are needed (Debian: apt-get install containerd runc)")
    # Short and private: a unix socket's path has a 108-byte limit.
    directory = Path(f"/tmp/rf-images-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)
    (directory / "config.toml").write_text(CONFIG.format(d=directory))
    address = str(directory / "containerd.sock")
    with (directory / "containerd.log").open("wb") as log:
        process = subprocess.Popen(
            ["containerd", "--config", str(directory / "config.toml")], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while ctr(address, "version", timeout=10).returncode != 0:
            assert process.poll() is None, (directory / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "containerd did not answer within 30 s"
            time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            mountpoint = line.split()[1]
            if mountpoint.startswith(str(directory)):
                subprocess.run(["umount", "-l", mountpoint], check=False)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def proxy_image(containerd: str, tmp_path_factory: pytest.TempPathFactory):
    built = build_image("proxy")
    archive = write_image_archive(
        tmp_path_factory.mktemp("proxy-image") / "proxy.tar", built.layers, built.config, built.names
    )
    started = time.monotonic()
    import_archive(archive, containerd)
    print(f"imported {archive.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - started:.1f}s")
    archive.unlink()
    return built


def run(address: str, image: str, *command: str) -> subprocess.CompletedProcess:
    """The image's container with `command` (replacing its entrypoint), removed afterwards."""
    return ctr(address, "run", "--rm", image, f"t-{uuid.uuid4().hex[:12]}", *command, timeout=180)


def test_the_proxy_image_is_named_as_the_kubelet_asks_for_it(containerd, proxy_image):
    (name,) = proxy_image.names
    assert name == f"rolloutfleet-proxy:{version()}"
    assert normalized(name) in imported_names(containerd)


def test_the_proxy_image_runs_the_proxy_as_uid_65532(containerd, proxy_image):
    image = normalized(proxy_image.names[0])
    help_ = run(containerd, image, "rolloutfleet-proxy", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "usage" in help_.stdout.lower(), help_.stdout
    who = run(containerd, image, "id", "-u")
    assert who.returncode == 0 and who.stdout.strip() == "65532", (who.stdout, who.stderr)
    assert proxy_image.config["Entrypoint"] == ["rolloutfleet-proxy"]


def test_the_proxy_image_holds_no_test_kit(containerd, proxy_image):
    image = normalized(proxy_image.names[0])
    probe = (
        "import importlib.util as u, shutil; "
        "print(u.find_spec('rolloutfleet_proxy') is not None, u.find_spec('rolloutfleet_testkit') is None, "
        "shutil.which('rolloutfleet-sglang-emulator') is None, shutil.which('uv') is None)"
    )
    found = run(containerd, image, "python", "-c", probe)
    assert found.returncode == 0, found.stderr
    # The builder stage's uv stays behind (images/proxy/Dockerfile is multi-stage).
    assert found.stdout.split() == ["True", "True", "True", "True"]
    # And no file of it in the image's tree (a package, a console script, data files).
    kit = [path for path in image_tree(proxy_image.layers) if re.search(r"rolloutfleet_testkit|sglang", path)]
    assert not kit, kit[:5]


def image_tree(layers: list[Path]) -> set[str]:
    """The paths of the image's root filesystem: its layers applied bottom first, whiteouts deleting."""
    paths: set[str] = set()
    for layer in layers:
        with tarfile.open(layer) as read:
            names = [name.removeprefix("./").rstrip("/") for name in read.getnames()]
        for name in names:
            parent, _, base = name.rpartition("/")
            if base == ".wh..wh..opq":
                paths = {p for p in paths if not p.startswith(f"{parent}/")}
            elif base.startswith(".wh."):
                gone = f"{parent}/{base.removeprefix('.wh.')}".lstrip("/")
                paths = {p for p in paths if p != gone and not p.startswith(f"{gone}/")}
        paths.update(n for n in names if not n.rpartition("/")[2].startswith(".wh."))
    return paths
