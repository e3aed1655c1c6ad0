"""The test kit image's entrypoint: runs the program TESTKIT_PROGRAM names, with the container's
args (pods that give a command bypass it). One image serves every role the tests need besides the
SGLang emulator (images/sglang-emulator)."""

from __future__ import annotations

import os
import sys

PROGRAMS = {
    "stats-standin": [sys.executable, "-m", "rolloutfleet_testkit.stats_standin"],
    "rollout-example": [sys.executable, "-m", "rolloutfleet_client.rollout_example"],
    "upstream-stub": [sys.executable, "-m", "rolloutfleet_testkit.upstream_stub"],
    "sglang-router": [sys.executable, "-m", "sglang_router.launch_router"],
}


def main() -> None:
    name = os.environ.get("TESTKIT_PROGRAM", "")
    if name not in PROGRAMS:
        sys.exit(f"TESTKIT_PROGRAM must be one of {', '.join(PROGRAMS)} (got {name!r})")
    argv = PROGRAMS[name] + sys.argv[1:]
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
