"""HTTP routes the trainer uses (admin key): export and acknowledge trajectories, set the model
version, pause and resume generation."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from rolloutfleet_wire.errors import ErrorCode
from rolloutfleet_wire.export_format import MEDIA_TYPE, batch_json
from rolloutfleet_wire.session_tree import SAMPLE_MODES, SAMPLES_LATEST, SampleShape
from starlette.responses import Response

from .errors import bad_request, draining, not_a_json_object
from .export_buffer import ExportBatch
from .generation import MAX_MODEL_VERSION
from .ids import SESSION_ID_RULE, is_valid_session_id
from .openai_format import json_body
from .responses import json_response
from .runtime import ProxyRuntime

MAX_EXPORT_TRAJECTORIES = 10000
MAX_PAUSE_WAIT_S = 3600.0
BATCH_ID_HEADER = "X-RolloutFleet-Batch-Id"
TRAJECTORIES_HEADER = "X-RolloutFleet-Trajectories"


def parse_sample_shape(body: dict[str, Any]) -> SampleShape:
    """`samples` ("latest", "leaves" or "turns") and `drop_replaced` (a boolean), both optional."""
    mode = body.get("samples", SAMPLES_LATEST)
    if mode not in SAMPLE_MODES:
        raise bad_request(ErrorCode.INVALID_BODY, f"samples must be one of {', '.join(SAMPLE_MODES)}")
    drop_replaced = body.get("drop_replaced", False)
    if not isinstance(drop_replaced, bool):
        raise bad_request(ErrorCode.INVALID_BODY, "drop_replaced must be a boolean")
    return SampleShape(mode, drop_replaced)


def parse_export_request(body: Any) -> tuple[list[str] | None, int, SampleShape]:
    """`{"session_ids": [...]}` or `{"max_trajectories": N}`, exactly one of them, and the shape of
    the samples (`parse_sample_shape`)."""
    if not isinstance(body, dict):
        raise not_a_json_object()
    shape = parse_sample_shape(body)
    unknown = set(body) - {"session_ids", "max_trajectories", "samples", "drop_replaced"}
    if unknown:
        raise bad_request(ErrorCode.INVALID_BODY, f"unknown fields: {', '.join(sorted(unknown))}")
    if ("session_ids" in body) == ("max_trajectories" in body):
        raise bad_request(ErrorCode.INVALID_BODY, "give exactly one of session_ids and max_trajectories")
    if "max_trajectories" in body:
        limit = body["max_trajectories"]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_EXPORT_TRAJECTORIES:
            raise bad_request(
                ErrorCode.INVALID_MAX_TRAJECTORIES,
                f"max_trajectories must be an integer from 1 to {MAX_EXPORT_TRAJECTORIES}",
            )
        return None, limit, shape
    ids = body["session_ids"]
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_EXPORT_TRAJECTORIES:
        raise bad_request(
            ErrorCode.INVALID_SESSION_IDS, f"session_ids must be a list of 1 to {MAX_EXPORT_TRAJECTORIES} ids"
        )
    if not all(isinstance(i, str) and is_valid_session_id(i) for i in ids):
        raise bad_request(ErrorCode.INVALID_SESSION_IDS, f"session ids are {SESSION_ID_RULE}")
    if len(set(ids)) != len(ids):
        raise bad_request(ErrorCode.INVALID_SESSION_IDS, "session_ids lists an id more than once")
    return ids, len(ids), shape


def parse_model_version(body: Any) -> int:
    if not isinstance(body, dict):
        raise not_a_json_object()
    version = body.get("model_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_MODEL_VERSION:
        raise bad_request(
            ErrorCode.INVALID_MODEL_VERSION, f"model_version must be an integer from 0 to {MAX_MODEL_VERSION}"
        )
    return version


def wants_json(request: Request) -> bool:
    """`?format=json|safetensors` wins; otherwise JSON only when the Accept header asks for JSON."""
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "safetensors"):
            raise bad_request(ErrorCode.INVALID_PARAMETER, "format must be json or safetensors")
        return fmt == "json"
    accept = request.headers.get("accept", "")
    return "application/json" in accept and MEDIA_TYPE not in accept


async def batch_response(batch: ExportBatch, as_json: bool, status: int = 200) -> Response:
    data = batch.data  # our own reference: an acknowledgement meanwhile cannot empty it
    headers = {BATCH_ID_HEADER: batch.batch_id, TRAJECTORIES_HEADER: str(batch.num_trajectories)}
    if status == 201:
        headers["Location"] = f"/v1/exports/{batch.batch_id}"
    if as_json:
        body = await asyncio.to_thread(batch_json, data)  # decoding and JSON are CPU: off the loop
        return Response(body, status_code=status, headers=headers, media_type="application/json")
    return Response(data, status_code=status, headers=headers, media_type=MEDIA_TYPE)


def trainer_router(runtime: ProxyRuntime, require_admin: Callable[[Request], None]) -> APIRouter:
    router = APIRouter()
    exports = runtime.exports

    def refuse_while_draining() -> None:
        if runtime.lifecycle.draining:
            raise draining("the proxy is shutting down; its batches and state continue on its replacement")

    def valid_batch_id(batch_id: str) -> None:
        if not is_valid_session_id(batch_id):
            raise bad_request(ErrorCode.INVALID_BATCH_ID, f"batch ids are {SESSION_ID_RULE}")

    # --- exports ---------------------------------------------------------------------------------

    @router.post("/v1/exports", status_code=201)
    async def create_export(request: Request) -> Response:
        require_admin(request)
        as_json = wants_json(request)
        raw = await request.body()
        session_ids, limit, shape = parse_export_request(json_body(raw) if raw.strip() else None)
        refuse_while_draining()
        batch = await exports.export(session_ids, limit, shape)
        if batch is None:
            return Response(status_code=204)
        return await batch_response(batch, as_json, 201)

    @router.get("/v1/exports")
    async def list_exports(request: Request) -> Response:
        require_admin(request)
        refuse_while_draining()
        now = time.monotonic()
        batches = [b.summary(now) for b in exports.buffer]
        return json_response(
            {"total": len(batches), "bytes": exports.buffer.bytes, "batches": batches, "ttl_s": exports.ttl_s}
        )

    @router.get("/v1/exports/{batch_id}")
    async def get_export(batch_id: str, request: Request) -> Response:
        require_admin(request)
        as_json = wants_json(request)
        valid_batch_id(batch_id)
        refuse_while_draining()
        return await batch_response(exports.buffer.get(batch_id), as_json)

    @router.post("/v1/exports/{batch_id}/ack")
    async def acknowledge_export(batch_id: str, request: Request) -> Response:
        require_admin(request)
        valid_batch_id(batch_id)
        refuse_while_draining()
        batch = await exports.acknowledge(batch_id)
        runtime.counters.batches_acknowledged += 1
        return json_response(
            {"batch_id": batch_id, "acknowledged": True, "trajectories": batch.num_trajectories}
        )

    # --- model version, pause --------------------------------------------------------------------

    @router.get("/v1/generation")
    async def generation_state(request: Request) -> Response:
        require_admin(request)
        return json_response(runtime.versions.generation_state())

    @router.get("/v1/generation/model_version")
    async def get_model_version(request: Request) -> Response:
        require_admin(request)
        return json_response({"model_version": runtime.generation.model_version})

    @router.put("/v1/generation/model_version")
    async def set_model_version(request: Request) -> Response:
        require_admin(request)
        version = parse_model_version(json_body(await request.body()))
        refuse_while_draining()
        change = await runtime.versions.set_model_version(version)
        return json_response({"model_version": runtime.generation.model_version, **change})

    @router.post("/v1/generation/pause")
    async def pause(request: Request, wait_s: float = 0.0) -> Response:
        require_admin(request)
        if not math.isfinite(wait_s) or not 0 <= wait_s <= MAX_PAUSE_WAIT_S:
            raise bad_request(ErrorCode.INVALID_PARAMETER, f"wait_s must be from 0 to {MAX_PAUSE_WAIT_S:g}")
        refuse_while_draining()
        runtime.generation.pause()
        persisted = await runtime.storage.save_state()
        if wait_s > 0:
            # Turns that passed the gate before the pause finish; wait for them, up to wait_s.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runtime.generation.idle.wait(), wait_s)
        return json_response({**runtime.versions.generation_state(), "persisted": persisted})

    @router.post("/v1/generation/resume")
    async def resume(request: Request) -> Response:
        require_admin(request)
        refuse_while_draining()
        runtime.generation.resume()
        persisted = await runtime.storage.save_state()
        return json_response({**runtime.versions.generation_state(), "persisted": persisted})

    return router
