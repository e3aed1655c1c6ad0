"""Building an image from a Dockerfile on this machine, without a Docker engine.

Each instruction that changes files (WORKDIR, COPY, RUN) runs on an overlay mount of the layers
below it, and what it changed (the overlay's upper directory) becomes the image's next layer, as
with Docker. A layer is cached by the chain of what made it (the base, each instruction, and the
content of the files COPY brings in), so a change to the sources rebuilds only the layers from the
first COPY of them: dependencies installed before it (torch is gigabytes) are built once. RUN runs
in a chroot of the merged tree with /proc, /sys and /dev mounted and this machine's network;
`RUN --mount=type=cache,target=…` binds a cache kept under the project's cache, as BuildKit does.
Stages (`FROM … AS builder`) build one after the other; `COPY --from=builder` copies from an
earlier stage's tree (its layers overlaid read-only), and the image is the last stage alone.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import base as base_image
from .cache import images_cache
from .dockerfile import Instruction, cache_mounts, key_values, parse, stage_source, substitute

ALWAYS_IGNORED = (".git", "**/__pycache__", "**/*.pyc", "**/.pytest_cache", "**/.ruff_cache", "**/*.egg-info")
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
FROM_STEPS = "from-steps"  # in a COPY --from step: the steps of the stage it copied from
# Downloads during RUN trust the bundle above (pip, requests, uv); not part of the image's config.
BUILD_ENV = {
    "PIP_CERT": HOST_CA_BUNDLE,
    "SSL_CERT_FILE": HOST_CA_BUNDLE,
    "REQUESTS_CA_BUNDLE": HOST_CA_BUNDLE,
}


def say(message: str) -> None:
    print(f"[images] {message}", flush=True)


@dataclass
class BuildState:
    """What the instructions so far have made: layers (upper directories), the config, variables."""

    key: str
    layers: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    config: dict = field(default_factory=dict)

    def variables(self) -> dict[str, str]:
        return {**self.args, **self.env}

    def next_stage(self) -> BuildState:
        """A stage built `FROM` this one: its files, environment and config; not its ARGs (Docker
        scopes an ARG to the stage that declares it)."""
        return BuildState(
            self.key, list(self.layers), dict(self.env), {}, self.workdir, copy.deepcopy(self.config)
        )


def ignore_patterns(context: Path) -> list[str]:
    patterns = list(ALWAYS_IGNORED)
    dockerignore = context / ".dockerignore"
    if dockerignore.exists():
        patterns += [
            line.strip()
            for line in dockerignore.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
    return patterns


def ignored(relative: str, patterns: list[str]) -> bool:
    parts = PurePosixPath(relative).parts
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(relative, pattern) or any(fnmatch.fnmatch(p, bare) for p in parts):
            return True
    return False


def context_files(context: Path, source: str, patterns: list[str]) -> list[Path]:
    """The files a COPY source names, relative to the context, sorted, ignored ones left out."""
    root = (context / source).resolve()
    if not str(root).startswith(str(context.resolve())):
        raise ValueError(f"COPY source outside the build context: {source}")
    if root.is_file():
        return [root.relative_to(context.resolve())]
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(context.resolve())
        if (path.is_file() or path.is_symlink()) and not ignored(relative.as_posix(), patterns):
            files.append(relative)
    return files


def content_key(context: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for relative in files:
        path = context / relative
        digest.update(relative.as_posix().encode() + b"\0")
        digest.update(str(path.stat().st_mode & 0o777).encode())
        digest.update(path.read_bytes() if path.is_file() else os.readlink(path).encode())
    return digest.hexdigest()


def chain(previous: str, *parts: str) -> str:
    return hashlib.sha256("\0".join((previous, *parts)).encode()).hexdigest()[:24]


@contextlib.contextmanager
def overlay(lowers: list[Path], upper: Path, scratch: Path) -> Iterator[Path]:
    """The merged tree of `lowers` (bottom first) with writes going to `upper`."""
    work, merged = scratch / "work", scratch / "merged"
    for path in (upper, work, merged):
        path.mkdir(parents=True, exist_ok=True)
    lowerdir = ":".join(str(p) for p in reversed(lowers))
    options = f"lowerdir={lowerdir},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        yield merged
    finally:
        # Lazily if a RUN left a process holding the tree: never a mount left behind.
        if subprocess.run(["umount", str(merged)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(merged)], check=False)


@contextlib.contextmanager
def chroot_mounts(merged: Path, caches: dict[str, Path]) -> Iterator[None]:
    """/proc, /sys, /dev and the host's DNS for RUN; the cache mounts at their targets."""
    mounted: list[Path] = []

    def bind(source: str | Path, target: Path, *extra: str) -> None:
        subprocess.run(["mount", "--bind", *extra, str(source), str(target)], check=True)
        mounted.append(target)

    try:
        for name in ("proc", "sys", "dev"):
            (merged / name).mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(merged / "proc")], check=True)
        mounted.append(merged / "proc")
        bind("/sys", merged / "sys")
        bind("/dev", merged / "dev")
        resolv = merged / "etc" / "resolv.conf"
        if resolv.is_symlink():
            resolv.unlink()
        resolv.touch()
        bind("/etc/resolv.conf", resolv)
        # This machine reaches package registries through a proxy whose CA only its own bundle
        # holds: the build's downloads trust it (the image keeps its own bundle).
        bundle = merged / HOST_CA_BUNDLE.lstrip("/")
        if Path(HOST_CA_BUNDLE).exists() and bundle.exists():
            bind(HOST_CA_BUNDLE, bundle)
        for target, source in caches.items():
            inside = merged / target.lstrip("/")
            inside.mkdir(parents=True, exist_ok=True)
            source.mkdir(parents=True, exist_ok=True)
            bind(source, inside)
        yield
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False)


def cache_directory(cache_id: str) -> Path:
    """Where a build cache lives; `uv` is uv's own cache, the one ./dev's environments fill
    (UV_CACHE_DIR, default under ROLLOUTFLEET_CACHE as ./dev sets it), so an image build installs
    wheels (torch's gigabytes too) without downloading them again."""
    if cache_id == "uv":
        return Path(os.environ.get("UV_CACHE_DIR") or images_cache().parent / "uv")
    return images_cache() / "build-caches" / cache_id.strip("/").replace("/", "_")


def run_in_chroot(merged: Path, state: BuildState, instruction: Instruction, log: Path) -> None:
    # As Docker: RUN's text is not substituted; ARG and ENV values reach it as its environment.
    command = instruction.exec_form or ["/bin/sh", "-c", instruction.text]
    env = [f"{k}={v}" for k, v in {**DEFAULT_ENV, **BUILD_ENV, **state.variables()}.items()]
    caches = {target: cache_directory(cache_id) for target, cache_id in cache_mounts(instruction).items()}
    with chroot_mounts(merged, caches), log.open("ab") as output:
        result = subprocess.run(
            ["chroot", str(merged), "/usr/bin/env", "-i", "-C", state.workdir, *env, *command],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"RUN (line {instruction.line}) failed with {result.returncode}:\n{tail}")


def copy_into(
    merged: Path, context: Path, state: BuildState, instruction: Instruction, files: list[Path]
) -> None:
    words = substitute(instruction.text, state.variables()).split()
    sources, dest = words[:-1], words[-1]
    target = PurePosixPath(dest if dest.startswith("/") else f"{state.workdir}/{dest}")
    to_directory = dest.endswith("/") or len(sources) > 1 or (context / sources[0]).is_dir()
    for source in sources:
        root = (context / source).resolve()
        for relative in files:
            path = context.resolve() / relative
            if root.is_dir():
                if root not in path.parents:
                    continue
                inside = target / path.relative_to(root).as_posix()
            elif path != root:
                continue
            else:
                inside = target / path.name if to_directory else target
            destination = merged / str(inside).lstrip("/")
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination, follow_symlinks=False)


@contextlib.contextmanager
def stage_tree(layers: list[Path], scratch: Path) -> Iterator[Path]:
    """An earlier stage's file tree, read-only: its one layer, or an overlay of its layers."""
    if len(layers) == 1:
        yield layers[0]
        return
    merged = scratch / "from"
    merged.mkdir(parents=True, exist_ok=True)
    lowerdir = ":".join(str(p) for p in reversed(layers))
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lowerdir}", str(merged)], check=True
    )
    try:
        yield merged
    finally:
        if subprocess.run(["umount", str(merged)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(merged)], check=False)


def copy_from_tree(tree: Path, merged: Path, sources: list[str], dest: str, workdir: str) -> None:
    """`COPY --from=stage SRC… DEST`: paths in the stage's tree (relative ones from its root, as
    BuildKit reads them) into `merged`; a directory's contents go under DEST, symlinks stay links,
    modes and times are kept (the stage's compiled .pyc files stay valid)."""
    target = PurePosixPath(dest if dest.startswith("/") else f"{workdir}/{dest}")
    to_directory = dest.endswith("/") or len(sources) > 1
    for source in sources:
        path = tree / source.lstrip("/")
        parent, root = path.parent.resolve(), tree.resolve()
        if (parent != root and root not in parent.parents) or not (path.exists() or path.is_symlink()):
            raise ValueError(f"COPY --from: no {source} in the stage")
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, merged / str(target).lstrip("/"), symlinks=True, dirs_exist_ok=True)
            continue
        inside = target / path.name if to_directory else target
        destination = merged / str(inside).lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, destination, follow_symlinks=False)


def layer_tar(upper: Path, out: Path) -> Path:
    """An upper directory as an image layer: overlay's whiteouts (0/0 character devices) and opaque
    directories become the image format's `.wh.` entries."""
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(upper.rglob("*")):
            relative = path.relative_to(upper).as_posix()
            info = path.lstat()
            if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                entry = tarfile.TarInfo(str(PurePosixPath(relative).parent / f".wh.{path.name}"))
                archive.addfile(entry)
                continue
            archive.add(str(path), arcname=relative, recursive=False)
            if path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    if os.getxattr(path, "trusted.overlay.opaque") == b"y":
                        archive.addfile(tarfile.TarInfo(f"{relative}/.wh..wh..opq"))
    partial.replace(out)
    return out


def build(
    dockerfile: Path, context: Path, build_args: dict[str, str] | None = None
) -> tuple[list[Path], dict, str]:
    """Layers (tar files, bottom first), the image config and the image's key."""
    instructions = parse(dockerfile.read_text())
    patterns = ignore_patterns(context)
    steps_dir = images_cache() / "layers"
    state: BuildState | None = None
    stages: dict[str, BuildState] = {}  # earlier stages by name and by index ("0", "1", …)
    finished = 0
    base_layer = None
    before_from: dict[str, str] = {}  # ARGs before FROM: seen by FROM, and after it only if declared again
    for instruction in instructions:
        keyword = instruction.keyword
        if keyword == "ARG":
            for name, default in key_values(instruction.text).items():
                value = (build_args or {}).get(name, default or before_from.get(name, ""))
                if state is None:
                    before_from[name] = value
                else:
                    state.args[name] = value
                    state.key = chain(state.key, "ARG", name, value)  # RUNs below see it
            continue
        if keyword == "FROM":
            source, alias = stage_source(substitute(instruction.text, before_from))
            if state is not None:
                stages[str(finished)] = state
                finished += 1
            if source.lower() in stages:
                state = stages[source.lower()].next_stage()
            elif source.partition("@")[0] in base_image.STANDS_IN_FOR:  # a digest pin stands for it too
                base_layer = base_image.base_layer()
                state = BuildState(key=chain("base", base_image.base_key()))
                state.layers = [base_image.base_rootfs()]
                state.env = dict(kv.split("=", 1) for kv in base_image.ENV)
            else:
                raise ValueError(f"FROM {source}: only {base_image.STANDS_IN_FOR} or an earlier stage")
            if alias is not None:
                stages[alias] = state
            continue
        if state is None:
            raise ValueError(f"line {instruction.line}: {keyword} before FROM")
        if keyword == "ENV":
            state.env.update(
                {k: substitute(v, state.variables()) for k, v in key_values(instruction.text).items()}
            )
        elif keyword == "USER":
            state.config["User"] = substitute(instruction.text, state.variables())
        elif keyword in ("ENTRYPOINT", "CMD"):
            form = instruction.exec_form or ["/bin/sh", "-c", instruction.text]
            state.config["Entrypoint" if keyword == "ENTRYPOINT" else "Cmd"] = form
        elif keyword == "EXPOSE":
            ports = state.config.setdefault("ExposedPorts", {})
            words = substitute(instruction.text, state.variables()).split()
            ports.update({(p if "/" in p else f"{p}/tcp"): {} for p in words})
        elif keyword == "LABEL":
            labels = {k: substitute(v, state.variables()) for k, v in key_values(instruction.text).items()}
            state.config.setdefault("Labels", {}).update(labels)
        else:
            _file_step(state, instruction, context, patterns, steps_dir, stages)
        state.key = chain(state.key, keyword, instruction.text, json.dumps(state.env, sort_keys=True))
    if state is None:
        raise ValueError(f"{dockerfile}: no FROM")
    state.config["Env"] = [f"{k}={v}" for k, v in state.env.items()]
    state.config["WorkingDir"] = state.workdir
    layers = [base_layer] + [upper.parent / "layer.tar" for upper in state.layers[1:]]
    return layers, state.config, state.key


def _file_step(
    state: BuildState,
    instruction: Instruction,
    context: Path,
    patterns: list[str],
    steps_dir: Path,
    stages: dict[str, BuildState],
) -> None:
    keyword = instruction.keyword
    files: list[Path] = []
    extra = ""
    from_stage = None
    if keyword == "WORKDIR":
        path = substitute(instruction.text, state.variables())
        state.workdir = str(PurePosixPath(state.workdir) / path)
    if keyword == "COPY" and instruction.flag("from"):
        name = instruction.flag("from")[0].lower()
        if name not in stages:
            raise ValueError(f"line {instruction.line}: COPY --from={name}: no earlier stage of that name")
        from_stage = stages[name]
        extra = from_stage.key  # the stage's key is its content's: the chain of what made it
    elif keyword == "COPY":
        sources = substitute(instruction.text, state.variables()).split()[:-1]
        files = [f for source in sources for f in context_files(context, source, patterns)]
        extra = content_key(context, files)
    key = chain(state.key, keyword, instruction.text, state.workdir, extra)
    step = steps_dir / key
    upper = step / "upper"
    if (step / "layer.tar").exists():
        os.utime(step)  # used now: pruning spares it (another checkout's image may need it)
        state.layers.append(upper)
        state.key = key
        return
    shutil.rmtree(step, ignore_errors=True)
    started = time.monotonic()
    say(f"{keyword} {instruction.text[:90]}")
    with overlay(state.layers, upper, step / "scratch") as merged:
        if keyword == "WORKDIR":
            (merged / state.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif from_stage is not None:
            words = substitute(instruction.text, state.variables()).split()
            with stage_tree(from_stage.layers, step / "scratch") as tree:
                copy_from_tree(tree, merged, words[:-1], words[-1], state.workdir)
            # The stage's steps are not the image's layers: named here so pruning keeps them.
            (step / FROM_STEPS).write_text("".join(f"{upper.parent}\n" for upper in from_stage.layers[1:]))
        elif keyword == "COPY":
            copy_into(merged, context, state, instruction, files)
        else:
            run_in_chroot(merged, state, instruction, step / "run.log")
    shutil.rmtree(step / "scratch", ignore_errors=True)
    layer_tar(upper, step / "layer.tar")
    say(f"  done in {time.monotonic() - started:.1f}s")
    state.layers.append(upper)
    state.key = key


# Steps used more recently than this are kept although the images built now do not use them: they
# belong to another checkout's images (a CI clone beside a work tree), which may be running.
PRUNE_UNUSED_FOR_S = 24 * 3600


def prune_layers(keep: set[Path], unused_for_s: float = PRUNE_UNUSED_FOR_S) -> list[Path]:
    """Remove the cached build steps not in `keep` (the step directories of the images built now)
    nor in the earlier stages those were copied from, and not used for `unused_for_s`: a source
    change leaves the steps of the old build behind, gigabytes for an image with torch. Returns what
    was removed."""
    steps_dir = images_cache() / "layers"
    keep, pending = set(keep), list(keep)
    while pending:  # and the earlier stages' steps a kept COPY --from step was made from
        named = pending.pop() / FROM_STEPS
        for step in map(Path, named.read_text().split() if named.exists() else ()):
            if step not in keep:
                keep.add(step)
                pending.append(step)
    removed = []
    stale_before = time.time() - unused_for_s
    for step in sorted(steps_dir.iterdir()) if steps_dir.exists() else ():
        if step.is_dir() and step not in keep and step.stat().st_mtime < stale_before:
            # A build killed mid-RUN (SIGKILL: no `finally`) leaves its overlay with the host's /proc,
            # /sys and /dev mounted inside: deleting through them would delete the host's devices.
            for mount_point in mounts_under(step):
                subprocess.run(["umount", "-l", str(mount_point)], check=False)
            if mounts_under(step):
                continue
            shutil.rmtree(step, ignore_errors=True)
            removed.append(step)
    return removed


def mounts_under(path: Path, mountinfo: str | None = None) -> list[Path]:
    """The mount points inside `path`, deepest first (from /proc/self/mountinfo, or `mountinfo`)."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    inside = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        # The kernel escapes blanks, tabs, newlines and backslashes in octal (\040 for a blank).
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
        if point.is_relative_to(path) and point != path:
            inside.append(point)
    return sorted(inside, key=lambda p: len(p.parts), reverse=True)
