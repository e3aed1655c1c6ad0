"""Pod IPs: one loopback address per pod (all of 127/8 reaches `lo` on Linux).

Each pod gets its own address so that many pods can listen on the same port (e.g. every SGLang
engine on :30000, found by the router as http://<podIP>:30000). 127.0.0.0/24 is never handed out:
127.0.0.1 is the node's (hostIP) and the control plane's. Addresses are handed out round-robin, so
a just-released address is not reused while clients may still hold it.

Several harnesses may run on one machine at once (a test run beside a demo): each claims its own
block 127.N.0.0/16 (N = 1…254) with a lock file, so their pods never share an address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import tempfile
import threading
from pathlib import Path

FIRST = ipaddress.IPv4Address("127.0.1.1")
LAST = ipaddress.IPv4Address("127.255.255.254")


def usable(address: ipaddress.IPv4Address) -> bool:
    """Inside the pod range and not a .0 or .255 (which look like network/broadcast addresses)."""
    return FIRST <= address <= LAST and address.packed[3] not in (0, 255)


class AddressBlockLock:
    """An exclusive claim on 127.N.0.0/16, held (by an open, flock'ed file) until `release()`."""

    def __init__(self, lock_dir: Path | None = None):
        directory = lock_dir or Path(tempfile.gettempdir())
        for block in range(1, 255):
            fd = os.open(directory / f"rolloutfleet-kubelet-127.{block}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.block, self._fd = block, fd
            return
        raise RuntimeError("every 127.N.0.0/16 address block is claimed by another process kubelet")

    @property
    def first(self) -> str:
        return f"127.{self.block}.0.1"

    @property
    def last(self) -> str:
        return f"127.{self.block}.255.254"

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


class AddressPool:
    def __init__(self, first: str = str(FIRST), last: str = str(LAST)):
        self._first, self._last = ipaddress.IPv4Address(first), ipaddress.IPv4Address(last)
        self._next = self._first
        self._used: set[ipaddress.IPv4Address] = set()
        self._lock = threading.Lock()

    def allocate(self, preferred: str | None = None) -> str:
        """A free address; `preferred` (a pod's existing podIP, e.g. after a harness restart) if free."""
        with self._lock:
            if preferred:
                wanted = ipaddress.IPv4Address(preferred)
                if self._mine(wanted) and wanted not in self._used:
                    self._used.add(wanted)
                    return preferred
            for _ in range(int(self._last) - int(self._first) + 1):
                candidate = self._next
                self._next = candidate + 1 if candidate < self._last else self._first
                if self._mine(candidate) and candidate not in self._used:
                    self._used.add(candidate)
                    return str(candidate)
        raise RuntimeError("no free pod address")

    def _mine(self, address: ipaddress.IPv4Address) -> bool:
        return usable(address) and self._first <= address <= self._last

    def release(self, address: str | None) -> None:
        if address:
            with self._lock:
                self._used.discard(ipaddress.IPv4Address(address))

    def in_use(self) -> set[str]:
        with self._lock:
            return {str(a) for a in self._used}
