"""The images the tests and the demo run, built from the project's Dockerfiles (images/) and
imported into the nodes' containerd; tagged with the package's version, as users' images are.
The product's images (PRODUCT_IMAGES) can be pushed to a registry as `<registry>/<name>:<version>`
(`./dev images --push REGISTRY`, docs/release.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from rolloutfleet_testkit.version import project_version

from .base import ENV as BASE_ENV
from .base import STANDS_IN_FOR, base_key, base_layer, say
from .build import build
from .cache import images_cache
from .oci import import_archive, normalized, stream_image_archive, write_image_archive
from .registry import Blob, PushError, archive_blobs, compressed_layer, image_blobs, push, target
from .static import static_image

ROOT = Path(__file__).resolve().parents[3]
KEY_LABEL = "rolloutfleet.dev/build-key"
# What users deploy (the chart's operator, the proxy it runs, the default gateway): pushed by
# `--push`. The test kit's images are for tests only.
PRODUCT_IMAGES = ("operator", "proxy", "sglang-router")


def version() -> str:
    """The project's one version (pyproject.toml): image tags, the chart's version and appVersion
    (tests/operator/test_chart.py keeps them equal), the proxy's __version__ (through the package
    metadata)."""
    return project_version((ROOT / "pyproject.toml").read_text())


def image_name(name: str) -> str:
    """The local name of one of the Dockerfiles' images (`rolloutfleet-proxy:<version>`)."""
    return dockerfile_images()[name][1][0]


def pinned_version(package: str) -> str:
    """The version pyproject.toml pins `package` to (`package==X` in an extra)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in (r for group in extras.values() for r in group):
        name, _, pinned = requirement.partition("==")
        if name.strip() == package:
            return pinned.strip()
    raise KeyError(f"pyproject.toml pins no {package}")


def dockerfile_images() -> dict[str, tuple[Path, list[str]]]:
    """Image → (Dockerfile, names); every Dockerfile is built with the repository as its context."""
    v = version()
    return {
        # The operator's default gateway image, tagged with the router's own version.
        "sglang-router": (
            ROOT / "images/sglang-router/Dockerfile",
            [f"rolloutfleet-sglang-router:{pinned_version('sglang-router')}"],
        ),
        "proxy": (ROOT / "images/proxy/Dockerfile", [f"rolloutfleet-proxy:{v}"]),
        "operator": (ROOT / "images/operator/Dockerfile", [f"rolloutfleet-operator:{v}"]),
        "testkit": (ROOT / "images/testkit/Dockerfile", [f"rolloutfleet-testkit:{v}"]),
        "sglang-emulator": (
            ROOT / "images/sglang-emulator/Dockerfile",
            [f"rolloutfleet-sglang-emulator:{v}"],
        ),
    }


@dataclass(frozen=True)
class Built:
    """An image built (its layers cached); the archive to import is written only when needed."""

    name: str
    names: list[str]
    key: str
    layers: list[Path]
    config: dict
    prebuilt: Path | None = None  # an archive kept as it is (the small static images)

    def blobs(self) -> tuple[Blob, list[Blob]]:
        """The config and the compressed layers, as a registry stores them."""
        if self.prebuilt is not None:
            return archive_blobs(self.prebuilt, images_cache() / "push" / self.prebuilt.stem)
        return image_blobs(self.layers, self.config)

    def stream(self, file: BinaryIO, compressed: bool = False) -> None:
        """The archive `archive` writes, written to `file` (a pipe into an importer); `compressed`:
        with the layers gzip-compressed (once, then cached beside them, as for a push)."""
        if self.prebuilt is not None:
            with self.prebuilt.open("rb") as archive:
                shutil.copyfileobj(archive, file, 1 << 20)
            return
        packed = [compressed_layer(layer).file() for layer in self.layers] if compressed else None
        stream_image_archive(file, self.layers, self.config, self.names, packed)

    def archive(self) -> Path:
        if self.prebuilt is not None:
            return self.prebuilt
        out = images_cache() / "archives" / f"{self.name}-{self.key}.tar"
        if not out.exists():
            started = time.monotonic()
            write_image_archive(out, self.layers, self.config, self.names)
            size = out.stat().st_size / 2**20
            took = time.monotonic() - started
            say(f"{self.name}: archive of {len(self.layers)} layers, {size:.0f} MiB ({took:.0f}s)")
        return out


def build_image(name: str) -> Built:
    """The image built from its Dockerfile (cached by content), the base itself, or a small static one."""
    if name == "python":
        # The base the Dockerfiles build on, under the public names it stands in for (pods of tests
        # that name python:3.11 or python:3.11-slim run it).
        layer = base_layer()
        config = {"Env": list(BASE_ENV), "Cmd": ["python3"], "WorkingDir": "/"}
        return Built(name, list(STANDS_IN_FOR), f"base-{base_key()}", [layer], config)
    if name == "busybox":
        applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True, check=True)
        path = static_image(
            Path("/bin/busybox"), "busybox:1.36", ["/bin/busybox"], tuple(applets.stdout.split())
        )
        return Built(name, ["busybox:1.36"], path.stem, [], {}, prebuilt=path)
    dockerfile, names = dockerfile_images()[name]
    # The Dockerfiles label their images with VERSION (org.opencontainers.image.version).
    layers, config, key = build(dockerfile, ROOT, {"VERSION": version()})
    return Built(name, names, key, layers, config)


def imported_key(address: str, name: str) -> str | None:
    result = subprocess.run(
        ["ctr", "--address", address, "-n", "k8s.io", "images", "ls", f"name=={normalized(name)}"],
        capture_output=True,
        text=True,
    )
    for line in result.stdout.splitlines()[1:]:
        for part in line.split():
            if part.startswith(f"{KEY_LABEL}="):
                return part.split("=", 1)[1]
    return None


def ensure_images(names, addresses: list[str]) -> dict[str, list[str]]:
    """Each image built (cached by content) and imported into every containerd at `addresses` that
    does not hold this build of it yet; image → its names."""
    found = {}
    for name in names:
        started = time.monotonic()
        built = build_image(name)
        size = sum(layer.stat().st_size for layer in built.layers) / 2**20
        took = time.monotonic() - started
        say(f"{name}: built ({len(built.layers)} layers, {size:.0f} MiB) in {took:.1f}s")
        tags, key = built.names, built.key
        path = None
        for address in addresses:
            if imported_key(address, tags[0]) == key:
                continue
            if path is None:
                path = built.archive()
            started = time.monotonic()
            import_archive(path, address)
            for tag in tags:
                subprocess.run(
                    [
                        "ctr",
                        "--address",
                        address,
                        "-n",
                        "k8s.io",
                        "images",
                        "label",
                        normalized(tag),
                        f"{KEY_LABEL}={key}",
                    ],
                    capture_output=True,
                    check=True,
                )
            say(f"{name} imported into {address} in {time.monotonic() - started:.1f}s")
        if path is not None and built.prebuilt is None:
            path.unlink(missing_ok=True)  # containerd holds it now; gigabytes not to keep twice
        found[name] = tags
    return found


def push_images(names, registry: str, chunk_bytes: int | None = None) -> dict[str, list[str]]:
    """Each image built (cached) and pushed under every one of its names to `registry` (e.g.
    `ghcr.io/org`): image → the references pushed, `<registry>/<name>:<tag>@sha256:…`."""
    pushed = {}
    for name in names:
        built = build_image(name)
        started = time.monotonic()
        config, layers = built.blobs()  # compressed once per layer, then cached beside it
        say(f"{name}: {len(layers)} layers compressed (or cached) in {time.monotonic() - started:.1f}s")
        labels = built.config.get("Labels", {})
        annotations = {k: v for k, v in labels.items() if k.startswith("org.opencontainers.image.")}
        extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        pushed[name] = []
        for tag in built.names:
            where = target(registry, tag)
            digest = push(config, layers, where, annotations, say=say, **extra)
            pushed[name].append(f"{where.reference}@{digest}")
    return pushed


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Build the project's images (and import them into containerd)."
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="[build] NAME",
        help=f"images to build (default: the Dockerfiles' images); any of {', '.join(all_images())}",
    )
    parser.add_argument("--import", dest="addresses", action="append", default=[], help="a containerd socket")
    parser.add_argument(
        "--push",
        metavar="REGISTRY",
        help="push as REGISTRY/<name>:<version> (default: the product's images "
        f"{', '.join(PRODUCT_IMAGES)}); http://HOST:PORT for a registry without TLS",
    )
    args = parser.parse_args(argv)
    names = args.names[1:] if args.names[:1] == ["build"] else args.names
    unknown = sorted(set(names) - set(all_images()))
    if unknown:
        parser.error(f"unknown images {unknown}; known: {', '.join(all_images())}")
    started = time.monotonic()
    if args.push:
        try:
            pushed = push_images(names or list(PRODUCT_IMAGES), args.push)
        except (PushError, httpx.HTTPError) as error:
            parser.exit(1, f"push to {args.push} failed: {error}\n")
        for name, references in pushed.items():
            print(f"{name}: {' '.join(references)}")
        say(f"done in {time.monotonic() - started:.1f}s")
        return 0
    for name, tags in ensure_images(names or list(dockerfile_images()), args.addresses).items():
        print(f"{name}: {' '.join(tags)}")
    say(f"done in {time.monotonic() - started:.1f}s")
    return 0


def all_images() -> list[str]:
    return [*dockerfile_images(), "python", "busybox"]


if __name__ == "__main__":
    sys.exit(main())
