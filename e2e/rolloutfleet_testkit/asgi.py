"""The few raw-ASGI pieces the test stand-ins share (upstream_stub, stats_standin): they skip a
framework on purpose, to stay cheap per request and small in memory."""

from __future__ import annotations

import orjson

JSON_HEADERS = [(b"content-type", b"application/json")]


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def send_json(send, status: int, payload: object) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": orjson.dumps(payload)})


async def lifespan(receive, send) -> None:
    """Answer the server's lifespan messages (nothing to set up or tear down)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
