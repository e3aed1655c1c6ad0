"""python -m rolloutfleet_testkit.controlplane up|down|status|build [--dir DIR]"""

from __future__ import annotations

import argparse
from pathlib import Path

from .build import ensure_binaries
from .cluster import ClusterState, default_dir, down, status, up


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m rolloutfleet_testkit.controlplane", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "build"])
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"cluster state directory (default {default_dir()})"
    )
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_binaries())
    elif args.command == "up":
        print(f"export KUBECONFIG={up(args.dir).kubeconfig}")
    elif args.command == "down":
        down(args.dir)
    else:
        components = status(args.dir)
        if not components:
            print("no cluster")
            return 1
        state = ClusterState.load((args.dir or default_dir()).resolve())
        print(f"KUBECONFIG={state.kubeconfig}")
        for name, line in components.items():
            print(f"{name:26} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
