"""Bounded polling, for the kit and the tests: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(
    probe: Callable[[], Any],
    timeout_s: float = 30,
    what: str = "condition",
    interval_s: float = 0.2,
    *,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call `probe` every `interval_s` until it returns something truthy, and return that; after
    `timeout_s`, raise TimeoutError naming `what`, followed by `detail()` (a log tail, the last
    answer) when given."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            more = detail() if detail is not None else ""
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}{more}")
        time.sleep(interval_s)


def log_tail(log: Path | None, lines: int = 30) -> str:
    """The last `lines` of a log, on lines of their own after a newline: a wait's `detail`."""
    if log is None or not log.exists():
        return ""
    return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
