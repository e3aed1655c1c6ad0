"""python -m rolloutfleet_testkit.kubelet --kubeconfig PATH --state-dir DIR

Runs until SIGTERM or SIGINT, then kills every pod process and deletes its Node objects.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from .kubelet import ProcessKubelet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutfleet_testkit.kubelet",
        description="Process kubelet (test harness): runs a cluster's pods as local processes.",
    )
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    parser.add_argument("--state-dir", type=Path, required=True, help="volumes, logs, pod credentials")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.kubeconfig:
        parser.error("--kubeconfig (or KUBECONFIG) is required")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # one line per API request otherwise

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    kubelet = ProcessKubelet(args.kubeconfig, args.state_dir).start()
    print(f"process kubelet running; logs in {kubelet.state_dir / 'logs'}", flush=True)
    try:
        stop.wait()
    finally:
        kubelet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
