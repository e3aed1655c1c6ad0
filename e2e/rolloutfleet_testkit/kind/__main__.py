"""python -m rolloutfleet_testkit.kind up|down|test|image [ARGS]

up     Docker (from Debian), kind, the node image, a control-plane node and a GPU-like worker, our
       CNI, the project's images loaded; prints the environment for the e2e suite
down   the cluster, Docker and its packages gone; every host setting put back and checked
test   up, pytest ARGS against the cluster, down (also on failure); without ARGS the kind smoke,
       with only the images it runs: `test [--engine fixed-latency|emulator]`;
       `test --images proxy,operator,... ARGS` loads those images only
image  build the node image archive only (no Docker needed) and print its path
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from rolloutfleet_testkit.controlplane.build import binaries_dir

from .cluster import DEFAULT_IMAGES, down, environment_lines, up
from .config import SHARED_ENV

# The smoke (`./dev test` ends with it): the GPU sample fleet, its engines one of two test stand-ins
# for SGLang: the fixed-latency one in the test kit's image (CI), or the SGLang emulator (a tiny
# torch model; its image costs the GPU node 8.4 GB of disk).
SMOKE_IMAGES = {
    "fixed-latency": ("operator", "proxy", "sglang-router", "testkit"),
    "emulator": ("operator", "proxy", "sglang-router", "sglang-emulator"),
}


def smoke(engine: str) -> list[str]:
    if engine not in SMOKE_IMAGES:
        raise SystemExit(f"--engine must be one of {', '.join(SMOKE_IMAGES)} (got {engine!r})")
    test = "e2e/tests/test_kind_smoke.py::test_gpu_sample_fleet_on_kind_restores_a_deleted_proxy"
    return [f"{test}[{engine}]", "-m", "kind", "-x", "-q"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else ""
    if command == "up":
        # Progress to stderr (the image builder prints to stdout): stdout is only the environment.
        with contextlib.redirect_stdout(sys.stderr):
            env = up(args or DEFAULT_IMAGES)
        print(environment_lines(env), end="")
    elif command == "down":
        down()
    elif command == "image":
        from .nodeimage import node_image

        print(node_image())
    elif command == "test":
        status = 1
        try:
            # --engine: the smoke's engines (below); --images a,b,c: what to load for ARGS instead.
            engine = "fixed-latency"
            if args[:1] == ["--engine"]:
                engine, args = args[1], args[2:]
            default = smoke(engine)  # an unknown engine is refused before anything is installed
            images = SMOKE_IMAGES[engine] if not args else (*DEFAULT_IMAGES, "sglang-emulator")
            if args[:1] == ["--images"]:
                images, args = tuple(args[1].split(",")), args[2:]
            env = up(images)
            # kubectl and helm for the suite (it takes them from PATH on a cluster it did not start).
            env["PATH"] = f"{binaries_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
            pytest_args = list(args or default)
            if not any(arg.startswith("--basetemp") for arg in pytest_args):
                # The tests' files (tokenizer, dumps: hostPath volumes) where both nodes see them.
                pytest_args.append(f"--basetemp={env[SHARED_ENV]}/pytest")
            status = subprocess.run(
                [sys.executable, "-m", "pytest", *pytest_args], env={**os.environ, **env}
            ).returncode
        finally:
            down()
        return status
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
