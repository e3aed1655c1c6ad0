"""Which local command stands in for a container image (the process kubelet pulls no images).

| image repository                        | runs on this host                                            |
|-----------------------------------------|--------------------------------------------------------------|
| `…/rolloutfleet-proxy`                  | `PROXY_PYTHON -m rolloutfleet_proxy ARGS`                    |
| `…/rolloutfleet-operator`               | `python -m rolloutfleet_operator ARGS`                       |
| `…/rolloutfleet-stats-standin`          | `PROXY_PYTHON -m rolloutfleet_testkit.stats_standin ARGS`    |
| `…/rolloutfleet-rollout-example`        | `python -m rolloutfleet_client.rollout_example ARGS`         |
| `…sglang-router…`                       | `python -m sglang_router.launch_router ROUTER-ARGS`          |
| `lmsysorg/sglang` running the router    | same as above                                                |
| `lmsysorg/sglang` running launch_server | `python -m rolloutfleet_testkit.sglang_emulator.server ARGS` |
| anything else (busybox, python, …)      | `command` + `args` exactly as given, resolved on the host    |

`python` is this interpreter (`sys.executable`). PROXY_PYTHON is `$ROLLOUTFLEET_PROXY_PYTHON` when
set (the proxy-only environment `./dev` builds, like the proxy image), else this interpreter.
`rolloutfleet-stats-standin` is a test stand-in for the proxy image (its /stats, /healthz, /readyz
and drain only; see rolloutfleet_testkit/stats_standin.py), for memory-watchdog tests and benchmarks.

For the project's own images the image's entrypoint is the program, so `args` alone run it; a
`command` naming the program (`rolloutfleet-proxy`, `python -m rolloutfleet_proxy`) is replaced by
the local one and its remaining words kept. Any other command (e.g. `sh -c …`) runs as given.

SGLang engine translation (`python -m sglang.launch_server …`, or `sglang serve …`) to the CPU
reference engine, a test stand-in for GPU SGLang servers:
  --model-path/--model P → --tokenizer-path P (an explicit --tokenizer-path wins)
  --host, --port, --log-level kept;  --served-model-name N → --model-name N;  --random-seed S → --seed S
  every other flag is dropped with its value (--tp-size, --mem-fraction-static, --trust-remote-code, …).
  A flag takes the next word as its value unless that word starts with `--`.

An image without a local equivalent and without a `command` cannot run: the container waits with
reason ImageNotRunnable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import PurePosixPath

from .errors import image_error

ROUTER_MODULE = "sglang_router.launch_router"
ENGINE_MODULE = "rolloutfleet_testkit.sglang_emulator.server"
SGLANG_ENGINE_REPOSITORY = "lmsysorg/sglang"
# SGLang flag → reference engine flag; flags not listed are dropped.
ENGINE_FLAGS = {
    "--model-path": "--tokenizer-path",  # unless --tokenizer-path is given too
    "--model": "--tokenizer-path",
    "--tokenizer-path": "--tokenizer-path",
    "--host": "--host",
    "--port": "--port",
    "--log-level": "--log-level",
    "--served-model-name": "--model-name",
    "--random-seed": "--seed",
    "--context-length": "--context-length",
    "--weight-version": "--weight-version",
    # The emulator's own (SGLang has no such flag): time per decode step, for tests that need
    # generations in flight.
    "--token-delay-s": "--token-delay-s",
}


def repository(image: str) -> str:
    """`registry/path/name:tag@digest` → `path/name` (Docker Hub's implicit `docker.io/` and
    `library/` removed), lower-cased."""
    ref = image.split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        ref = ref[:colon]
    parts = ref.lower().split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]  # a registry host
    if len(parts) > 1 and parts[0] == "library":
        parts = parts[1:]
    return "/".join(parts)


def _python() -> list[str]:
    return [sys.executable]


def _proxy_python() -> list[str]:
    return [os.environ.get("ROLLOUTFLEET_PROXY_PYTHON") or sys.executable]


def _is_python(word: str) -> bool:
    name = PurePosixPath(word).name
    return name == "python" or (name.startswith("python") and name[6:].replace(".", "").isdigit())


def _after_program(argv: Sequence[str], programs: Sequence[str], module: str) -> list[str] | None:
    """The words after the program in `argv` when argv runs it (`prog …` or `python -m module …`)."""
    if argv and PurePosixPath(argv[0]).name in programs:
        return list(argv[1:])
    if len(argv) >= 3 and _is_python(argv[0]) and argv[1] == "-m" and argv[2] == module:
        return list(argv[3:])
    return None


def _router_args(argv: Sequence[str]) -> list[str] | None:
    rest = _after_program(argv, ("sglang-router", "smg", "amg"), ROUTER_MODULE)
    if rest is not None and argv and PurePosixPath(argv[0]).name in ("sglang-router", "smg", "amg"):
        # The console scripts take a subcommand; only `launch` (router only) maps.
        return rest[1:] if rest[:1] == ["launch"] else None
    return rest


def _engine_args(argv: Sequence[str]) -> list[str] | None:
    rest = _after_program(argv, (), "sglang.launch_server")
    if rest is None and len(argv) >= 2 and PurePosixPath(argv[0]).name == "sglang" and argv[1] == "serve":
        rest = list(argv[2:])
    return rest


def translate_engine_args(args: Sequence[str]) -> list[str]:
    """SGLang launch_server arguments → reference engine arguments (see the module docstring)."""
    values: dict[str, str] = {}
    model_path: str | None = None
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--"):
            i += 1  # a stray positional: SGLang takes none; drop it
            continue
        flag, has_inline, inline = word.partition("=")
        if has_inline:
            value, i = inline, i + 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 2
        else:
            value, i = None, i + 1  # a boolean flag
        if value is None or flag not in ENGINE_FLAGS:
            continue
        if flag in ("--model-path", "--model"):
            model_path = value
        else:
            values[ENGINE_FLAGS[flag]] = value
    if model_path is not None:
        values.setdefault("--tokenizer-path", model_path)  # an explicit --tokenizer-path wins
    return [word for flag, value in values.items() for word in (flag, value)]


def local_command(image: str, command: Sequence[str] | None, args: Sequence[str] | None) -> list[str]:
    """The argv to run for a container (command and args already `$(VAR)`-expanded).

    Raises ContainerStartError(ImageNotRunnable) when the image has no local equivalent and no command.
    """
    command, args = list(command or []), list(args or [])
    repo = repository(image)
    argv = command + args

    own = {
        "rolloutfleet-proxy": ("rolloutfleet_proxy", _proxy_python),
        "rolloutfleet-operator": (
            "rolloutfleet_operator",
            _python,
        ),
        "rolloutfleet-stats-standin": ("rolloutfleet_testkit.stats_standin", _proxy_python),
        "rolloutfleet-rollout-example": ("rolloutfleet_client.rollout_example", _python),
    }
    for name, (module, python) in own.items():
        if repo == name or repo.endswith("/" + name):
            rest = _after_program(command, (name,), module) if command else []
            if rest is not None:
                return [*python(), "-m", module, *rest, *args]

    if "sglang-router" in repo or repo == SGLANG_ENGINE_REPOSITORY:
        # The router image's entrypoint is the router; the engine image has none (args are the argv).
        router = args if not command and repo != SGLANG_ENGINE_REPOSITORY else _router_args(argv)
        if router is not None:
            return [*_python(), "-m", ROUTER_MODULE, *router]
    if repo == SGLANG_ENGINE_REPOSITORY:
        engine = _engine_args(argv)
        if engine is not None:
            return [*_python(), "-m", ENGINE_MODULE, *translate_engine_args(engine)]

    if command:
        return argv
    raise image_error(
        f"image {image!r} has no local equivalent on the process kubelet and the container gives no "
        "command (see rolloutfleet_testkit/kubelet/images.py)"
    )
