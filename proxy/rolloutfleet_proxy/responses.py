"""JSON responses, serialized with orjson (the app's and the trainer routes' one way to answer)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")
