"""The proxy's parts wired together, and their life: restore on start, the background tasks, the
drain on stop. The one place that chooses the storage: a dump directory, or none."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from typing import Any

from rolloutfleet_wire.export_format import ExportImages, ExportRouting

from .admission import AdmissionLimits
from .chat_tokens import TurnTokenizer
from .cleanup import StaleSessionCleaner
from .export_buffer import ExportBuffer
from .exports import ExportService
from .generation import GenerationControl
from .heap import HeapTrimmer
from .image_intake import ImageIntake
from .lifecycle import InFlightTurns, Lifecycle
from .looplag import LoopLagMonitor
from .model_version import ModelVersions, persisted_state
from .moe import load_routing_shape
from .periodic import PeriodicTask
from .replies import ReplyBuilder
from .runtime_stats import runtime_stats
from .settings import ProxySettings
from .shutdown import ShutdownDrain
from .stats import AdmissionCounters, Counters, Gauges
from .storage import DumpStorage, NoStorage, Storage
from .storage.images import ImageHolder
from .storage.routing_store import record_key
from .store import SessionStore
from .turns import TurnLimits, TurnService
from .upstream import SGLangClient
from .vision import load_vision_model, takes_images

log = logging.getLogger("rolloutfleet.proxy")


class ProxyRuntime:
    def __init__(self, settings: ProxySettings, tokenizer: TurnTokenizer | None = None):
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.in_flight = InFlightTurns(self.lifecycle)
        self.counters = Counters()
        self.gauges = Gauges()
        self.admission = AdmissionCounters()
        self.limits = AdmissionLimits(
            settings.max_staleness, settings.staleness_batch_share, settings.max_concurrent_sessions
        )
        self.store = SessionStore(settings.tombstone_capacity, self.admission)
        # A model directory with an image processor takes images (bodies then have room for them).
        self.takes_images = takes_images(settings.tokenizer_path)
        self.max_body_bytes = settings.body_limit(self.takes_images)
        self.generation = GenerationControl(settings.paused_turn_timeout_s)
        self.storage = self._choose_storage(settings)
        self.exports = ExportService(
            self.store,
            ExportBuffer(settings.tombstone_capacity),
            self.generation,
            self.counters,
            self.storage,
            settings.export_ttl_s,
        )
        self.versions = ModelVersions(
            self.generation,
            self.admission,
            self.limits,
            self.store,
            self.exports.buffer,
            self.storage.save_state,
        )
        self.trimmer = HeapTrimmer(enabled=settings.trim_heap)
        self.gauges.trim_available = self.trimmer.available
        self.loop_lag = LoopLagMonitor()
        self.cleaner = StaleSessionCleaner(
            self.store,
            self.storage,
            self.trimmer,
            self.counters,
            self.gauges,
            timeout_s=settings.stale_session_timeout_s,
            interval_s=settings.cleanup_interval_s,
            image_holders=self._image_holders,
        )
        self.tokenizer = tokenizer
        self.upstream: SGLangClient | None = None
        self.turns: TurnService | None = None
        # A cleanup cycle or compaction writes sessions, an expiry sweep export batches: the drain
        # takes both locks, so none of them runs during or after it.
        self._cycle_lock = asyncio.Lock()
        self._sweep_lock = asyncio.Lock()
        self.background = self._background_tasks()
        self.shutdown = ShutdownDrain(
            self.lifecycle,
            self.in_flight,
            self.generation,
            self.store,
            self.exports,
            self.storage,
            self.counters,
            (self._cycle_lock, self._sweep_lock),
            settings.drain_grace_s,
        )
        self._loop_lag_task: asyncio.Task | None = None
        self._trim_task: asyncio.Task | None = None

    def _choose_storage(self, settings: ProxySettings) -> Storage:
        """A dump directory's storage, or none (dropping sessions was chosen: settings refuse no dump
        directory otherwise)."""
        if settings.dump_dir is None:
            return NoStorage(self.counters)
        return DumpStorage(
            settings.dump_dir,
            self.counters,
            held_sessions=self.store.all_sessions,
            state=functools.partial(persisted_state, self.generation, self.admission),
            durability=settings.durability,
            journal_flush_interval_s=settings.journal_flush_interval_s,
            journal_compact_bytes=settings.journal_compact_bytes,
            check_interval_s=settings.storage_check_interval_s,
            write_concurrency=settings.dump_write_concurrency,
            lost_capacity=settings.tombstone_capacity,
        )

    def _background_tasks(self) -> dict[str, PeriodicTask]:
        settings, counters = self.settings, self.counters

        def draining() -> bool:
            return self.lifecycle.draining

        def count_cleanup_error() -> None:
            counters.cleanup_errors += 1

        tasks = [
            PeriodicTask(
                "export-expiry",
                lambda: self.exports.sweep_interval_s,
                lambda: self.exports.sweep(),
                lock=self._sweep_lock,
                finished=draining,
            ),
            PeriodicTask(
                "stats-heartbeat",
                settings.heartbeat_interval_s,
                lambda: self._log_stats(),
            ),
        ]
        if settings.cleanup_enabled:
            tasks.append(
                PeriodicTask(
                    "stale-session-cleanup",
                    lambda: self.cleaner.interval_s,
                    lambda: self.cleaner.run_once(),
                    lock=self._cycle_lock,
                    finished=draining,
                    on_failure=count_cleanup_error,
                )
            )
        tasks += self.storage.background_tasks(self._cycle_lock, draining)
        return {task.name: task for task in tasks}

    def _image_holders(self) -> list[ImageHolder]:
        """What keeps images: every session held and every batch not acknowledged that has any (their
        digests are read in a worker thread: here only one entry per holder)."""
        holders: list[ImageHolder] = [s.image_digests for s in self.store.all_sessions() if s.image_digests]
        holders += [b.image_digests for b in self.exports.buffer if b.image_digests]
        return holders

    async def _log_stats(self) -> None:
        log.info("stats", extra={"fields": self.stats()})

    # --- stats ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return runtime_stats(self)

    # --- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.storage.open()
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(
                TurnTokenizer.from_path,
                self.settings.tokenizer_path,
                tool_results=self.settings.tool_call_parser is not None,
                default_kwargs=self.settings.chat_template_kwargs,
            )
        vision = None
        if self.takes_images:
            vision = await asyncio.to_thread(
                load_vision_model, self.settings.tokenizer_path, self.tokenizer.hf_tokenizer
            )
            self.tokenizer.check_images(vision.image_token_id)
            self.exports.images = ExportImages(
                self.storage.images.read, vision.image_token_id, vision.processor_config
            )
        await asyncio.to_thread(self.storage.images.load)
        if self.settings.routed_experts:
            shape = await asyncio.to_thread(load_routing_shape, self.settings.tokenizer_path)
            self.storage.routing.shape = shape
            routing = self.storage.routing
            self.exports.routing = ExportRouting(lambda record: routing.read(record_key(record)), shape)
        self.upstream = SGLangClient(
            self.settings.upstream_url,
            self.settings.upstream_timeout_s,
            self.settings.upstream_max_connections,
            self.storage.images,
        )
        self.turns = TurnService(
            self.store,
            self.storage,
            self.tokenizer,
            self.upstream,
            self.counters,
            self.in_flight,
            self.generation,
            ReplyBuilder(self.tokenizer, self.settings.tool_call_parser, self.settings.reasoning_parser),
            self.settings.engine_logprobs,
            TurnLimits(
                self.settings.max_new_message_bytes,
                self.settings.offload_templating_bytes,
                self.settings.max_branches_per_session,
                self.settings.abort_ride_through_s,
            ),
            self.request_heap_trim,
            ImageIntake(self.storage.images, self.settings.image_limits(), vision, self.counters),
        )
        self.versions.restore(await self.storage.restore_state())
        await self._restore_sessions()
        await self.exports.restore()
        await self.cleaner.collect_images()  # what a crash left unreferenced (a failed turn's images)
        await self.cleaner.collect_routing()
        self.versions.rebase_after_restore()
        for task in self.background.values():
            task.start()
        self._loop_lag_task = asyncio.create_task(self.loop_lag.run(), name="loop-lag-monitor")
        # Long-lived start-up objects (modules, tokenizer) leave the collector's view, so collections
        # that requests trigger scan only what requests made. Not gc.collect(): that stalls the loop.
        gc.freeze()
        self.lifecycle.started()
        log.info(
            "proxy started",
            extra={
                "fields": {
                    "restored": self.counters.sessions_restored,
                    "restored_batches": self.counters.batches_restored,
                    "model_version": self.generation.model_version,
                    "paused": self.generation.paused,
                    "upstream": self.settings.upstream_url,
                }
            },
        )

    async def stop(self) -> None:
        # Stopped without a SIGTERM drain (an embedding server, the tests): drain now, so sessions,
        # export batches and the state are written here too.
        if self.lifecycle.start_finished:
            await self.request_drain()
        for task in self.background.values():
            await task.stop()
        if self._loop_lag_task is not None:
            self._loop_lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_lag_task
        if self.upstream is not None:
            await self.upstream.aclose()
        await self.storage.close()

    async def _restore_sessions(self) -> None:
        """Every session a predecessor held back into the store (nothing read is deleted)."""
        restored = await self.storage.restore_sessions()
        for session in restored.sessions:
            self.store.add(session)
        for session_id, why in restored.lost.items():
            self.store.mark_lost(session_id, why)
        del restored
        if self.trimmer.available:  # a replay grows arrays step by step: give the slack back
            await asyncio.to_thread(self.trimmer.trim)

    def request_drain(self) -> asyncio.Task:
        return self.shutdown.request()

    def request_heap_trim(self) -> None:
        """Trim the heap soon, in a worker thread, at most one trim at a time (after a large turn)."""
        if not self.trimmer.available or (self._trim_task is not None and not self._trim_task.done()):
            return

        async def trim() -> None:
            if await asyncio.to_thread(self.trimmer.trim):
                self.counters.heap_trims += 1

        self._trim_task = asyncio.create_task(trim(), name="heap-trim")
