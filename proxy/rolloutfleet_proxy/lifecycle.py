"""The proxy's one life state (starting, serving, draining, drained) and its turns in flight."""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

from .session import Session


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # refusing new work, writing what it holds for the successor
    DRAINED = "drained"  # everything written
    DRAIN_FAILED = "drain_failed"  # some sessions could not be written


class Lifecycle:
    """Where the proxy is in its life. A drain may begin during start-up (a SIGTERM while restoring):
    the phase then goes to DRAINING at once, and `wait_started` still tells when the start finished."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self._started = asyncio.Event()

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    @property
    def draining(self) -> bool:
        """True from the drain's first step on, also after it finished: nothing new is taken."""
        return self.phase in (Phase.DRAINING, Phase.DRAINED, Phase.DRAIN_FAILED)

    @property
    def start_finished(self) -> bool:
        return self._started.is_set()

    @property
    def lost_sessions(self) -> bool:
        """A drain began and did not write everything (not finished, or failed): exit non-zero."""
        return self.phase in (Phase.DRAINING, Phase.DRAIN_FAILED)

    def started(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.SERVING
        self._started.set()

    async def wait_started(self) -> None:
        await self._started.wait()

    def begin_drain(self) -> None:
        self.phase = Phase.DRAINING

    def drain_finished(self, ok: bool) -> None:
        self.phase = Phase.DRAINED if ok else Phase.DRAIN_FAILED


class CancelCause(enum.Enum):
    DELETED = "deleted"  # the session was deleted
    SHUTDOWN = "shutdown"  # the drain's grace period ended
    CLIENT_GONE = "client_gone"  # the turn's client disconnected


@dataclass
class InFlightGeneration:
    """A turn's generation task, and why it was cancelled (None while it was not)."""

    task: asyncio.Task
    cancelled_by: CancelCause | None = None


class InFlightTurns:
    """Every turn from taking its session to its journal commit, and the generation task of each turn
    waiting on the upstream (what a DELETE, the drain or a departed client cancels)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._generations: dict[Session, InFlightGeneration] = {}

    @property
    def closed(self) -> bool:
        """No new turn starts once the drain began."""
        return self._lifecycle.draining

    @property
    def generating(self) -> int:
        """Turns waiting on the upstream."""
        return len(self._generations)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    @contextlib.contextmanager
    def generation(self, session: Session, task: asyncio.Task) -> Iterator[InFlightGeneration]:
        generation = InFlightGeneration(task)
        self._generations[session] = generation
        try:
            yield generation
        finally:
            del self._generations[session]

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def cancel(self, session: Session, cause: CancelCause) -> bool:
        """Cancel the session's generation, if one is under way (a turn past it, committing, is not
        cancelled). Cancelling closes the upstream connection, which is what aborts the request on
        the engine (docs/proxy.md, "Cancelled turns")."""
        generation = self._generations.get(session)
        if generation is None or generation.task.done():
            return False
        generation.cancelled_by = generation.cancelled_by or cause
        generation.task.cancel()
        return True

    def cancel_all(self) -> None:
        for session in list(self._generations):
            self.cancel(session, CancelCause.SHUTDOWN)
