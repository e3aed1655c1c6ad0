"""SGLang's own command line for the SGLang emulator (a test stand-in for GPU SGLang servers), so
the engine pods the operator builds (`python3 -m sglang.launch_server --model-path … --tp-size …`)
run it unchanged in the emulator's image (images/sglang-emulator, whose `sglang` shim calls `main`).

  --model-path/--model P → --tokenizer-path P (an explicit --tokenizer-path wins)
  --host, --port, --log-level, --context-length, --weight-version kept;
  --served-model-name N → --model-name N;  --random-seed S → --seed S;
  --max-total-tokens N → --cache-capacity-tokens N (the prefix cache's capacity);
  --token-delay-s kept (the emulator's own: time per decode step, for tests that need generations
  in flight); every other flag is dropped with its value (--tp-size, --mem-fraction-static, …).
  A flag takes the next word as its value unless that word starts with `--`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rolloutfleet_testkit.sglang_args import launch_flags

ENGINE_FLAGS = {
    "--model-path": "--tokenizer-path",
    "--model": "--tokenizer-path",
    "--tokenizer-path": "--tokenizer-path",
    "--host": "--host",
    "--port": "--port",
    "--log-level": "--log-level",
    "--served-model-name": "--model-name",
    "--random-seed": "--seed",
    "--context-length": "--context-length",
    "--weight-version": "--weight-version",
    "--token-delay-s": "--token-delay-s",
    # SGLang's KV pool size in tokens, which its radix cache lives in: the emulator's cache capacity.
    "--max-total-tokens": "--cache-capacity-tokens",
}


def emulator_args(args: Sequence[str]) -> list[str]:
    """SGLang launch_server arguments → the emulator's (pure)."""
    values: dict[str, str] = {}
    model_path: str | None = None
    for flag, value in launch_flags(args).items():
        if value is None or flag not in ENGINE_FLAGS:
            continue
        if flag in ("--model-path", "--model"):
            model_path = value
        else:
            values[ENGINE_FLAGS[flag]] = value
    if model_path is not None:
        values.setdefault("--tokenizer-path", model_path)
    return [word for flag, value in values.items() for word in (flag, value)]


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    from .server import main as serve

    serve(emulator_args(sys.argv[1:] if argv is None else argv))
