"""Pod volumes as host directories, and the mounts that put them at each container's mountPath.

Where each volume lives on the host:
- emptyDir (any medium): <state>/pods/<pod dir>/volumes/<name>, removed with the pod;
- hostPath: the path itself (created for type DirectoryOrCreate or unset, touched for FileOrCreate);
- persistentVolumeClaim: <state>/pvc/<namespace>/<claimName>, kept across pods, so a replacement pod
  with the same claim finds its predecessor's files (provisioner.py points the claim's PV there);
- configMap, secret, downwardAPI, projected (incl. serviceAccountToken): files written from the API
  into <pod dir>/volumes/<name> when the pod starts (later ConfigMap edits are not propagated).

Containers see them through bind mounts in a private mount namespace (process.py), so the host's
own mount table is untouched; only missing mountPath directories get created on the host (empty).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from .credentials import Token, write_private
from .env import PodFacts, field_value, resource_value
from .errors import mount_error
from .expansion import expand

DEFAULT_MODE = 0o644


class VolumeLookups(Protocol):
    def config_map_files(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    def secret_files(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    def token(self, audiences: list[str] | None, seconds: int) -> Token: ...


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


def pod_dir_name(pod: Mapping) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def claim_dir(state_dir: Path, namespace: str, claim: str) -> Path:
    return state_dir / "pvc" / namespace / claim


def volume_host_path(volume: Mapping, pod: Mapping, pod_dir: Path, state_dir: Path) -> Path:
    """Where a volume's files live on the host (pure)."""
    if "hostPath" in volume:
        return Path(volume["hostPath"]["path"])
    if "persistentVolumeClaim" in volume:
        return claim_dir(
            state_dir, pod["metadata"]["namespace"], volume["persistentVolumeClaim"]["claimName"]
        )
    return pod_dir / "volumes" / volume["name"]


def _select(
    files: dict[str, bytes] | None, items: Sequence[Mapping] | None, optional: bool, what: str
) -> list[tuple[str, bytes, int | None]]:
    """(relative path, content, mode) for a ConfigMap/Secret source, honouring `items`."""
    if files is None:
        if optional:
            return []
        raise mount_error(f"{what} not found")
    if not items:
        return [(key, value, None) for key, value in sorted(files.items())]
    selected = []
    for item in items:
        if item["key"] not in files:
            if optional:
                continue
            raise mount_error(f"key {item['key']!r} not found in {what}")
        selected.append((item.get("path") or item["key"], files[item["key"]], item.get("mode")))
    return selected


def _safe_join(root: Path, relative: str) -> Path:
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts:
        raise mount_error(f"volume file path {relative!r} must be relative and inside the volume")
    return root / path


def _downward_files(
    items: Sequence[Mapping], pod: Mapping, facts: PodFacts
) -> list[tuple[str, bytes, int | None]]:
    files = []
    for item in items:
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"], facts)
        else:
            container = next(
                (
                    c
                    for c in pod["spec"]["containers"]
                    if c["name"] == item["resourceFieldRef"].get("containerName")
                ),
                pod["spec"]["containers"][0],
            )
            value = resource_value(container, item["resourceFieldRef"], facts)
        files.append((item["path"], value.encode(), item.get("mode")))
    return files


def volume_files(
    volume: Mapping, pod: Mapping, facts: PodFacts, lookups: VolumeLookups
) -> list[tuple[str, bytes, int | None]] | None:
    """The files an API-backed volume holds, or None for directory volumes (emptyDir, hostPath, PVC)."""
    namespace = pod["metadata"]["namespace"]
    if "configMap" in volume or "secret" in volume:
        kind = "configMap" if "configMap" in volume else "secret"
        source = volume[kind]
        name = source.get("name") or source.get("secretName", "")
        fetch = lookups.config_map_files if kind == "configMap" else lookups.secret_files
        what = f"{kind} {namespace}/{name}"
        return _select(fetch(namespace, name), source.get("items"), bool(source.get("optional")), what)
    if "downwardAPI" in volume:
        return _downward_files(volume["downwardAPI"].get("items") or [], pod, facts)
    if "projected" in volume:
        files: list[tuple[str, bytes, int | None]] = []
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                audiences = [sat["audience"]] if sat.get("audience") else None
                token = lookups.token(audiences, int(sat.get("expirationSeconds") or 3607))
                files.append((sat["path"], token.token.encode(), None))
            elif "configMap" in source or "secret" in source:
                kind = "configMap" if "configMap" in source else "secret"
                files += volume_files({kind: source[kind]}, pod, facts, lookups) or []
            elif "downwardAPI" in source:
                files += _downward_files(source["downwardAPI"].get("items") or [], pod, facts)
        return files
    return None


def prepare_volume(
    volume: Mapping, pod: Mapping, pod_dir: Path, state_dir: Path, facts: PodFacts, lookups: VolumeLookups
) -> Path:
    """Create the volume on the host (raises ContainerStartError with reason ContainerCreating)."""
    path = volume_host_path(volume, pod, pod_dir, state_dir)
    if "hostPath" in volume:
        kind = volume["hostPath"].get("type") or ""
        if kind in ("", "DirectoryOrCreate"):
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        elif not path.exists():
            raise mount_error(f"hostPath {path} (type {kind}) does not exist")
        return path
    files = volume_files(volume, pod, facts, lookups)
    path.mkdir(parents=True, exist_ok=True)
    if files is None:
        return path
    source = next((volume[k] for k in ("configMap", "secret", "downwardAPI", "projected") if k in volume), {})
    default_mode = source.get("defaultMode") or DEFAULT_MODE
    for relative, content, mode in files:
        write_private(_safe_join(path, relative), content, mode or default_mode)
    return path


def container_mounts(
    container: Mapping, volume_paths: Mapping[str, Path], env: Mapping[str, str]
) -> list[Mount]:
    """The container's bind mounts, parents before children (pure)."""
    mounts = []
    for entry in container.get("volumeMounts") or []:
        if entry["name"] not in volume_paths:
            raise mount_error(f"volumeMount {entry['name']!r} names no volume of the pod")
        source = Path(volume_paths[entry["name"]])
        sub = entry.get("subPath") or expand(entry.get("subPathExpr") or "", env)
        if sub:
            source = _safe_join(source, sub)
        mounts.append(Mount(str(source), entry["mountPath"], bool(entry.get("readOnly"))))
    return sorted(mounts, key=lambda m: len(PurePosixPath(m.target).parts))


STAGE_DIR = "/run/rolloutfleet-kubelet-stage"


def mount_script(mounts: Sequence[Mount], working_dir: str | None, keep: Sequence[str] = ()) -> str:
    """`sh` script run inside the new mount namespace before exec'ing the container's command.

    Every source is first bound to a staging point on a private tmpfs, and only then are the
    targets mounted (parents first): otherwise a target that covers another mount's source (an
    emptyDir at /tmp, a hostPath under /tmp) would hide that source. A missing subPath source is
    created as a directory (as a kubelet does); a file source (e.g. one key of a ConfigMap via
    subPath) is mounted onto a file.

    `keep` are host paths the harness's programs need (the checkout, the interpreters' environments):
    a pod mount that covers one of them (an emptyDir at /tmp over a checkout under /tmp) would hide
    the program itself, so they are staged too and bound back over the mounts that cover them."""
    lines = ["set -e"]
    covered = [path for path in keep if any(_covers(m.target, path) for m in mounts)]
    if mounts:
        stage = shlex.quote(STAGE_DIR)
        lines += [f"mkdir -p {stage}", f"mount -t tmpfs -o size=1m rolloutfleet-stage {stage}"]
    for index, mount in enumerate(mounts):
        src, staged = shlex.quote(mount.source), shlex.quote(f"{STAGE_DIR}/{index}")
        lines.append(f"[ -e {src} ] || mkdir -p {src}")
        lines.append(f"if [ -d {src} ]; then mkdir -p {staged}; else : > {staged}; fi")
        lines.append(f"mount --bind {src} {staged}")
    for index, path in enumerate(covered):
        staged = shlex.quote(f"{STAGE_DIR}/keep-{index}")
        lines += [f"mkdir -p {staged}", f"mount --bind {shlex.quote(path)} {staged}"]
    order = sorted(range(len(mounts)), key=lambda i: len(PurePosixPath(mounts[i].target).parts))
    for index in order:
        mount = mounts[index]
        staged, dst = shlex.quote(f"{STAGE_DIR}/{index}"), shlex.quote(mount.target)
        parent = shlex.quote(str(PurePosixPath(mount.target).parent))
        lines.append(
            f"if [ -d {staged} ]; then mkdir -p {dst}; else mkdir -p {parent}; [ -e {dst} ] || : > {dst}; fi"
        )
        lines.append(f"mount --bind {staged} {dst}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {dst}")
    for index, path in enumerate(covered):
        staged, target = shlex.quote(f"{STAGE_DIR}/keep-{index}"), shlex.quote(path)
        lines += [f"mkdir -p {target}", f"mount --bind {staged} {target}"]
    if working_dir:
        lines.append(f"mkdir -p {shlex.quote(working_dir)} && cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def _covers(target: str, path: str) -> bool:
    """Whether mounting at `target` hides `path` (the same path or one below it)."""
    return PurePosixPath(path).is_relative_to(PurePosixPath(target))


def remove_tree(path: Path) -> None:
    """Remove a pod's directory without following symlinks out of it."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        os.unlink(path)
