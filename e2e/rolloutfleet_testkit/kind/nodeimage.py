"""kind's node image, built here without Docker and without a registry (what `kind build node-image`
and kind's base image do, from the parts this machine has): a Debian rootfs with systemd,
containerd and runc, kind's own base files (from kind's Go module), the Kubernetes binaries the test
kit builds (and kubeadm), and a containerd image store holding every image kubeadm's static pods and
the cluster's add-ons run, all built here too. Cached by the content of its inputs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rolloutfleet_testkit.controlplane.build import KUBERNETES_VERSION, binaries_dir, ensure_kubeadm, go, say
from rolloutfleet_testkit.images.base import debootstrap
from rolloutfleet_testkit.images.cache import images_cache
from rolloutfleet_testkit.images.oci import import_archive, sha256_file, tar_layer, write_image_archive
from rolloutfleet_testkit.images.static import static_image
from rolloutfleet_testkit.node.binaries import PAUSE_VERSION, coredns_binary, ensure_node_binaries

from .config import KIND_VERSION, image_names

NODE_IMAGE = f"rolloutfleet.local/kind-node:{KUBERNETES_VERSION}"
# The control plane's programs in the one image kubeadm's static pods and kube-proxy run.
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "etcd")
# kind's base image's packages (images/base/Dockerfile), with containerd, runc and the CNI plugins
# from Debian instead of kind's own builds of them from source checkouts.
NODE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "conntrack",
    "iptables",
    "nftables",
    "iproute2",
    "ethtool",
    "util-linux",
    "mount",
    "kmod",
    "libseccomp2",
    "pigz",
    "e2fsprogs",
    "bash",
    "ca-certificates",
    "curl",
    "jq",
    "procps",
    "containerd",
    "runc",
    "containernetworking-plugins",
)
CNI_PLUGINS = ("host-local", "loopback", "ptp", "portmap")
# kind's containerd config names this sandbox image; kubeadm lists another pause tag.
KIND_SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"
STORAGE_CLASS = """apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"""


def kind_base_files() -> Path:
    """kind's images/base/files from its module in the Go module cache (fetched by the proxy)."""
    info = json.loads(
        go(["mod", "download", "-json", f"sigs.k8s.io/kind@{KIND_VERSION}"], cwd=Path(tempfile.gettempdir()))
    )
    return Path(info["Dir"]) / "images" / "base" / "files"


def wanted_by(unit: str) -> list[str]:
    """The targets a unit file's [Install] section names (what `systemctl enable` links it into). Pure."""
    targets: list[str] = []
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "WantedBy":
            targets += value.split()
    return targets


def node_rootfs() -> Path:
    """The node's Debian layer (a tar), built once per package list and cached."""
    key = hashlib.sha256(" ".join(NODE_PACKAGES).encode()).hexdigest()[:16]
    directory = images_cache() / f"kind-rootfs-{key}"
    layer = directory / "layer.tar"
    if layer.exists():
        return layer
    rootfs = directory / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    started = time.monotonic()
    say(f"debootstrap of kind's node rootfs ({len(NODE_PACKAGES)} packages)")
    debootstrap(rootfs, NODE_PACKAGES)
    tar_layer(rootfs, layer, mtime=None)
    shutil.rmtree(rootfs)
    say(f"node rootfs in {time.monotonic() - started:.0f}s ({layer.stat().st_size / 2**20:.0f} MiB)")
    return layer


def kind_tree(files: Path, tree: Path, kubernetes_bins: dict[str, Path]) -> None:
    """On top of the node rootfs in `tree`: what kind's base Dockerfile and node-image build add."""
    shutil.copytree(files, tree, dirs_exist_ok=True, symlinks=True)
    for script in [*(tree / "usr/local/bin").iterdir(), *(tree / "kind/bin").iterdir()]:
        script.chmod(0o755)
    # kind's systemd clean-up: no units but those it enables.
    for pattern in (
        "lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service",
        "lib/systemd/system/multi-user.target.wants/*",
        "etc/systemd/system/*.wants/*",
        "lib/systemd/system/local-fs.target.wants/*",
        "lib/systemd/system/sockets.target.wants/*udev*",
        "lib/systemd/system/sockets.target.wants/*initctl*",
        "lib/systemd/system/basic.target.wants/*",
    ):
        for path in tree.glob(pattern):
            if path.is_symlink() or path.is_file():
                path.unlink()
    with (tree / "etc/systemd/journald.conf").open("a") as conf:
        conf.write("ReadKMsg=no\n")
    init = tree / "sbin/init"
    if init.exists() or init.is_symlink():
        init.unlink()
    init.symlink_to("/usr/lib/systemd/systemd")
    for unit in ("kubelet.service", "containerd.service", "undo-mount-hacks.service"):
        text = (tree / "etc/systemd/system" / unit).read_text()
        for target in wanted_by(text):
            wants = tree / "etc/systemd/system" / f"{target}.wants"
            wants.mkdir(parents=True, exist_ok=True)
            (wants / unit).unlink(missing_ok=True)
            (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")
    (tree / "etc/systemd/system/systemd-binfmt.service").symlink_to("/dev/null")
    (tree / "etc/kubernetes/manifests").mkdir(parents=True, exist_ok=True)
    # Debian's containerd and runc where kind's units and scripts call them.
    for name in ("containerd", "ctr", "containerd-shim-runc-v2"):
        (tree / "usr/local/bin" / name).symlink_to(f"/usr/bin/{name}")
    (tree / "usr/local/sbin").mkdir(parents=True, exist_ok=True)
    (tree / "usr/local/sbin/runc").symlink_to("/usr/sbin/runc")
    (tree / "opt/cni/bin").mkdir(parents=True, exist_ok=True)
    for plugin in CNI_PLUGINS:
        (tree / "opt/cni/bin" / plugin).symlink_to(f"/usr/lib/cni/{plugin}")
    spec = json.loads(
        subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True).stdout
    )
    spec.setdefault("hooks", {}).setdefault("createContainer", []).append(
        {"path": "/kind/bin/mount-product-files.sh"}
    )
    spec["process"].pop("rlimits", None)
    (tree / "etc/containerd/cri-base.json").write_text(json.dumps(spec, indent=2))
    # Root here lacks CAP_SYS_RESOURCE (notes/kind.md): without this the kubelet logs permission errors.
    config = tree / "etc/containerd/config.toml"
    config.write_text(
        config.read_text().replace("restrict_oom_score_adj = false", "restrict_oom_score_adj = true")
    )
    for name, path in kubernetes_bins.items():
        shutil.copy2(path, tree / "usr/bin" / name)
    (tree / "kind/version").write_text(KUBERNETES_VERSION)
    (tree / "kind/manifests").mkdir(parents=True, exist_ok=True)
    (tree / "kind/manifests/default-storage.yaml").write_text(STORAGE_CLASS)


def component_archives(rootfs_layer: Path, work: Path, kubeadm: Path) -> list[Path]:
    """The images kubeadm's static pods and add-ons run, under the names kubeadm and kind's
    containerd config use: one image (the node rootfs + the control plane's binaries on PATH) for
    the API server, controller manager, scheduler, kube-proxy and etcd; CoreDNS and pause static."""
    listing = subprocess.run(
        [str(kubeadm), "config", "images", "list", "--kubernetes-version", KUBERNETES_VERSION],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = image_names(listing)
    bins = binaries_dir()
    binaries = work / "component-bin"
    (binaries / "usr/local/bin").mkdir(parents=True)
    for name in COMPONENTS:
        shutil.copy2(bins / name, binaries / "usr/local/bin" / name)
    bin_layer = tar_layer(binaries, work / "component-bin.tar")
    components = [names[c] for c in COMPONENTS]
    kube = write_image_archive(
        work / "kube.tar",
        [rootfs_layer, bin_layer],
        {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        components,
    )
    node_bin = ensure_node_binaries()
    pause = static_image(
        node_bin / f"pause-{PAUSE_VERSION}", names["pause"], ["/pause"], more_names=(KIND_SANDBOX_IMAGE,)
    )
    coredns = static_image(coredns_binary(), names["coredns"], ["/coredns"])
    return [kube, pause, coredns]


def preload(store: Path, archives: list[Path], work: Path) -> None:
    """The archives in a containerd image store at `store` (the node's /var/lib/containerd), as
    `kind build node-image` leaves them: imported by a containerd of this machine (Debian's, the
    node's own version), not unpacked (the node's CRI unpacks an image when a container first
    needs it). containerd 1.6 has no pinned images: the kubelet's image GC could remove them at
    disk pressure (85% by default), as on any kind node."""
    state = work / "containerd-state"
    address = str(work / "containerd.sock")
    config = work / "containerd.toml"
    config.write_text('version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n')
    log = (work / "containerd.log").open("w")
    process = subprocess.Popen(
        [
            "containerd",
            "--config",
            str(config),
            "--root",
            str(store),
            "--state",
            str(state),
            "--address",
            address,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", address, "version"], capture_output=True).returncode != 0:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"containerd for the node's image store did not start: {work / 'containerd.log'}"
                )
            time.sleep(0.2)
        for archive in archives:
            import_archive(archive, address, options=("--no-unpack",))
    finally:
        process.terminate()
        process.wait(timeout=30)


def node_image() -> Path:
    """The node image's archive (`docker load -i`), built unless cached for these inputs."""
    kubeadm = ensure_kubeadm()
    bins = binaries_dir()
    kubernetes_bins = {"kubeadm": kubeadm, "kubelet": bins / "kubelet", "kubectl": bins / "kubectl"}
    rootfs_layer = node_rootfs()
    files = kind_base_files()
    node_bin = ensure_node_binaries()
    inputs = [
        rootfs_layer,
        kubeadm,
        *kubernetes_bins.values(),
        # What the preloaded images hold (component_archives): a new build of any changes the image.
        *(bins / name for name in COMPONENTS),
        coredns_binary(),
        node_bin / f"pause-{PAUSE_VERSION}",
        *sorted(p for p in files.rglob("*") if p.is_file()),
    ]
    digest = hashlib.sha256(f"{KIND_VERSION} {KUBERNETES_VERSION} v1".encode())
    for path in inputs:
        digest.update(sha256_file(path).encode())
    key = digest.hexdigest()[:16]
    out = images_cache() / "kind" / f"node-{key}.tar"
    if out.exists():
        return out
    for stale in out.parent.glob("node-*.tar"):  # other inputs' builds: 1.5 GB each
        stale.unlink()
    started = time.monotonic()
    work = images_cache() / "kind" / f"work-{key}"
    shutil.rmtree(work, ignore_errors=True)
    tree = work / "tree"
    tree.mkdir(parents=True)
    subprocess.run(["tar", "--numeric-owner", "-xf", str(rootfs_layer), "-C", str(tree)], check=True)
    kind_tree(files, tree, kubernetes_bins)
    archives = component_archives(rootfs_layer, work, kubeadm)
    preload(tree / "var/lib/containerd", archives, work)
    layer = tar_layer(tree, work / "node-layer.tar", mtime=None)
    config = {
        "Entrypoint": ["/usr/local/bin/entrypoint", "/sbin/init"],
        "Env": ["container=docker", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "StopSignal": "SIGRTMIN+3",
    }
    write_image_archive(out, [layer], config, [NODE_IMAGE])
    shutil.rmtree(work)
    say(f"kind node image built in {time.monotonic() - started:.0f}s ({out.stat().st_size / 2**30:.2f} GiB)")
    return out
