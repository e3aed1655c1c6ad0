"""The model version the trainer publishes, the generation pause, and the admission counts anchored
to them: what the trainer's routes change and the state file keeps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .admission import (
    AdmissionLimits,
    accepted_after_version_change,
    admission_capacity,
    is_training_step,
    rebased_accepted,
)
from .export_buffer import ExportBuffer
from .generation import GenerationControl
from .stats import AdmissionCounters
from .storage.state_file import ProxyState
from .store import SessionStore


def persisted_state(generation: GenerationControl, admission: AdmissionCounters) -> ProxyState:
    """What the state file keeps across restarts."""
    return ProxyState(
        model_version=generation.model_version,
        paused=generation.paused,
        enqueued=admission.enqueued,
        accepted=admission.accepted,
        rejected=admission.rejected,
        refused=admission.refused,
    )


class ModelVersions:
    def __init__(
        self,
        generation: GenerationControl,
        admission: AdmissionCounters,
        limits: AdmissionLimits,
        store: SessionStore,
        export_buffer: ExportBuffer,
        save_state: Callable[[], Awaitable[bool]],
    ):
        self._generation = generation
        self._admission = admission
        self._limits = limits
        self._store = store
        self._export_buffer = export_buffer
        self._save_state = save_state

    def unconsumed_trajectories(self) -> int:
        """Trajectories produced and not yet consumed by the trainer: ready, or exported and not acked."""
        return self._store.ready_count + self._export_buffer.trajectories

    def admission_capacity(self) -> int | None:
        return admission_capacity(
            self._limits, self._generation.model_version, self._admission.accepted, self._store.running
        )

    def restore(self, state: ProxyState | None) -> None:
        """Take back the model version, the pause and the counters a predecessor saved."""
        if state is None:
            return
        self._generation.model_version = state.model_version
        if state.paused:
            self._generation.pause()
        self._admission.enqueued = state.enqueued
        self._admission.accepted = state.accepted  # rebased once the sessions are restored
        self._admission.rejected = state.rejected
        self._admission.refused = state.refused

    def rebase_after_restore(self) -> None:
        # Counting restarts here: anchor `accepted` to the recovered version (a counter restarted
        # at 0 would admit far past the staleness bound).
        self._admission.accepted = rebased_accepted(
            self._generation.model_version, self._limits.batch_share, self.unconsumed_trajectories()
        )

    async def set_model_version(self, version: int) -> dict[str, Any]:
        old = self._generation.model_version
        self._admission.accepted = accepted_after_version_change(
            self._admission.accepted, old, version, self._limits.batch_share, self.unconsumed_trajectories()
        )
        self._generation.model_version = version
        persisted = await self._save_state()
        return {
            "previous_model_version": old,
            "rebased": not is_training_step(old, version),
            "persisted": persisted,
        }

    def generation_state(self) -> dict[str, Any]:
        return {
            "model_version": self._generation.model_version,
            "paused": self._generation.paused,
            "generating_turns": self._generation.generating,
            "paused_turns": self._generation.waiting,
        }
