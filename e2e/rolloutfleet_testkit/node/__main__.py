"""python -m rolloutfleet_testkit.node up|down|status|prepare [--dir DIR]

up       the control plane and both nodes (rf-cpu-node, rf-gpu-node), CoreDNS and kube-proxy; returns
         once they are ready and prints the admin kubeconfig (its server is reachable from this
         machine and from pods). The processes keep running after this command exits.
down     stops what `up` started and puts the machine back (sysctls, iptables, bridge, mounts, cgroups)
status   the recorded processes and whether they run
prepare  everything that is slow the first time (Debian packages, the Kubernetes binaries, CoreDNS,
         helm, promtool, kube-score, the registry, KWOK, kind and its node image, the project's images),
         with progress, so the tests then start in seconds; `up` waits for a prepare in progress
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path

from .cluster import default_dir, down, status, up


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutfleet_testkit.node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status", "prepare"])
    parser.add_argument("--dir", type=Path, default=None, help=f"state directory (default {default_dir()})")
    parser.add_argument(
        "--images",
        nargs="*",
        default=None,
        help="images to build and import (prepare: default all; up: default none); e.g. busybox testkit",
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for the nodes and DNS")
    return parser


def prepare(images: list[str]) -> None:
    from rolloutfleet_testkit.controlplane.build import (
        ensure_binaries,
        ensure_helm,
        ensure_kube_score,
        ensure_kwok,
        ensure_promtool,
        ensure_registry,
    )
    from rolloutfleet_testkit.images.catalog import build_image

    from .binaries import ensure_node_binaries
    from .packages import ensure_debian_packages

    ensure_debian_packages()
    # The images (mostly file copies and downloads) beside the Go builds (compilers on every core).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        images_built = pool.submit(lambda: [build_image(name) for name in images])
        # First what unit tests use (./dev test runs them while this builds in the background),
        # then what only the cluster's tests need.
        ensure_helm()
        ensure_promtool()
        ensure_kube_score()
        ensure_registry()
        ensure_binaries()
        ensure_node_binaries()
        ensure_kwok()
        # Last, for the kind smoke `./dev test` ends with: kind and its node image.
        from rolloutfleet_testkit.kind.cluster import ensure_kind
        from rolloutfleet_testkit.kind.nodeimage import node_image

        ensure_kind()
        node_image()
        built = images_built.result()
    if set(images) >= set(DEFAULT_IMAGES):
        # Every image the suite runs was just built: earlier builds' steps are garbage.
        from rolloutfleet_testkit.images.build import prune_layers

        removed = prune_layers({layer.parent for image in built for layer in image.layers})
        if removed:
            print(f"[images] removed {len(removed)} build steps of earlier builds", flush=True)


DEFAULT_IMAGES = ("proxy", "operator", "sglang-router", "testkit", "sglang-emulator", "busybox")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "prepare":
        from rolloutfleet_testkit.cache import exclusive

        with exclusive("prepare"):
            prepare(args.images if args.images is not None else list(DEFAULT_IMAGES))
    elif args.command == "up":
        cluster = up(args.dir, timeout_s=args.timeout)
        if args.images:
            from rolloutfleet_testkit.images import ensure_images

            ensure_images(args.images, cluster.containerd_addresses)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
    elif args.command == "down":
        down(args.dir)
    else:
        processes = status(args.dir)
        if not processes:
            print("no cluster", file=sys.stderr)
            return 1
        for name, line in processes.items():
            print(f"{name:34} {line}")
        return 0 if all(line.startswith("running") for line in processes.values()) else 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
