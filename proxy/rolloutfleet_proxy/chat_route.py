"""`POST /v1/sessions/{id}/chat/completions`, the OpenAI-compatible turn: the hot path.

A plain Starlette route on purpose: FastAPI's dependency solving costs every turn CPU."""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from .lifecycle import CancelCause
from .openai_format import (
    Completion,
    CompletionChoice,
    completion_body,
    completion_sse,
    json_body,
    logprobs_content,
    parse_chat_request,
)
from .route_auth import RouteAuth
from .runtime import ProxyRuntime
from .session import Session
from .settings import ProxySettings

CHAT_PATH = "/v1/sessions/{session_id}/chat/completions"
# The same route under a session's capability URL (`ids.capability_path`): the path's secret opens it.
CAPABILITY_CHAT_PATH = "/v1/sessions/{session_id}/cap/{capability}/chat/completions"
# On an answer sent again from the record (a retried request): the engine was not called.
REPLAYED_HEADER = "Idempotent-Replayed"


async def _cancel_when_client_leaves(receive: Receive, runtime: ProxyRuntime, session: Session) -> None:
    """Wait for the client to disconnect, then cancel the session's generation. The body has been
    read, so the server's next message is `http.disconnect` (uvicorn sends it also once the answer
    is complete; by then this task is cancelled)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    runtime.in_flight.cancel(session, CancelCause.CLIENT_GONE)


def chat_routes(runtime: ProxyRuntime, settings: ProxySettings, auth: RouteAuth) -> list[Route]:
    def authorized_session(request: Request, session_id: str):
        capability = request.path_params.get("capability")
        if capability is not None:
            return auth.capability_session(session_id, capability)
        return auth.authorized_session(request, session_id)

    async def read_json(request: Request):
        return json_body(await request.body())

    async def chat(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        authorized_session(request, session_id)  # 401/404 before the body is even read
        body = await read_json(request)
        chat_request = parse_chat_request(
            body,
            settings.default_max_tokens,
            settings.chat_template_kwargs,
            settings.tool_call_parser,
            settings.max_samples,
            request.headers.get("idempotency-key"),
        )
        # Looked up again after the await: from here to taking the session lock nothing yields,
        # so cleanup cannot detach the session in between.
        session = authorized_session(request, session_id)
        assert runtime.turns is not None and runtime.tokenizer is not None
        timings = request.scope["state"].setdefault("timings", {})
        # A client that disconnects cancels its turn's generation: no engine decodes for nobody.
        watcher = asyncio.create_task(_cancel_when_client_leaves(request.receive, runtime, session))
        try:
            result = await runtime.turns.run_turn(session, chat_request, timings)
        finally:
            watcher.cancel()
        choices = []
        for choice in result.choices:
            logprobs = None
            if chat_request.logprobs:
                logprobs = logprobs_content(
                    runtime.tokenizer.token_strings(choice.output_ids), choice.logprobs.tolist()
                )
            choices.append(CompletionChoice(choice.reply, choice.finish, logprobs))
        turns = [choice.turn for choice in result.choices]
        extra: dict = {"session_id": session_id, "turn": result.call}
        if len(turns) > 1:
            extra["turns"] = turns
        completion = Completion(
            completion_id=f"chatcmpl-{session_id}-{result.call}",
            model=settings.model_name,
            created=int(result.created),
            choices=choices,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=sum(len(choice.output_ids) for choice in result.choices),
            extra=extra,
        )
        headers = {REPLAYED_HEADER: "true"} if result.replayed else None
        if chat_request.stream:
            return StreamingResponse(
                completion_sse(completion, chat_request.include_usage),
                media_type="text/event-stream",
                headers=headers,
            )
        return Response(completion_body(completion), media_type="application/json", headers=headers)

    return [
        Route(CHAT_PATH, chat, methods=["POST"]),
        Route(CAPABILITY_CHAT_PATH, chat, methods=["POST"]),
    ]
