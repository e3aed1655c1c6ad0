"""SGLang's `launch_server` command line as the operator writes it for engines, read by the test
stand-ins that run in engine pods (the SGLang emulator, the fixed-latency stand-in). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence


def launch_flags(args: Sequence[str]) -> dict[str, str | None]:
    """`--flag value`, `--flag=value` and boolean `--flag` → {flag: value or None}, in order (pure).
    A flag takes the next word as its value unless that word starts with `--`; stray positionals
    (SGLang takes none) are dropped."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--"):
            i += 1
            continue
        flag, has_inline, inline = word.partition("=")
        if has_inline:
            flags[flag], i = inline, i + 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[flag], i = args[i + 1], i + 2
        else:
            flags[flag], i = None, i + 1
    return flags
