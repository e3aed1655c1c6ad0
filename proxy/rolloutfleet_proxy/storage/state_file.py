"""`<dump_dir>/state.json`: the model version, the pause and the admission counters, across restarts.

Small, written atomically in a worker thread: at once (and awaited) when the trainer changes the
version or pauses, otherwise at most every `FLUSH_INTERVAL_S` when the counters moved, and by the
shutdown drain. Losing the last second of counters to a crash is harmless: `accepted` is rebased on
start anyway, and the others are statistics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from ..stats import Counters
from .dumps import write_atomic

log = logging.getLogger("rolloutfleet.proxy.state")

STATE_FILE = "state.json"
FORMAT = "rolloutfleet.proxy-state"
FORMAT_VERSION = 1
FLUSH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ProxyState:
    model_version: int = 0
    paused: bool = False
    enqueued: int = 0
    accepted: int = 0
    rejected: int = 0
    refused: int = 0


class StateFormatError(ValueError):
    pass


def encode_state(state: ProxyState) -> bytes:
    return orjson.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(state)})


def decode_state(data: bytes) -> ProxyState:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise StateFormatError(f"not JSON: {exc}") from None
    if (
        not isinstance(raw, dict)
        or raw.get("format") != FORMAT
        or raw.get("format_version") != FORMAT_VERSION
    ):
        raise StateFormatError(f"not a {FORMAT} v{FORMAT_VERSION} document")
    fields = {}
    for name, default in asdict(ProxyState()).items():
        value = raw.get(name, default)
        if type(value) is not type(default) or (isinstance(value, int) and value < 0):
            raise StateFormatError(f"{name} must be a non-negative {type(default).__name__}, not {value!r}")
        fields[name] = value
    return ProxyState(**fields)


def state_path(dump_dir: Path) -> Path:
    return dump_dir / STATE_FILE


def read_state(dump_dir: Path) -> ProxyState | None:
    """The saved state, None when there is none (blocking). Raises StateFormatError when unreadable."""
    try:
        data = state_path(dump_dir).read_bytes()
    except FileNotFoundError:
        return None
    return decode_state(data)


def write_state(dump_dir: Path, state: ProxyState) -> None:
    write_atomic(state_path(dump_dir), encode_state(state))


class StateKeeper:
    """Writes `snapshot()` to the state file off the event loop, one write at a time, newest wins."""

    def __init__(self, dump_dir: Path, snapshot: Callable[[], ProxyState], counters: Counters):
        self._dump_dir = dump_dir
        self._snapshot = snapshot
        self._counters = counters
        self._lock = asyncio.Lock()
        self._written: ProxyState | None = None

    async def save(self) -> bool:
        """Write the current state; False (logged, counted) when the write failed."""
        async with self._lock:  # taken inside the lock: a queued save always writes the newest state
            state = self._snapshot()
            try:
                await asyncio.to_thread(write_state, self._dump_dir, state)
            except Exception as exc:
                self._counters.state_write_failures += 1
                log.error("writing %s failed: %s: %s", state_path(self._dump_dir), type(exc).__name__, exc)
                return False
            self._written = state
            return True

    async def flush_if_changed(self) -> None:
        """The background flush (every FLUSH_INTERVAL_S): writes only when something moved."""
        if self._snapshot() != self._written:
            await self.save()
