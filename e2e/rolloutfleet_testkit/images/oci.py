"""Image archives containerd imports: layers (plain tar files) and an image config, written in the
`docker save` layout (`manifest.json` with RepoTags, the config as `<digest>.json`, one directory per
layer). `ctr images import` (containerd 1.6) reads it and names the image by RepoTags normalized as
the kubelet normalizes image references (`rolloutfleet-proxy:1.2.3` →
`docker.io/library/rolloutfleet-proxy:1.2.3`), so pods with imagePullPolicy Never/IfNotPresent find it.

No registry is reachable here, so every image a pod runs is imported this way.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import subprocess
import tarfile
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 1 << 20
IMPORT_TIMEOUT_S = 1800  # the SGLang emulator's image is gigabytes (torch); ~10 s per 200 MB here
# Extended headers named without the writer's PID (GNU tar's default holds it), times other than
# mtime left out: the same tree gives the same bytes.
_PAX = "exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tar_layer(rootfs: Path, out: Path, *, mtime: int | None = 0) -> Path:
    """A layer: the directory's tree as an uncompressed tar, deterministic (entries sorted, numeric
    owners kept, every mtime set to `mtime`). GNU tar does what a layer needs of hard links, symlinks,
    devices and file capabilities. `mtime=None` keeps the tree's own times, for trees whose .pyc files
    are checked against their sources' mtimes (a Python base image)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    command = ["tar", "--format=posix", f"--pax-option={_PAX}", "--sort=name", "--numeric-owner"]
    command += ["--xattrs", "--xattrs-include=security.capability", "--xattrs-include=user.*"]
    if mtime is not None:
        command.append(f"--mtime=@{mtime}")
    result = subprocess.run(
        [*command, "-C", str(rootfs), "-cf", str(partial), "."], capture_output=True, text=True
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"tar of {rootfs} failed ({result.returncode}): {result.stderr[-2000:]}")
    partial.replace(out)
    return out


def image_config(config: dict[str, Any], diff_ids: list[str]) -> dict[str, Any]:
    """The image's config document (pure): runtime settings and the layers' uncompressed digests."""
    return {
        "architecture": _ARCH.get(platform.machine(), platform.machine()),
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created_by": "rolloutfleet_testkit.images"} for _ in diff_ids],
    }


def config_document(config: dict[str, Any], diff_ids: list[str]) -> bytes:
    """The config document's bytes, as an archive holds them and a registry stores them."""
    return json.dumps(image_config(config, diff_ids), sort_keys=True).encode()


def write_image_archive(out: Path, layers: list[Path], config: dict[str, Any], names: list[str]) -> Path:
    """An archive of `layers` (tar files, bottom first) with `config` (Entrypoint, Cmd, Env,
    WorkingDir, User, ExposedPorts, Labels), named with every name in `names`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("wb") as file:
        stream_image_archive(file, layers, config, names)
    partial.replace(out)
    return out


def stream_image_archive(
    file: BinaryIO,
    layers: list[Path],
    config: dict[str, Any],
    names: list[str],
    packed: list[Path] | None = None,
) -> None:
    """The archive `write_image_archive` writes, written to `file` as a stream (a pipe into an
    importer: no copy of gigabytes of layers on disk). `packed`: the layers gzip-compressed, put in
    their place (containerd detects the compression and stores them so: a third of the space)."""
    if not layers or not names:
        raise ValueError("an image needs at least one layer and one name")
    if packed is not None and len(packed) != len(layers):
        raise ValueError("one compressed file per layer")
    diff_ids = [sha256_file(layer) for layer in layers]
    document = config_document(config, diff_ids)
    config_name = f"{hashlib.sha256(document).hexdigest()}.json"
    layer_names = [f"{d}/layer.tar" for d in diff_ids]
    manifest = [{"Config": config_name, "RepoTags": list(names), "Layers": layer_names}]
    with tarfile.open(fileobj=file, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        _add_bytes(archive, config_name, document)
        files = packed if packed is not None else layers
        for name, layer in dict(zip(layer_names, files, strict=True)).items():  # a repeated layer once
            info = tarfile.TarInfo(name)
            info.size, info.mode = layer.stat().st_size, 0o644
            with layer.open("rb") as data:
                archive.addfile(info, data)
        _add_bytes(archive, "manifest.json", json.dumps(manifest).encode())


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    archive.addfile(info, io.BytesIO(data))


def normalized(name: str) -> str:
    """The reference containerd and the kubelet use for an image name (Docker Hub's defaults)."""
    path, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    first = path.split("/", 1)[0]
    if "/" not in path:
        path = f"docker.io/library/{path}"
    elif "." not in first and ":" not in first and first != "localhost":
        path = f"docker.io/{path}"
    return f"{path}:{tag}"


class ImportFailed(RuntimeError):
    """containerd refused an archive: its image store may be damaged (e.g. a snapshot's parent gone
    after a containerd killed mid-write, or images removed by the kubelet's disk-pressure GC)."""


def import_archive(
    archive: Path, address: str, namespace: str = "k8s.io", options: tuple[str, ...] = ()
) -> None:
    """`ctr images import` into the containerd at `address` (its socket), unpacked for its default
    snapshotter (what the CRI plugin runs containers from) unless `options` say otherwise."""
    command = [
        "ctr",
        "--address",
        address,
        "--namespace",
        namespace,
        "images",
        "import",
        *options,
        str(archive),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
    except FileNotFoundError as error:
        raise RuntimeError("ctr is not installed (Debian's containerd package has it)") from error
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(
            f"ctr images import {archive} into {address}: no end in {IMPORT_TIMEOUT_S}s"
        ) from error
    if result.returncode != 0:
        raise ImportFailed(
            f"ctr images import {archive} into {address} (namespace {namespace}) failed "
            f"({result.returncode}):\n{result.stderr[-2000:]}"
        )


def imported_names(address: str, namespace: str = "k8s.io") -> set[str]:
    result = subprocess.run(
        ["ctr", "--address", address, "--namespace", namespace, "images", "ls", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(result.stdout.split())
