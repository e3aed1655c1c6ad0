"""Pod IPs: one loopback address per pod, 127.0.1.1 upward (all of 127/8 reaches `lo` on Linux).

Each pod gets its own address so that many pods can listen on the same port (e.g. every SGLang
engine on :30000, found by the router as http://<podIP>:30000). 127.0.0.0/24 is never handed out:
127.0.0.1 is the node's (hostIP) and the control plane's. Addresses are handed out round-robin, so
a just-released address is not reused while clients may still hold it.
"""

from __future__ import annotations

import ipaddress
import threading

FIRST = ipaddress.IPv4Address("127.0.1.1")
LAST = ipaddress.IPv4Address("127.255.255.254")


def usable(address: ipaddress.IPv4Address) -> bool:
    """Inside the pod range and not a .0 or .255 (which look like network/broadcast addresses)."""
    return FIRST <= address <= LAST and address.packed[3] not in (0, 255)


class AddressPool:
    def __init__(self, first: str = str(FIRST)):
        self._next = ipaddress.IPv4Address(first)
        self._used: set[ipaddress.IPv4Address] = set()
        self._lock = threading.Lock()

    def allocate(self, preferred: str | None = None) -> str:
        """A free address; `preferred` (a pod's existing podIP, e.g. after a harness restart) if free."""
        with self._lock:
            if preferred:
                wanted = ipaddress.IPv4Address(preferred)
                if usable(wanted) and wanted not in self._used:
                    self._used.add(wanted)
                    return preferred
            for _ in range(int(LAST) - int(FIRST) + 1):
                candidate = self._next
                self._next = candidate + 1 if candidate < LAST else FIRST
                if usable(candidate) and candidate not in self._used:
                    self._used.add(candidate)
                    return str(candidate)
        raise RuntimeError("no free pod address")

    def release(self, address: str | None) -> None:
        if address:
            with self._lock:
                self._used.discard(ipaddress.IPv4Address(address))

    def in_use(self) -> set[str]:
        with self._lock:
            return {str(a) for a in self._used}
