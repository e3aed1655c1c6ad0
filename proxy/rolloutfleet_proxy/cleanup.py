"""Stale-session cleanup: sessions idle past the timeout leave memory through the storage.

Order for every session that leaves: detach from the store (under the store lock), hand it to the
storage (which snapshots it under its own lock and writes it in a worker thread, or drops it when
there is no storage), then forget it with the reason the storage gives and journal its departure, or
put it back if its write failed so nothing is lost and the next cycle retries. Each cycle then deletes
the stored images nothing references any more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .failures import Failure
from .heap import HeapTrimmer
from .session import Session
from .stats import Counters, Gauges
from .storage import Pending, Storage
from .storage.images import ImageHolder
from .storage.routing_store import routing_key
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy.cleanup")
YIELD_EVERY = 256  # sessions handled between yields to the event loop in bulk steps


class StaleSessionCleaner:
    def __init__(
        self,
        store: SessionStore,
        storage: Storage,
        trimmer: HeapTrimmer,
        counters: Counters,
        gauges: Gauges,
        timeout_s: float,
        interval_s: float,
        image_holders: Callable[[], list[ImageHolder]] = list,
    ):
        self._image_holders = image_holders
        self._store = store
        self._storage = storage
        self._trimmer = trimmer
        self._counters = counters
        self._gauges = gauges
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._departed_at_last_trim = 0

    def _journal_end(self, session: Session, reason: str) -> Pending:
        try:
            return self._storage.ended(session, reason)
        except Failure:
            return None  # storage unavailable: the session may come back after a restart (not lost)

    async def _commit_ends(self, pending: list[Pending]) -> None:
        for item in pending:
            try:
                await self._storage.commit(item)
            except Failure as exc:
                log.error("departures of stale sessions not journaled (%s); they may be restored again", exc)
                return

    async def collect_images(self) -> int:
        """Delete the images nothing references any more: no session held, no export batch not yet
        acknowledged, no request in flight (its pins). Returns how many left. On the loop only the
        list of holders is taken (one entry per session or batch with images); reading their digests,
        matching them against the index and deleting files run in a worker thread."""
        images = self._storage.images
        if not len(images):
            return 0
        since = images.epoch()  # with the holders, in one step of the loop
        holders = self._image_holders()
        gone = await asyncio.to_thread(images.collect, holders, since)
        self._counters.images_deleted += len(gone)
        return len(gone)

    async def collect_routing(self) -> int:
        """Delete the routing replay rows of sessions no longer held (their departure is journaled
        by now: a stale session's rows are beside its dump, an exported one's in its batch)."""
        held = {routing_key(s.session_id, s.key_digest) for s in self._store.all_sessions()}
        return await self._storage.routing.collect(held)

    async def run_once(self) -> int:
        """Dump and evict every stale session; returns how many left memory."""
        started = time.monotonic()
        async with self._store.lock:
            stale = self._store.detach_stale(time.monotonic(), self.timeout_s)
        evicted = 0
        if stale:
            written = await self._storage.write_stale(stale)
            reason = written.departure.reason
            pending = []
            async with self._store.lock:
                for i, session in enumerate(written.done, 1):
                    self._store.forget(session, reason)
                    pending.append(self._journal_end(session, reason))
                    if i % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # let requests in between batches
                for session in written.failed:
                    self._store.reattach(session)
            await self._commit_ends(pending)
            evicted = len(written.done)
            del stale
        await self.collect_images()
        await self.collect_routing()
        # Trim when anything left memory since the last trim: stale dumps here, but also DELETEs and
        # export batches freed by an acknowledgement, an expiry or a drop.
        c = self._counters
        departed = (
            c.sessions_evicted
            + c.sessions_dropped
            + c.batches_acknowledged
            + c.batches_expired
            + c.batches_dropped
        )
        if departed != self._departed_at_last_trim and self._trimmer.available:
            self._departed_at_last_trim = departed
            if await asyncio.to_thread(self._trimmer.trim):
                self._counters.heap_trims += 1
        self._counters.cleanup_cycles += 1
        self._gauges.last_cleanup_seconds = round(time.monotonic() - started, 6)
        if evicted:
            log.info("cleanup evicted %d stale sessions in %.3fs", evicted, self._gauges.last_cleanup_seconds)
        return evicted
