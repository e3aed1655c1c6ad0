"""Whether the dump volume takes writes: what the journal's writes and the storage check report, and
what /readyz, /stats and every write that must be durable read."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..failures import StorageUnavailable

log = logging.getLogger("rolloutfleet.proxy.journal")


@dataclass
class StorageHealth:
    """Whether this proxy can persist what it is told, and if not, why (shown on /readyz, /stats)."""

    ok: bool = True
    reason: str = ""
    since: float = 0.0  # Unix time of the last change
    failures: int = 0  # times it turned unavailable

    def fail(self, reason: str) -> None:
        if self.ok:
            self.failures += 1
            self.since = time.time()
            log.error("storage unavailable: %s", reason)
        self.ok, self.reason = False, reason

    def recover(self) -> None:
        if not self.ok:
            log.warning("storage writable again after: %s", self.reason)
            self.since = time.time()
        self.ok, self.reason = True, ""

    def refuse(self, what: str) -> StorageUnavailable:
        return StorageUnavailable(what, self.reason)
