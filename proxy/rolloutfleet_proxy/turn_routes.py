"""`POST /v1/sessions/{id}/<dialect path>`, a turn in one of the session's dialects: the hot path.

One handler for every dialect (`dialects.py`): parse the request into the internal turn, run it,
answer in the dialect. Plain Starlette routes on purpose: FastAPI's dependency solving costs every
turn CPU. Errors are answered by the app's handlers, in the dialect's shape (`errors.error_body`)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from .anthropic_messages import MessagesDialect
from .chat_dialect import ChatDialect
from .dialects import Answered, Dialect, RequestContext
from .lifecycle import CancelCause
from .openai_format import json_body
from .openai_responses import ResponsesDialect
from .route_auth import RouteAuth
from .runtime import ProxyRuntime
from .session import Session
from .settings import ProxySettings

SESSION_PATH = "/v1/sessions/{session_id}"
# The same routes under a session's capability URL (`ids.capability_path`): the path's secret opens them.
CAPABILITY_PATH = "/v1/sessions/{session_id}/cap/{capability}"
CHAT_PATH = SESSION_PATH + ChatDialect.paths[0]
DIALECTS: tuple[Dialect, ...] = (ChatDialect(), MessagesDialect(), ResponsesDialect())
# On an answer sent again from the record (a retried request): the engine was not called.
REPLAYED_HEADER = "Idempotent-Replayed"


async def _cancel_when_client_leaves(receive: Receive, runtime: ProxyRuntime, session: Session) -> None:
    """Wait for the client to disconnect, then cancel the session's generation. The body has been
    read, so the server's next message is `http.disconnect` (uvicorn sends it also once the answer
    is complete; by then this task is cancelled)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    runtime.in_flight.cancel(session, CancelCause.CLIENT_GONE)


def turn_routes(runtime: ProxyRuntime, settings: ProxySettings, auth: RouteAuth) -> list[Route]:
    def authorized_session(request: Request, session_id: str):
        capability = request.path_params.get("capability")
        if capability is not None:
            return auth.capability_session(session_id, capability)
        return auth.authorized_session(request, session_id)

    def turn_handler(dialect: Dialect):
        async def turn(request: Request) -> Response:
            session_id = request.path_params["session_id"]
            authorized_session(request, session_id)  # 401/404 before the body is even read
            body = json_body(await request.body())
            context = RequestContext(
                session_id,
                settings.default_max_tokens,
                settings.chat_template_kwargs,
                settings.tool_call_parser,
                settings.max_samples,
                request.headers.get("idempotency-key"),
            )
            parsed = dialect.parse(body, context)
            del body  # the parsed turn holds what is needed
            # Looked up again after the await: from here to taking the session lock nothing yields,
            # so cleanup cannot detach the session in between.
            session = authorized_session(request, session_id)
            assert runtime.turns is not None and runtime.tokenizer is not None
            timings = request.scope["state"].setdefault("timings", {})
            # A client that disconnects cancels its turn's generation: no engine decodes for nobody.
            watcher = asyncio.create_task(_cancel_when_client_leaves(request.receive, runtime, session))
            try:
                result = await runtime.turns.run_turn(session, parsed.request, timings)
            finally:
                watcher.cancel()
            answered = Answered(
                session_id, settings.model_name, int(result.created), result, parsed, runtime.tokenizer
            )
            answer = dialect.answer(answered)
            headers = {REPLAYED_HEADER: "true"} if result.replayed else None
            if isinstance(answer, bytes):
                return Response(answer, media_type="application/json", headers=headers)
            return StreamingResponse(answer, media_type="text/event-stream", headers=headers)

        return turn

    routes = []
    for dialect in DIALECTS:
        handler = turn_handler(dialect)
        for path in dialect.paths:
            routes.append(Route(SESSION_PATH + path, handler, methods=["POST"]))
            routes.append(Route(CAPABILITY_PATH + path, handler, methods=["POST"]))
    return routes
